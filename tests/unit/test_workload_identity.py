"""Workload identity and rule placeholders, pure parts: placeholder parsing (E2B's syntax), the checks of
``iam.tokens`` and of rules at create, ``get_info``'s network, and a minted token verified against the issuer's
JWKS as a relying party would (PyJWT). The gateway's use of them is tested in
tests/integration/test_gateway_egress.py; the API's routes in tests/e2e/test_egress_e2e.py."""

from __future__ import annotations

from datetime import UTC, datetime

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from podbay import oidc
from podbay.config import Settings
from podbay.egress_placeholders import MalformedPlaceholder, parse, substitute
from podbay.errors import InvalidRequest
from podbay_api.e2b.network import check_placeholders, egress_policy, iam_tokens, network_info


def test_placeholders_parse_as_e2b_reads_them() -> None:
    v = "a${e2b.identity.tokens.aws}b${e2b.secrets. API-Key }c"
    found = parse(v)
    assert [(p.kind, p.name) for p in found] == [("token", "aws"), ("secret", "api-key")]
    assert substitute(v, found, {("token", "aws"): "T", ("secret", "api-key"): "S"}) == "aTbSc"
    assert parse("Bearer plain $ { } text") == []
    assert [p.name for p in parse("${e2b.identity.tokens. token key }")] == [" token key "]  # taken as written
    for bad in ("${e2b.identity.tokens.aws", "${e2b.secrets.}", "${e2b.secrets.a b}",
                "${e2b.identity.tokens.${e2b.secrets.x}", "${e2b.secrets.x.y}"):
        with pytest.raises(MalformedPlaceholder):
            parse(bad)


def test_iam_tokens_checked_as_e2b_checks_them() -> None:
    ok = {"tokens": {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}}
    assert iam_tokens(ok) == {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}
    assert iam_tokens(None) == {} and iam_tokens({"tokens": {}}) == {}
    bad = [
        ({"tokens": {"aws": {"audience": "", "tokenType": "JWT-SVID"}}}, "iam.tokens.aws.audience"),
        ({"tokens": {"aws": {"audience": "x", "tokenType": "OIDC"}}}, "iam.tokens.aws.tokenType"),
        ({"tokens": {"a}b": {"audience": "x", "tokenType": "JWT-SVID"}}}, "iam.tokens"),
        ({"tokens": {f"t{i}": {"audience": "x", "tokenType": "JWT-SVID"} for i in range(6)}}, "too many"),
        ({"other": {}}, "iam"),
    ]
    for body, where in bad:
        with pytest.raises(InvalidRequest, match=where.replace(".", r"\.")):
            iam_tokens(body)


def test_rules_may_name_only_registered_tokens_and_well_formed_placeholders() -> None:
    tokens = {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}
    rules = {"api.example.com": [{"transform": {"headers": {
        "Authorization": "Bearer ${e2b.identity.tokens.aws}", "X-Key": "${e2b.secrets.openai}"}}}]}
    policy = egress_policy(None, {"allowOut": ["api.example.com"], "rules": rules})
    check_placeholders(policy, tokens)
    with pytest.raises(InvalidRequest, match="'aws' is not registered"):
        check_placeholders(policy, {})
    broken = egress_policy(None, {"rules": {"a.example": [{"transform": {"headers": {"X": "${e2b.secrets.x"}}}]}})
    with pytest.raises(InvalidRequest, match="not closed"):
        check_placeholders(broken, tokens)


def test_get_info_network_is_what_was_given() -> None:
    given = {"allowOut": ["api.example.com"], "denyOut": ["0.0.0.0/0"], "egressProxy": None,
             "rules": {"api.example.com": [{"transform": {"headers": {"X-Team": "blue"}}}]}}
    assert network_info(given) == {k: v for k, v in given.items() if v is not None}
    assert network_info(None) is None


def _key() -> oidc.SigningKey:
    return oidc.SigningKey("kid-1", rsa.generate_private_key(public_exponent=65537, key_size=2048),
                           datetime.now(UTC))


def test_minted_token_verifies_against_the_jwks_with_its_claims() -> None:
    settings = Settings(oidc_issuer="https://api.podbay.example/", oidc_token_ttl_s=300)
    key = _key()
    token = oidc.mint(key, settings, tenant_id="tnt_a", sandbox_id="sbx_1", audience="sts.amazonaws.com",
                      now=1_000_000)
    jwk = RSAAlgorithm.to_jwk(key.key.public_key(), as_dict=True) | {"kid": key.kid, "alg": oidc.ALG}
    assert jwt.get_unverified_header(token)["kid"] == "kid-1"
    claims = jwt.decode(token, jwt.PyJWK(jwk), algorithms=["RS256"], audience="sts.amazonaws.com",
                        issuer="https://api.podbay.example", options={"verify_exp": False})
    assert claims["sub"] == "spiffe://api.podbay.example/tenant/tnt_a/sandbox/sbx_1"
    assert claims["exp"] - claims["iat"] == 300 and claims["iat"] == 1_000_000
    assert claims["tenant_id"] == "tnt_a" and claims["sandbox_id"] == "sbx_1"
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(token, jwt.PyJWK(jwk), algorithms=["RS256"], audience="other",
                   options={"verify_exp": False})
    with pytest.raises(jwt.ExpiredSignatureError):  # minted long ago: expired
        jwt.decode(token, jwt.PyJWK(jwk), algorithms=["RS256"], audience="sts.amazonaws.com")
    other = _key()  # signed by a key the issuer does not list
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(oidc.mint(other, settings, tenant_id="tnt_a", sandbox_id="sbx_1", audience="a"),
                   jwt.PyJWK(jwk), algorithms=["RS256"], audience="a")


def test_discovery_names_the_jwks_under_the_issuer() -> None:
    doc = oidc.discovery(Settings(oidc_issuer="https://api.podbay.example"))
    assert doc["issuer"] == "https://api.podbay.example"
    assert doc["jwks_uri"] == "https://api.podbay.example/.well-known/jwks.json"
    assert doc["id_token_signing_alg_values_supported"] == ["RS256"]


def test_e2b_rules_apply_the_most_specific_host_only() -> None:
    """E2B: "Exact rules take precedence, followed by the longest matching wildcard suffix, and matching rule
    sets are not merged"; podbay's own transforms keep merging every match in order."""
    from podbay_gateway.policy import transform_headers

    rules = {"*.example.com": [{"transform": {"headers": {"Authorization": "wild", "X-Wild": "1"}}}],
             "*.api.example.com": [{"transform": {"headers": {"X-Deeper": "1"}}}],
             "v1.api.example.com": [{"transform": {"headers": {"X-Exact": "1"}}},
                                    {"transform": {"headers": {"X-Exact": "2", "X-Second": "1"}}}]}
    policy = egress_policy(None, {"rules": rules})
    assert policy is not None and policy.transform_match == "most_specific"
    assert transform_headers(policy, "v1.api.example.com") == {"X-Exact": "2", "X-Second": "1"}
    assert transform_headers(policy, "v2.api.example.com") == {"X-Deeper": "1"}
    assert transform_headers(policy, "www.example.com") == {"Authorization": "wild", "X-Wild": "1"}
    assert transform_headers(policy, "example.com") == {}
    merged = policy.model_copy(update={"transform_match": "all"})
    assert transform_headers(merged, "v1.api.example.com") == {
        "Authorization": "wild", "X-Wild": "1", "X-Deeper": "1", "X-Exact": "2", "X-Second": "1"}
    # Stored and answered as before for podbay's own policies: the default is left out of the JSON.
    assert "transform_match" not in merged.model_dump()
    assert policy.model_dump()["transform_match"] == "most_specific"


def test_values_redacted_on_a_connection_stay_bounded() -> None:
    """A token per request on one kept-alive connection: the gateway's set of values to redact (searched in
    every response) keeps the newest and never grows past its cap."""
    from podbay_gateway.shaping import MAX_REDACTED, remember_redacted

    known: set[str] = set()
    for i in range(3 * MAX_REDACTED):
        remember_redacted(known, {f"token-{i}"})
        assert f"token-{i}" in known and len(known) <= MAX_REDACTED
    remember_redacted(known, {"secret", "token-x"})
    assert {"secret", "token-x"} <= known
