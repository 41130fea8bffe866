"""Transactional outbox (docs/DESIGN.md §4): an event commits with its state change, then is relayed to JetStream.

``emit`` inserts the event row inside the caller's transaction. After commit the caller calls
``Relay.kick()``; the relay publishes unpublished rows in id order with the event id as ``Nats-Msg-Id``
(so a re-publish after a crash is deduplicated by the server) and marks them published. A periodic sweep
publishes rows a crashed process left behind. So an event is never lost and never announces a change
that did not commit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from podbay.contracts.events import EventType
from podbay.bus import Bus
from podbay.contracts import subjects
from podbay.contracts.messages import Event

__all__ = ["emit_sandbox_event", "sandbox_event", "emit", "Relay", "new_id"]

log = logging.getLogger("podbay.outbox")


def new_id(prefix: str) -> str:
    """A new random id such as ``sbx_3f2a...`` (prefix, underscore, 20 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


async def emit(conn: asyncpg.Connection, subject: str, event: Event) -> None:
    """Insert ``event`` for ``subject`` in the caller's transaction."""
    await conn.execute(
        "INSERT INTO outbox (event_id, subject, payload) VALUES ($1, $2, $3)",
        event.id,
        subject,
        json.loads(event.model_dump_json()),
    )


async def emit_sandbox_event(
    conn: asyncpg.Connection,
    sandbox_id: str,
    event_type: EventType,
    *,
    state: str | None = None,
    reason: str | None = None,
    node_id: str | None = None,
    tenant_id: str | None = None,
    generation: int | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    """Bump the sandbox's event sequence and emit ``podbay.evt.sandbox.<id>.<type>`` in this transaction.

    ``tenant_id`` defaults to the sandbox row's: every sandbox event names its tenant, because subscribers
    (``GET /v1/events``, webhooks) only ever see their own tenant's events.
    """
    row = await conn.fetchrow(
        "UPDATE sandboxes SET event_seq = event_seq + 1 WHERE id = $1 RETURNING event_seq, tenant_id", sandbox_id
    )
    seq = row["event_seq"] if row else 0
    if tenant_id is None and row is not None:
        tenant_id = row["tenant_id"]
    event = sandbox_event(sandbox_id, event_type, seq=int(seq or 0), state=state, reason=reason, node_id=node_id,
                          tenant_id=tenant_id, generation=generation, data=data)
    await emit(conn, subjects.sandbox_event(sandbox_id, event_type), event)
    return event


def sandbox_event(sandbox_id: str, event_type: EventType, *, seq: int, state: str | None = None, reason: str | None = None,
                  node_id: str | None = None, tenant_id: str | None = None, generation: int | None = None,
                  data: dict[str, Any] | None = None) -> Event:
    """A new sandbox event (``data.seq`` = ``seq``), for callers that write its outbox row themselves: a
    single SQL statement that changes the sandbox and inserts the row in one round trip (warm creates)."""
    return Event(id=new_id("evt"), type=event_type, sandbox_id=sandbox_id, node_id=node_id, tenant_id=tenant_id,
                 generation=generation, state=state, reason=reason, at=datetime.now(UTC),
                 data={**(data or {}), "seq": seq})


class Relay:
    """Publishes outbox rows to JetStream. One per process; ``run()`` is its background task."""

    def __init__(self, pool: asyncpg.Pool, bus: Bus, *, sweep_s: float = 1.0, batch: int = 100) -> None:
        self._pool = pool
        self._bus = bus
        self._sweep_s = sweep_s
        self._batch = batch
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()

    def kick(self) -> None:
        """Ask for a relay pass soon (call after committing an event)."""
        self._wake.set()

    async def flush(self) -> int:
        """Publish pending rows now; returns how many were published."""
        published = 0
        async with self._lock:
            while True:
                async with self._pool.acquire() as conn:
                    async with conn.transaction():
                        rows = await conn.fetch(
                            "SELECT id, event_id, subject, payload FROM outbox WHERE published_at IS NULL "
                            "ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
                            self._batch,
                        )
                        if not rows:
                            return published
                        for r in rows:
                            await self._bus.js.publish(
                                r["subject"],
                                json.dumps(r["payload"]).encode(),
                                headers={"Nats-Msg-Id": r["event_id"]},
                            )
                        await conn.execute(
                            "UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[])",
                            [r["id"] for r in rows],
                        )
                        published += len(rows)

    async def run(self) -> None:
        """Relay loop: wake on ``kick()`` or every ``sweep_s``; errors are logged and retried."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._sweep_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox relay failed, will retry: %s", exc)
