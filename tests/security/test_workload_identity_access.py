"""Workload identity and rule placeholders across tenants (docs/SECURITY.md, "Tenant vs tenant"; podbay.oidc,
services/api/e2b/network.py). Against the stack's real API and PostgreSQL, no microVM:

- tenant B cannot read or replace the network rules of A's sandbox (404, A's rules and tokens unchanged);
- B cannot name A's token in B's own sandbox's rules: token names are the sandbox's own ``iam.tokens``
  (400 at update_network; the gateway refuses such a request too, tests/integration/test_gateway_egress.py,
  which also shows that A's secret is never found for B's placeholder and that a guest's own header is
  never resolved);
- the issuer's documents are public and hold public keys only; the private key is stored sealed.
"""

from __future__ import annotations

import json
from typing import Any

from access_helpers import new_tenant, sql, template_and_sandbox

RULES = {"rules": {"api.example.com": [{"transform": {"headers": {
    "Authorization": "Bearer ${e2b.identity.tokens.aws}"}}}]}, "allowOut": ["api.example.com"]}
TOKENS = {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}


def test_another_tenants_rules_and_tokens_are_out_of_reach(stack: Any) -> None:
    a, b = new_tenant(stack, "wi-a"), new_tenant(stack, "wi-b")
    _, a_sbx = template_and_sandbox(stack, a, state="running")
    _, b_sbx = template_and_sandbox(stack, b, state="running")
    # access_helpers.sql is a bare connection (no JSON codec): JSON travels as text.
    sql(stack, "INSERT INTO e2b_sandboxes (sandbox_id, iam_tokens, network) VALUES ($1, $2::jsonb, $3::jsonb)",
        a_sbx, json.dumps(TOKENS), json.dumps(RULES))
    with b.http() as hb:
        assert hb.get(f"/e2b/sandboxes/{a_sbx}").status_code == 404
        for target in (a_sbx, a_sbx.replace("_", "-"), f"{a_sbx}%2F..", f"..%2F{a_sbx}"):
            r = hb.put(f"/e2b/sandboxes/{target}/network", json={"rules": {"api.example.com": [
                {"transform": {"headers": {"X-Stolen": "${e2b.identity.tokens.aws}"}}}]}})
            assert r.status_code in (404, 400), (target, r.status_code, r.text)
            assert "sts.amazonaws.com" not in r.text
        # B's own sandbox: the name of A's token is not B's.
        r = hb.put(f"/e2b/sandboxes/{b_sbx}/network", json=RULES)
        assert r.status_code == 400 and "'aws' is not registered" in r.json()["message"], r.text
    row = sql(stack, "SELECT iam_tokens, network FROM e2b_sandboxes WHERE sandbox_id = $1", a_sbx)[0]
    assert json.loads(row["iam_tokens"]) == TOKENS and json.loads(row["network"]) == RULES


def test_issuer_documents_are_public_and_hold_public_keys_only(stack: Any) -> None:
    import httpx

    with httpx.Client(base_url=stack.api_url, timeout=30) as anon:
        doc = anon.get("/.well-known/openid-configuration")
        assert doc.status_code == 200 and doc.json()["jwks_uri"].endswith("/.well-known/jwks.json")
        keys = anon.get("/.well-known/jwks.json")
        assert keys.status_code == 200 and keys.json()["keys"]
        for k in keys.json()["keys"]:
            assert k["kty"] == "RSA" and not set(k) & {"d", "p", "q", "dp", "dq", "qi"}, k
        # Nothing else under the prefix, encoded or not.
        for path in ("/.well-known/", "/.well-known/keys", "/.well-known/%2e%2e/v1/sandboxes",
                     "/.well-known/jwks.json/..%2F..%2Fv1%2Fcredentials"):
            assert anon.get(path).status_code == 404, path
        assert anon.post("/.well-known/jwks.json").status_code == 405
    for row in sql(stack, "SELECT backend, ciphertext, public_jwk FROM oidc_keys"):
        assert "d" not in json.loads(row["public_jwk"])
        if row["backend"] == "pg":
            assert b"PRIVATE KEY" not in row["ciphertext"]
