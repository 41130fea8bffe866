-- E2B's workload identity and network configuration as given (services/api/e2b/network.py, podbay.oidc):
-- iam_tokens is {name: {"audience", "tokenType"}} from the create call's iam.tokens, read by the egress gateway
-- to mint a token for a ${e2b.identity.tokens.<name>} placeholder; network is the E2B network configuration
-- (allowOut, denyOut, rules, dnsServers) that get_info returns, as create or update_network last set it.
ALTER TABLE e2b_sandboxes ADD COLUMN iam_tokens jsonb;
ALTER TABLE e2b_sandboxes ADD COLUMN network jsonb;

-- podbay as an OIDC issuer: the keys its workload identity tokens are signed with. The private key is sealed
-- by the credential store (podbay.credentials: ciphertext for the pg backend, secret_ref for openbao) under
-- the key id; public_jwk is what the JWKS route serves. A new key is made when the newest is older than the
-- rotation period; the JWKS lists the keys of the last two periods (current and previous).
CREATE TABLE oidc_keys (
    kid         text PRIMARY KEY,
    alg         text NOT NULL,
    public_jwk  jsonb NOT NULL,
    backend     text NOT NULL,
    ciphertext  bytea,
    secret_ref  text,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX oidc_keys_created ON oidc_keys (created_at DESC);
