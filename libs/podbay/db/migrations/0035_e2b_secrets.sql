-- E2B's Secrets API (services/api/e2b/secrets.py): an E2B secret is a podbay credential (its value sealed by
-- the credential store, never returned) whose id starts with sec_; this table holds what E2B adds to it:
-- customer metadata, the version an update bumps, and the time of the last update. Such a credential is
-- created with an empty sandbox scope, so it is injected nowhere until a rule names it.
CREATE TABLE e2b_secrets (
    credential_id  text PRIMARY KEY REFERENCES credentials (id),
    tenant_id      text NOT NULL REFERENCES tenants (id),
    metadata       jsonb NOT NULL DEFAULT '{}'::jsonb,
    version        integer NOT NULL DEFAULT 1,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX e2b_secrets_tenant ON e2b_secrets (tenant_id);
