"""API keys: creation, hashing and lookup (DESIGN.md §6: keys are stored hashed; every query is tenant-scoped).

A key looks like ``pb_<prefix>_<secret>``: 8 hex digits of prefix (stored, shown in listings) and 40 hex
digits of secret. Only ``sha256(key)`` is stored; verification compares digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

import asyncpg

from podbay.errors import Unauthorized
from podbay.outbox import new_id

__all__ = ["Principal", "generate_key", "hash_key", "create_key", "authenticate", "ensure_tenant"]


@dataclass(frozen=True)
class Principal:
    """The caller of a request: its tenant and the key id it used."""

    tenant_id: str
    key_id: str


def generate_key() -> tuple[str, str]:
    """Return ``(key, prefix)`` for a new key."""
    prefix = secrets.token_hex(4)
    return f"pb_{prefix}_{secrets.token_hex(20)}", prefix


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


async def ensure_tenant(conn: asyncpg.Connection, name: str) -> str:
    """The id of tenant ``name``, created if missing."""
    row = await conn.fetchrow("SELECT id FROM tenants WHERE name = $1", name)
    if row:
        return str(row["id"])
    tid = new_id("ten")
    await conn.execute("INSERT INTO tenants (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING", tid, name)
    return str(await conn.fetchval("SELECT id FROM tenants WHERE name = $1", name))


async def create_key(conn: asyncpg.Connection, tenant_id: str, name: str) -> tuple[str, str]:
    """Store a new key for ``tenant_id``; returns ``(key_id, key)``. The key is shown once, never stored."""
    key, prefix = generate_key()
    key_id = new_id("key")
    await conn.execute(
        "INSERT INTO api_keys (id, tenant_id, name, prefix, key_hash) VALUES ($1, $2, $3, $4, $5)",
        key_id,
        tenant_id,
        name,
        prefix,
        hash_key(key),
    )
    await conn.execute(
        "INSERT INTO audit_log (tenant_id, actor, action, target) VALUES ($1, 'system', 'api_key.create', $2)",
        tenant_id,
        key_id,
    )
    return key_id, key


# Verified keys, by their hash, for a few seconds: saves a PostgreSQL round trip on the hot path (exec,
# files). A revoked key therefore stops working within AUTH_CACHE_S.
AUTH_CACHE_S = 5.0
_AUTH_CACHE_MAX = 4096
_auth_cache: dict[bytes, tuple[float, Principal]] = {}


async def authenticate(pool: asyncpg.Pool, authorization: str | None) -> Principal:
    """Resolve ``Authorization: Bearer <key>`` to a ``Principal``; ``Unauthorized`` (401) otherwise.

    Successful lookups are cached for ``AUTH_CACHE_S`` seconds (by the key's hash; failures never are).
    """
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    key = authorization[7:].strip()
    parts = key.split("_")
    if len(parts) != 3 or parts[0] != "pb" or len(parts[1]) != 8:
        raise Unauthorized("malformed API key")
    digest = hash_key(key)
    now = time.monotonic()
    hit = _auth_cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    row = await pool.fetchrow(
        "SELECT id, tenant_id, key_hash FROM api_keys WHERE prefix = $1 AND revoked_at IS NULL", parts[1]
    )
    if row is None or not hmac.compare_digest(bytes(row["key_hash"]), digest):
        raise Unauthorized("invalid or revoked API key")
    principal = Principal(tenant_id=row["tenant_id"], key_id=row["id"])
    if len(_auth_cache) >= _AUTH_CACHE_MAX:
        _auth_cache.clear()
    _auth_cache[digest] = (now + AUTH_CACHE_S, principal)
    return principal
