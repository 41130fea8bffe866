"""API keys: creation, hashing and lookup (docs/DESIGN.md §6: keys are stored hashed; every query is tenant-scoped).

A key looks like ``pb_<prefix>_<secret>``: 8 hex digits of prefix (stored, shown in listings) and 40 hex
digits of secret. Only ``sha256(key)`` is stored; verification compares digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from podbay.audit import record
from podbay.contracts.e2b import from_e2b_key
from podbay.errors import Unauthorized
from podbay.outbox import new_id

__all__ = ["Principal", "generate_key", "hash_key", "create_key", "authenticate", "ensure_tenant", "forget_key",
           "KEY_COLS", "key_row", "list_keys", "lock_live_keys", "mark_revoked"]


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


async def create_key(conn: asyncpg.Connection, tenant_id: str, name: str, *, actor: str = "system") -> tuple[str, str]:
    """Store a new key for ``tenant_id`` and its audit row (by ``actor``: a key id, or ``system`` for the
    operator's ``podbay-api create-key``), in the caller's transaction; returns ``(key_id, key)``. The key
    is shown once, never stored."""
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
    await record(conn, tenant_id=tenant_id, actor=actor, action="api_key.create", target=key_id,
                 detail={"name": name, "prefix": prefix})
    return key_id, key


async def revoke_keys_named(conn: asyncpg.Connection, tenant_id: str, name: str) -> list[str]:
    """Revoke ``tenant_id``'s live keys named ``name`` (one ``api_key.revoke`` audit row each, actor
    ``system``), in the caller's transaction; returns their ids. Running API processes refuse them once their
    verification cache runs out (``AUTH_CACHE_S``): this is the operator's path, which has no bus."""
    rows = await conn.fetch("UPDATE api_keys SET revoked_at=now() WHERE tenant_id=$1 AND name=$2"
                            " AND revoked_at IS NULL RETURNING id, prefix", tenant_id, name)
    for row in rows:
        await record(conn, tenant_id=tenant_id, actor="system", action="api_key.revoke", target=row["id"],
                     detail={"name": name, "prefix": row["prefix"], "reason": "replaced"})
    return [str(r["id"]) for r in rows]


# Verified keys, by their hash, for a few seconds: saves a PostgreSQL round trip on the hot path (exec,
# files). A revocation drops the key from this process's cache at once and tells every other API process
# (core NATS, ``subjects.API_KEY_REVOKED``), so that a revoked key is refused on its next request; should
# that notice be lost, the entry still runs out within AUTH_CACHE_S.
AUTH_CACHE_S = 5.0
_AUTH_CACHE_MAX = 4096
_auth_cache: dict[bytes, tuple[float, Principal]] = {}


#: The columns of a key row the API shows (never the key or its hash).
KEY_COLS = "id, name, prefix, created_at, revoked_at"


async def key_row(conn: asyncpg.Connection, key_id: str, *, tenant_id: str | None = None) -> asyncpg.Record | None:
    """Key ``key_id`` (:data:`KEY_COLS` and ``key_hash``), of ``tenant_id`` when given; None when absent."""
    if tenant_id is None:
        row: asyncpg.Record | None = await conn.fetchrow(f"SELECT {KEY_COLS}, key_hash FROM api_keys WHERE id=$1",
                                                         key_id)
        return row
    row = await conn.fetchrow(f"SELECT {KEY_COLS}, key_hash FROM api_keys WHERE id=$1 AND tenant_id=$2",
                              key_id, tenant_id)
    return row


async def list_keys(pool: asyncpg.Pool, tenant_id: str, *, revoked: bool) -> list[asyncpg.Record]:
    """The tenant's keys (:data:`KEY_COLS`), newest first; revoked ones only when asked."""
    sql = f"SELECT {KEY_COLS} FROM api_keys WHERE tenant_id=$1"
    if not revoked:
        sql += " AND revoked_at IS NULL"
    return list(await pool.fetch(sql + " ORDER BY created_at DESC, id", tenant_id))


async def lock_live_keys(conn: asyncpg.Connection, tenant_id: str) -> list[asyncpg.Record]:
    """The tenant's live keys' ids, locked (``FOR UPDATE``) to the end of the caller's transaction, so that two
    keys revoking each other cannot both succeed."""
    return list(await conn.fetch("SELECT id FROM api_keys WHERE tenant_id=$1 AND revoked_at IS NULL FOR UPDATE",
                                 tenant_id))


async def mark_revoked(conn: asyncpg.Connection, key_id: str) -> asyncpg.Record:
    """Revoke key ``key_id`` now; its row (:data:`KEY_COLS` and ``key_hash``) as it becomes."""
    row: asyncpg.Record = await conn.fetchrow(
        f"UPDATE api_keys SET revoked_at=now() WHERE id=$1 RETURNING {KEY_COLS}, key_hash", key_id)
    return row


def forget_key(key_hash: bytes) -> None:
    """Drop a key (by its stored sha256) from this process's verification cache."""
    _auth_cache.pop(bytes(key_hash), None)


async def authenticate(pool: asyncpg.Pool, authorization: str | None,
                       on_refused: Callable[[], None] | None = None) -> Principal:
    """Resolve ``Authorization: Bearer <key>`` to a ``Principal``; ``Unauthorized`` (401) otherwise.

    Successful lookups are cached for ``AUTH_CACHE_S`` seconds (by the key's hash; failures never are).
    A genuine but revoked key also appends an ``api_key.refused`` audit row for its tenant (decision
    ``deny``), then calls ``on_refused`` (e.g. to kick the outbox relay).
    """
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    key = from_e2b_key(authorization[7:].strip())  # the e2b_ alias names the same key (docs/e2b.md)
    parts = key.split("_")
    if len(parts) != 3 or parts[0] != "pb" or len(parts[1]) != 8:
        raise Unauthorized("malformed API key")
    digest = hash_key(key)
    now = time.monotonic()
    hit = _auth_cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    row = await pool.fetchrow("SELECT id, tenant_id, key_hash, revoked_at FROM api_keys WHERE prefix = $1", parts[1])
    if row is None or not hmac.compare_digest(bytes(row["key_hash"]), digest):
        raise Unauthorized("invalid or revoked API key")
    if row.get("revoked_at") is not None:
        # Only the holder of the real key gets here, so the row is worth keeping: who still uses it.
        async with pool.acquire() as conn, conn.transaction():
            await record(conn, tenant_id=row["tenant_id"], actor=row["id"], action="api_key.refused",
                         target=row["id"], decision="deny", detail={"reason": "revoked"})
        if on_refused is not None:
            on_refused()
        raise Unauthorized("invalid or revoked API key")
    principal = Principal(tenant_id=row["tenant_id"], key_id=row["id"])
    if len(_auth_cache) >= _AUTH_CACHE_MAX:
        _auth_cache.clear()
    _auth_cache[digest] = (now + AUTH_CACHE_S, principal)
    return principal
