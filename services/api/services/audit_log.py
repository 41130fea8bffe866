"""The audit log's reads (table ``audit_log``, append-only: migration 0007; rows are written by
podbay.audit.record): a tenant's rows, newest first, for ``GET /v1/audit`` (services/api/routes/audit_log.py)."""

from __future__ import annotations

from datetime import datetime

import asyncpg

__all__ = ["page"]


async def page(pool: asyncpg.Pool, tenant_id: str, *, action: str | None, sandbox_id: str | None,
               since: datetime | None, before: int | None, limit: int) -> list[asyncpg.Record]:
    """Up to ``limit`` of ``tenant_id``'s audit rows (``id, at, actor, action, target, sandbox_id, decision,
    detail``), newest first: only ``action`` (a trailing ``*`` matches a prefix), only about ``sandbox_id``,
    only at or after ``since``, only with an id below ``before``."""
    where = ["tenant_id = $1"]
    args: list[object] = [tenant_id]

    def add(cond: str, value: object) -> None:
        args.append(value)
        where.append(cond.format(f"${len(args)}"))

    if action:
        if action.endswith("*"):
            # LIKE metacharacters in the prefix are literal here.
            prefix = action[:-1].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            add("action LIKE {}", prefix + "%")
        else:
            add("action = {}", action)
    if sandbox_id:
        add("sandbox_id = {}", sandbox_id)
    if since is not None:
        add("at >= {}", since)
    if before is not None:
        add("id < {}", before)
    args.append(limit)
    return list(await pool.fetch(
        "SELECT id, at, actor, action, target, sandbox_id, decision, detail FROM audit_log"
        f" WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ${len(args)}", *args))
