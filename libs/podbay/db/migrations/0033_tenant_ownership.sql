-- Every template has an owner (issue 37, docs/SECURITY.md "tenant vs tenant"): owner_tenant is the tenant
-- that built it, or NULL for a shared template that the operator tenant (PODBAY_OPERATOR_TENANT) published
-- (base and what the operator builds: desktop, browser, code-interpreter ...). Tenants read shared templates
-- and cannot change them; another tenant's template is invisible to them (services/api/services/template_access.py).
-- Names stay global (they key node stores, object-store keys and warm slots): a name a tenant owns is not
-- free for another tenant's build until its owner removes it.
ALTER TABLE templates ADD COLUMN owner_tenant text REFERENCES tenants(id);

-- The owner a build registers its template under (NULL: shared, a build by the operator tenant); the node's
-- registration refuses a name that another owner holds meanwhile.
ALTER TABLE template_builds ADD COLUMN owner_tenant text;
UPDATE template_builds SET owner_tenant = tenant_id;

-- Existing templates: owned by the tenant of their latest build; none (base, images' roots): shared. The API
-- makes rows of the operator tenant shared at start (services/api/services/template_access.share_operator_templates),
-- as migrations do not know which tenant that is.
UPDATE templates t SET owner_tenant = (SELECT b.tenant_id FROM template_builds b WHERE b.name = t.name
                                       ORDER BY b.created_at DESC LIMIT 1);
CREATE INDEX templates_owner ON templates (owner_tenant) WHERE deleted_at IS NULL;

-- A tenant's sandboxes that count against its quotas (services/api/services/quotas.ACTIVE_STATES: the same list, so
-- that the planner uses this index for the usage query under every create).
CREATE INDEX sandboxes_tenant_active ON sandboxes (tenant_id)
    WHERE state IN ('pending', 'starting', 'running', 'paused', 'suspending', 'resuming');

-- Per-tenant quotas (services/api/services/quotas.py); a NULL limit (or no row) is the default from settings
-- (PODBAY_QUOTA_SANDBOXES, _VCPUS, _MEMORY_MIB, _DISK_MIB, _BUILDS).
CREATE TABLE tenant_quotas (
    tenant_id   text PRIMARY KEY REFERENCES tenants(id),
    sandboxes   integer CHECK (sandboxes >= 0),
    vcpus       integer CHECK (vcpus >= 0),
    memory_mib  integer CHECK (memory_mib >= 0),
    disk_mib    integer CHECK (disk_mib >= 0),
    builds      integer CHECK (builds >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
