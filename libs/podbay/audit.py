"""The audit log (docs/DESIGN.md §4, §6): one append-only row per state-changing API call, credential use and
policy denial, and the same record as an event on ``podbay.evt.audit.<tenant>.<action>`` through the outbox,
in the caller's transaction. The table refuses UPDATE, DELETE and TRUNCATE (migration 0007)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg

from podbay.contracts import subjects
from podbay.contracts.messages import Event
from podbay.outbox import emit, new_id

__all__ = ["record"]


async def record(
    conn: asyncpg.Connection,
    *,
    tenant_id: str | None,
    actor: str,
    action: str,
    target: str | None = None,
    sandbox_id: str | None = None,
    decision: str | None = None,
    detail: dict[str, Any] | None = None,
) -> int:
    """Append one audit row and emit its event in the caller's transaction; returns the row id.

    ``actor`` is an API key id, ``gateway:<node>`` or ``system``; ``action`` a dotted verb such as
    ``sandbox.create``, ``credential.use`` or ``egress.deny``; ``decision`` is ``allow``/``deny`` for gateway
    rows. Call ``Relay.kick()`` after commit to publish the event promptly.
    """
    row_id = await conn.fetchval(
        "INSERT INTO audit_log (tenant_id, actor, action, target, sandbox_id, decision, detail) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
        tenant_id, actor, action, target, sandbox_id, decision, detail or {},
    )
    event = Event(id=new_id("evt"), type=action, sandbox_id=sandbox_id, tenant_id=tenant_id,
                  at=datetime.now(UTC), reason=decision,
                  data={"audit_id": row_id, "actor": actor, "target": target, **(detail or {})})
    await emit(conn, subjects.audit_event(tenant_id or "_", action), event)
    return int(row_id)
