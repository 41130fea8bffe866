"""The workload identity key ring (podbay.oidc) on a real PostgreSQL, with each credential store backend (the
private key sealed as a credential value; OpenBao through its real server): a first key is made on demand, a
key older than the rotation period is replaced (the new key in the JWKS ``PUBLISH_S`` before it signs), racing
processes make one key, and the JWKS lists the current and the previous key (and one being published), so a
token of the previous key still verifies and one of an older key does not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import jwt
import pytest

from podbay import oidc
from podbay.config import Settings
from podbay.credentials import new_key

pytestmark = pytest.mark.integration


@pytest.fixture
async def ring(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Pool]:
    # The table is global: start and end empty, so keys sealed under this test's store key meet no one else.
    await pool.execute("DELETE FROM oidc_keys")
    yield pool
    await pool.execute("DELETE FROM oidc_keys")


def _verify(token: str, keys: dict) -> dict:
    kid = jwt.get_unverified_header(token)["kid"]
    match = [k for k in keys["keys"] if k["kid"] == kid]
    if not match:
        raise jwt.InvalidKeyError(f"kid {kid} not in the JWKS")
    return jwt.decode(token, jwt.PyJWK(match[0]), algorithms=["RS256"], audience="aud-1")


@pytest.mark.parametrize("backend", ["pg", "openbao"])
async def test_keys_rotate_with_overlap(ring: asyncpg.Pool, backend: str, request: pytest.FixtureRequest) -> None:
    extra = {}
    if backend == "openbao":
        addr, token = request.getfixturevalue("openbao")
        extra = {"openbao_addr": addr, "openbao_token": token}
    settings = Settings(credential_backend=backend, credential_key=new_key(), oidc_issuer="https://iss.test",
                        oidc_key_rotate_s=3600, **extra)
    # Racing processes with no key yet: one key is made.
    first = await asyncio.gather(*(oidc.current_key(ring, settings) for _ in range(4)))
    assert len({k.kid for k in first}) == 1
    assert await ring.fetchval("SELECT count(*) FROM oidc_keys") == 1
    row = await ring.fetchrow("SELECT backend, ciphertext, secret_ref FROM oidc_keys")
    assert row["backend"] == backend and (row["ciphertext"] is None) == (backend == "openbao")
    k1 = first[0]
    t1 = oidc.mint(k1, settings, tenant_id="t", sandbox_id="s", audience="aud-1")
    assert (await oidc.current_key(ring, settings)).kid == k1.kid  # not due: the same key

    # A period later: a new key, published at once but not signing until it has been for PUBLISH_S.
    await _age(ring, 7200)
    assert (await oidc.current_key(ring, settings)).kid == k1.kid
    k2_kid = await ring.fetchval("SELECT kid FROM oidc_keys ORDER BY created_at DESC LIMIT 1")
    assert k2_kid != k1.kid
    keys = await oidc.jwks(ring, settings)
    assert [k["kid"] for k in keys["keys"]] == [k2_kid, k1.kid]
    assert all(set(k) >= {"kty", "n", "e", "kid", "alg", "use"} and "d" not in k for k in keys["keys"])
    await _age(ring, oidc.PUBLISH_S + 60, kid=k2_kid)
    k2 = await oidc.current_key(ring, settings)
    assert k2.kid == k2_kid
    keys = await oidc.jwks(ring, settings)
    assert [k["kid"] for k in keys["keys"]] == [k2.kid, k1.kid]  # current and previous
    assert _verify(t1, keys)["sub"] == "spiffe://iss.test/tenant/t/sandbox/s"
    t2 = oidc.mint(k2, settings, tenant_id="t", sandbox_id="s", audience="aud-1")
    assert _verify(t2, keys)["aud"] == "aud-1"

    # Another period: a third key is published (three listed while it is), then signs; the oldest leaves the
    # JWKS and its tokens fail.
    await _age(ring, 7200)
    keys = await oidc.jwks(ring, settings)
    k3_kid = keys["keys"][0]["kid"]
    assert [k["kid"] for k in keys["keys"]] == [k3_kid, k2.kid, k1.kid]
    assert (await oidc.current_key(ring, settings)).kid == k2.kid
    await _age(ring, oidc.PUBLISH_S + 60, kid=k3_kid)
    keys = await oidc.jwks(ring, settings)
    assert [k["kid"] for k in keys["keys"]] == [k3_kid, k2.kid]
    assert (await oidc.current_key(ring, settings)).kid == k3_kid
    with pytest.raises(jwt.InvalidKeyError):
        _verify(t1, keys)
    assert _verify(t2, keys)["iss"] == "https://iss.test"


async def _age(pool: asyncpg.Pool, seconds: int, kid: str | None = None) -> None:
    """Move keys' creation back by ``seconds`` (all, or ``kid``'s)."""
    await pool.execute("UPDATE oidc_keys SET created_at = created_at - $1 * interval '1 second'"
                       " WHERE $2::text IS NULL OR kid = $2", seconds, kid)
