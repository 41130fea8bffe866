-- Idempotency keys (POST /v1/sandboxes with an Idempotency-Key header): the first create with a key records
-- (tenant, key) -> sandbox in the transaction that inserts the sandbox, so a retry after a lost answer (the API
-- killed mid-request, a broken connection) finds the sandbox instead of making a second one. request_hash is a
-- SHA-256 of the request's scope and validated body: the same key with another body is refused (422). A key
-- expires idempotency_key_ttl_s after created_at: lookups ignore older rows, a new create replaces one, and
-- the API's sweep deletes them.
CREATE TABLE idempotency_keys (
    tenant_id     text NOT NULL REFERENCES tenants(id),
    key           text NOT NULL,
    request_hash  text NOT NULL,
    sandbox_id    text NOT NULL REFERENCES sandboxes(id),
    operation_id  text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
