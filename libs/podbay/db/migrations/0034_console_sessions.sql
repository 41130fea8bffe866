-- Web console sessions (services/api/console/session.py): a signed-in browser holds a random session id in an
-- HttpOnly cookie; only its sha256 is stored, with the API key it was opened with (the session acts as that
-- key's tenant and dies with it) and the CSRF token its changes must carry. Rows past expires_at are refused
-- and deleted by the next sign-in.
CREATE TABLE console_sessions (
    id_hash     bytea PRIMARY KEY,
    key_id      text NOT NULL REFERENCES api_keys(id) ON DELETE CASCADE,
    tenant_id   text NOT NULL,
    csrf_token  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX console_sessions_expires ON console_sessions (expires_at);
