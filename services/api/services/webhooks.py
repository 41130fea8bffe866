"""A tenant's webhooks' named queries (table ``webhooks``; ``/v1/webhooks``, services/api/routes/webhooks.py).
Deliveries update the same rows from podbay.webhooks.Deliverer; a deleted webhook keeps its row
(``deleted_at``)."""

from __future__ import annotations

import asyncpg

__all__ = ["COLS", "count_live", "insert", "list_live", "mark_deleted"]

#: The columns of a webhook the API shows (never its secret).
COLS = ("id, url, types, created_at, deliveries, failures, last_status, last_attempts, last_error, last_event_seq,"
        " last_attempt_at")


async def count_live(conn: asyncpg.Connection, tenant_id: str) -> int:
    """How many webhooks the tenant has (not deleted)."""
    return int(await conn.fetchval(
        "SELECT count(*) FROM webhooks WHERE tenant_id = $1 AND deleted_at IS NULL", tenant_id))


async def insert(conn: asyncpg.Connection, hook_id: str, tenant_id: str, url: str, types: list[str],
                 secret: str) -> asyncpg.Record:
    """Write a new webhook; its row (:data:`COLS`)."""
    row: asyncpg.Record = await conn.fetchrow(
        f"INSERT INTO webhooks (id, tenant_id, url, types, secret) VALUES ($1, $2, $3, $4, $5) RETURNING {COLS}",
        hook_id, tenant_id, url, types, secret)
    return row


async def list_live(pool: asyncpg.Pool, tenant_id: str) -> list[asyncpg.Record]:
    """The tenant's webhooks (:data:`COLS`), oldest first."""
    return list(await pool.fetch(
        f"SELECT {COLS} FROM webhooks WHERE tenant_id = $1 AND deleted_at IS NULL ORDER BY created_at, id",
        tenant_id))


async def mark_deleted(conn: asyncpg.Connection, tenant_id: str, webhook_id: str) -> asyncpg.Record | None:
    """Delete the tenant's webhook ``webhook_id`` (``deleted_at``); its row (:data:`COLS`), or None when there is
    no such live webhook of the tenant."""
    row: asyncpg.Record | None = await conn.fetchrow(
        f"UPDATE webhooks SET deleted_at = now() WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL"
        f" RETURNING {COLS}", webhook_id, tenant_id)
    return row
