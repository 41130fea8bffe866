"""Idempotency keys of creates (``Idempotency-Key`` on ``POST /v1/sandboxes``): the table's semantics.

A key is the client's name for one request, scoped by tenant. The first create with a key records
``(tenant, key) -> (request hash, sandbox, operation)`` in the transaction that inserts the sandbox
(:func:`record`, or the warm claim's statement, services/api/services/warm.py), so a key never names a sandbox that
did not commit, and a sandbox made with a key is never without its row. A retry with the key
(:func:`lookup`) finds the sandbox; the same key with another request (another body or endpoint, compared by
:func:`request_hash`) is ``IdempotencyKeyReused`` (422). A key expires ``idempotency_key_ttl_s`` after it
was recorded: lookups ignore it, a new create replaces its row, and :func:`sweep` deletes it.

Two creates with one key at once: the second one's insert waits on the first one's uncommitted row; once the
first commits, :func:`record` returns False and the caller rolls its transaction back (:class:`KeyTaken`)
and answers from the first one's row.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass

import asyncpg
from pydantic import BaseModel

from podbay.errors import IdempotencyKeyReused

__all__ = ["IdempotencyKey", "Prior", "KeyTaken", "TakenGuard", "request_hash", "lookup", "record", "check", "sweep",
           "sweep_loop", "KEY_PATTERN", "KEY_MAX_CHARS"]

log = logging.getLogger("podbay.api.idempotency")

#: A key: 1 to 255 visible ASCII characters (a UUID is the usual choice).
KEY_MAX_CHARS = 255
KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"


@dataclass(frozen=True)
class IdempotencyKey:
    """A request's key and the hash of what it asks for (:func:`request_hash`)."""

    key: str
    request_hash: str


@dataclass(frozen=True)
class Prior:
    """What a live key made: its request's hash, the sandbox and the create operation."""

    request_hash: str
    sandbox_id: str
    operation_id: str


class KeyTaken(Exception):
    """Raised inside a create's transaction when another request recorded the key first: roll back, answer
    from :func:`lookup`."""


class TakenGuard:
    """Put first in a create's ``async with``, before the transaction: a :class:`KeyTaken` raised inside
    rolls the transaction back, then stops here and sets :attr:`taken`, so the caller answers from the key's
    row. ``async with TakenGuard() as guard, pool.acquire() as conn, conn.transaction(): ...``"""

    def __init__(self) -> None:
        self.taken = False

    async def __aenter__(self) -> TakenGuard:
        return self

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, KeyTaken):
            self.taken = True
            return True
        return False


def request_hash(scope: str, body: BaseModel) -> str:
    """SHA-256 (hex) of ``scope`` (the endpoint, e.g. ``sandbox.create``) and the validated body with its
    defaults filled in, keys sorted: two requests that mean the same hash the same."""
    canonical = json.dumps({"scope": scope, "body": body.model_dump(mode="json")}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def lookup(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, key: str, ttl_s: float) -> Prior | None:
    """The live (younger than ``ttl_s`` seconds) record of ``key`` for the tenant, or None."""
    row = await conn.fetchrow(
        "SELECT request_hash, sandbox_id, operation_id FROM idempotency_keys"
        " WHERE tenant_id=$1 AND key=$2 AND created_at > now() - make_interval(secs => $3)",
        tenant_id, key, ttl_s)
    return None if row is None else Prior(row["request_hash"], row["sandbox_id"], row["operation_id"])


def check(prior: Prior, idem: IdempotencyKey) -> None:
    """Raise ``IdempotencyKeyReused`` unless ``idem`` asks for what ``prior``'s request asked for."""
    if prior.request_hash != idem.request_hash:
        raise IdempotencyKeyReused(
            f"Idempotency-Key {idem.key!r} was used for another request (it made sandbox {prior.sandbox_id}); "
            "send a new key for a new request", details={"sandbox_id": prior.sandbox_id})


async def record(conn: asyncpg.Connection, tenant_id: str, idem: IdempotencyKey, sandbox_id: str,
                 operation_id: str, ttl_s: float) -> bool:
    """Record ``idem`` -> the sandbox in ``conn``'s transaction (the one inserting the sandbox). An expired
    row of the key is replaced. Returns False when a live row holds the key (another request's, committed
    while this one waited on it): the caller raises :class:`KeyTaken`."""
    got = await conn.fetchval(
        "INSERT INTO idempotency_keys (tenant_id, key, request_hash, sandbox_id, operation_id)"
        " VALUES ($1, $2, $3, $4, $5)"
        " ON CONFLICT (tenant_id, key) DO UPDATE SET request_hash=EXCLUDED.request_hash,"
        " sandbox_id=EXCLUDED.sandbox_id, operation_id=EXCLUDED.operation_id, created_at=now()"
        " WHERE idempotency_keys.created_at <= now() - make_interval(secs => $6)"
        " RETURNING true",
        tenant_id, idem.key, idem.request_hash, sandbox_id, operation_id, ttl_s)
    return bool(got)


async def sweep(pool: asyncpg.Pool, ttl_s: float, *, batch: int = 1000) -> int:
    """Delete expired keys, ``batch`` rows per statement; returns how many."""
    total = 0
    while True:
        n = await pool.fetchval(
            "WITH gone AS (DELETE FROM idempotency_keys WHERE ctid IN (SELECT ctid FROM idempotency_keys"
            " WHERE created_at <= now() - make_interval(secs => $1) LIMIT $2) RETURNING 1)"
            " SELECT count(*) FROM gone", ttl_s, batch)
        total += int(n)
        if n < batch:
            return total


async def sweep_loop(pool: asyncpg.Pool, ttl_s: float, stop: asyncio.Event) -> None:
    """Run :func:`sweep` every ``min(ttl_s, 600)`` seconds until ``stop`` is set. Replicas may all run it:
    deleting an expired row twice is harmless."""
    period = min(ttl_s, 600.0)
    while not stop.is_set():
        try:
            n = await sweep(pool, ttl_s)
            if n:
                log.info("deleted %d expired idempotency keys", n)
        except Exception:  # the next round tries again; an expired row is ignored by lookups meanwhile
            log.exception("idempotency key sweep failed")
        try:
            await asyncio.wait_for(stop.wait(), timeout=period)
        except TimeoutError:
            pass
