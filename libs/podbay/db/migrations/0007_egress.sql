-- Egress, credentials and audit (docs/DESIGN.md §6; issue "Secrets never enter the sandbox").

-- Egress policy (podbay.contracts.egress.EgressPolicy as JSON). A sandbox's own policy wins; NULL means the
-- template's; a template's NULL means no egress at all.
ALTER TABLE sandboxes ADD COLUMN egress_policy jsonb;
ALTER TABLE templates ADD COLUMN egress_policy jsonb;

-- Credentials: the value is never stored here in the clear. backend = 'pg' keeps AES-GCM ciphertext
-- (12-byte nonce || ciphertext+tag, associated data = id) in `ciphertext`; backend = 'openbao' keeps the KV
-- path in `secret_ref`. Scope: the tenant, optionally narrowed to some sandboxes and/or templates (NULL = all).
CREATE TABLE credentials (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL REFERENCES tenants(id),
    name                text NOT NULL,
    hosts               text[] NOT NULL,            -- exact hosts or '*.example.com' wildcards
    path_prefix         text,                       -- NULL = any path
    header              text NOT NULL,              -- e.g. 'Authorization'
    format              text NOT NULL,              -- e.g. 'Bearer {value}'
    expires_at          timestamptz,
    rate_limit_per_min  integer,                    -- NULL = unlimited
    scope_sandboxes     text[],
    scope_templates     text[],
    backend             text NOT NULL CHECK (backend IN ('pg', 'openbao')),
    ciphertext          bytea,
    secret_ref          text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    deleted_at          timestamptz
);
CREATE UNIQUE INDEX credentials_tenant_name ON credentials (tenant_id, name) WHERE deleted_at IS NULL;

-- Audit log (created in 0001): who did what, and the gateway's decisions. Append-only, enforced here.
ALTER TABLE audit_log ADD COLUMN sandbox_id text;
ALTER TABLE audit_log ADD COLUMN decision text;     -- 'allow' | 'deny' for gateway rows, NULL otherwise
CREATE INDEX audit_log_tenant ON audit_log (tenant_id, id DESC);
CREATE INDEX audit_log_credential_use ON audit_log (target, at) WHERE action = 'credential.use' AND decision = 'allow';

CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log is append-only' USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER audit_log_no_update BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only();
