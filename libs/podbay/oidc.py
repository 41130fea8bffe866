"""podbay as an OIDC issuer of workload identity tokens (E2B's ``iam.tokens``; docs/egress.md "Workload identity").

A sandbox created with ``iam.tokens`` (``{name: {"audience", "tokenType": "JWT-SVID"}}``) gets, in the headers
its ``network.rules`` transforms set, a token for each ``${e2b.identity.tokens.<name>}`` placeholder: the egress
gateway mints it per request (:func:`mint`) and it never enters the guest. Relying parties (a cloud's web
identity federation, any OIDC verifier) fetch ``<issuer>/.well-known/openid-configuration`` and the JWKS it
names from the API (services/api/routes/oidc.py) and check the signature, ``iss``, ``aud`` and ``exp``.

Tokens are JWTs (RFC 7519) signed RS256 (RFC 7518 §3.3; the algorithm every federation accepts) with a key of
this module's key ring. Claims:

* ``iss``: :func:`issuer` (``settings.oidc_issuer``, default the API's own URL);
* ``sub``: :func:`subject`, ``spiffe://<issuer host>/tenant/<tenant id>/sandbox/<sandbox id>`` (a SPIFFE ID,
  as a JWT-SVID's subject must be; a verifier matches a tenant with a prefix, a sandbox exactly);
* ``aud``: the audience of the token's definition, exactly as given at create;
* ``iat``/``nbf``/``exp``: seconds since the epoch; ``exp`` = ``iat`` + ``settings.oidc_token_ttl_s`` (300);
* ``jti``: random, unique per token; ``tenant_id``, ``sandbox_id``: the same ids, unparsed.

Key ring (table ``oidc_keys``): RSA-2048 keys, the private half sealed by the credential store
(:mod:`podbay.credentials`, so it lives where credential values live: AES-GCM in PostgreSQL or OpenBao) under
the key id and the system namespace :data:`KEY_NAMESPACE`. A new key is made when the newest is older than
``settings.oidc_key_rotate_s`` (under an advisory lock, so two gateways make one). It is published first: the
JWKS lists it at once, and tokens are signed with it only :data:`PUBLISH_S` later (twice the JWKS's cache
lifetime, so a verifier's cached copy has it); until then the previous key signs. :func:`jwks` lists the
keys still being published, the signing key and the previous one, so a token signed just before a rotation
keeps verifying until it expires. (The very first key signs at once: no verifier has a JWKS yet.)

Errors: asyncpg and credential store errors pass through (callers fail closed).
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from podbay.config import Settings
from podbay.credentials import Sealed, open_store

__all__ = ["ALG", "KEY_NAMESPACE", "JWKS_MAX_AGE_S", "PUBLISH_S", "SigningKey", "KeyCache", "issuer", "subject", "discovery", "current_key", "jwks",
           "mint", "TOKEN_TYPE"]

ALG = "RS256"
#: The only token type E2B's API accepts in this version (``tokenType``).
TOKEN_TYPE = "JWT-SVID"
#: The credential store's tenant component for the signing keys (no tenant id starts with an underscore).
KEY_NAMESPACE = "_oidc"
# The advisory lock (two-int form) that makes one key per rotation however many gateways race.
_LOCK = (0x70626F69, 1)  # "pboi"
#: How long verifiers may cache the JWKS (the API's Cache-Control max-age), seconds.
JWKS_MAX_AGE_S = 300
#: A new key is in the JWKS this long before anything is signed with it, so no cached JWKS lacks it.
PUBLISH_S = 2 * JWKS_MAX_AGE_S


def issuer(settings: Settings) -> str:
    """The ``iss`` of every token and the base of the discovery URL, without a trailing slash."""
    return (settings.oidc_issuer or f"http://{settings.api_host}:{settings.api_port}").rstrip("/")


def subject(settings: Settings, tenant_id: str, sandbox_id: str) -> str:
    """``spiffe://<issuer host>/tenant/<tenant id>/sandbox/<sandbox id>``."""
    return f"spiffe://{urlsplit(issuer(settings)).hostname or 'podbay'}/tenant/{tenant_id}/sandbox/{sandbox_id}"


def discovery(settings: Settings) -> dict[str, Any]:
    """The OpenID Provider Metadata (OpenID Connect Discovery 1.0 §3) of a token-only issuer."""
    iss = issuer(settings)
    return {"issuer": iss, "jwks_uri": f"{iss}/.well-known/jwks.json",
            # Required by the specification although no flow ends here: podbay only issues tokens to its gateway.
            "authorization_endpoint": f"{iss}/oidc/authorize", "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": [ALG],
            "claims_supported": ["iss", "sub", "aud", "exp", "iat", "nbf", "jti", "tenant_id", "sandbox_id"]}


@dataclass(frozen=True)
class SigningKey:
    """A key of the ring, revealed: ``kid``, the private key, and when it was made."""

    kid: str
    key: rsa.RSAPrivateKey
    created_at: datetime


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def _ring(conn: asyncpg.Pool | asyncpg.Connection) -> list[asyncpg.Record]:
    """The newest keys, newest first (a handful is all the ring ever needs)."""
    return list(await conn.fetch("SELECT kid, backend, ciphertext, secret_ref, created_at, public_jwk FROM oidc_keys"
                                 " ORDER BY created_at DESC LIMIT 8"))


async def _reveal(settings: Settings, row: asyncpg.Record) -> SigningKey:
    store = open_store(settings, row["backend"])
    pem = await store.reveal(row["kid"], KEY_NAMESPACE, Sealed(row["backend"], row["ciphertext"], row["secret_ref"]))
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return SigningKey(row["kid"], key, row["created_at"])


def _stale(created_at: datetime, settings: Settings) -> bool:
    return created_at <= datetime.now(UTC) - timedelta(seconds=settings.oidc_key_rotate_s)


def _signing_index(rows: list[asyncpg.Record]) -> int:
    """Index in ``rows`` (newest first) of the key to sign with: the newest published for :data:`PUBLISH_S`
    (a verifier's cached JWKS has it by then); the oldest there is when none is (the very first key)."""
    published = datetime.now(UTC) - timedelta(seconds=PUBLISH_S)
    return next((i for i, r in enumerate(rows) if r["created_at"] <= published), len(rows) - 1)


async def _ensure(pool: asyncpg.Pool, settings: Settings) -> list[asyncpg.Record]:
    """The ring, with a new key added first when there is none or the newest is older than the rotation
    period (under an advisory lock, re-read inside it: racing processes make one key)."""
    rows = await _ring(pool)
    if rows and not _stale(rows[0]["created_at"], settings):
        return rows
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", *_LOCK)
        rows = await _ring(conn)
        if rows and not _stale(rows[0]["created_at"], settings):
            return rows
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        kid = _b64(os.urandom(12))
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        sealed = await open_store(settings).seal(kid, KEY_NAMESPACE, pem)
        public = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
        public.update({"kid": kid, "alg": ALG, "use": "sig"})
        await conn.execute(
            "INSERT INTO oidc_keys (kid, alg, public_jwk, backend, ciphertext, secret_ref) VALUES ($1,$2,$3,$4,$5,$6)",
            kid, ALG, public, sealed.backend, sealed.ciphertext, sealed.secret_ref)
        return await _ring(conn)


async def current_key(pool: asyncpg.Pool, settings: Settings) -> SigningKey:
    """The key tokens are signed with now (the ring rotated first when due; see the module docstring)."""
    rows = await _ensure(pool, settings)
    return await _reveal(settings, rows[_signing_index(rows)])


async def jwks(pool: asyncpg.Pool, settings: Settings) -> dict[str, Any]:
    """``{"keys": [JWK, ...]}`` (RFC 7517), newest first: a new key still being published, the current
    signing key and the previous one (the ring rotated first when due)."""
    rows = await _ensure(pool, settings)
    return {"keys": [dict(r["public_jwk"]) for r in rows[: _signing_index(rows) + 2]]}


def mint(key: SigningKey, settings: Settings, *, tenant_id: str, sandbox_id: str, audience: str,
         now: float | None = None) -> str:
    """A signed token for one request of ``sandbox_id`` to a relying party of ``audience`` (the claims in the
    module docstring)."""
    iat = int(now if now is not None else time.time())
    claims = {"iss": issuer(settings), "sub": subject(settings, tenant_id, sandbox_id), "aud": audience,
              "iat": iat, "nbf": iat, "exp": iat + settings.oidc_token_ttl_s, "jti": _b64(os.urandom(16)),
              "tenant_id": tenant_id, "sandbox_id": sandbox_id}
    return jwt.encode(claims, key.key, algorithm=ALG, headers={"kid": key.kid, "typ": "JWT"})


class KeyCache:
    """The gateway's copy of the current key, read again from the ring at most every ``refresh_s`` seconds
    (a rotation by another process is picked up within that time; the previous key stays in the JWKS)."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings, *, refresh_s: float = 30.0) -> None:
        self._pool, self._settings, self._refresh_s = pool, settings, refresh_s
        self._key: SigningKey | None = None
        self._read_at = 0.0

    async def get(self) -> SigningKey:
        now = time.monotonic()
        if self._key is None or now - self._read_at > self._refresh_s:
            self._key = await current_key(self._pool, self._settings)
            self._read_at = now
        return self._key
