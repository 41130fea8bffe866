-- Credential placeholders (issue "Secrets never enter the sandbox"): the env a sandbox's commands get, fixed
-- at create (or fork) from the credentials in scope then: {"PODBAY_CRED_<NAME>": "podbay-credential:<name>"}.
-- Never a value: the gateway, not the guest, adds the real one. NULL = none.
ALTER TABLE sandboxes ADD COLUMN guest_env jsonb;

-- GET /v1/audit?sandbox_id=...: one sandbox's rows, newest first.
CREATE INDEX audit_log_tenant_sandbox ON audit_log (tenant_id, sandbox_id, id DESC) WHERE sandbox_id IS NOT NULL;
