"""Sandboxes that cannot be placed: the one way they fail, and the sweep for those whose command is gone.

:func:`fail_unplaced` is the transition ``pending -> failed`` (and a wake's ``resuming -> suspended``) for
the scheduler: a fenced update (only from the state and generation the caller read), the operation failed
with a code, and the ``failed`` (or ``suspended``) event with the reason, all in the caller's transaction.
The place handler calls it when no node fits once ``PODBAY_PLACEMENT_RETRY_S`` has passed; the sweep
calls it for sandboxes left behind.

:func:`sweep_unplaced` finds sandboxes that have waited for a node longer than ``PODBAY_PENDING_TIMEOUT_S``
(``pending``, or ``resuming`` with no node) and ends them: a create fails with ``placement_timeout``, a wake
goes back to ``suspended`` (nothing was lost). That happens when the place command is gone without an
answer: the API died between its commit and its publish, or the command used up its deliveries on errors.
A place command still being retried holds the row only for moments, and the bound is far above the
placement retry window, so the sweep never races a placement that could still succeed.

Replicas: every scheduler sweeps. Rows are taken ``FOR UPDATE SKIP LOCKED`` (never one a placement holds)
and the update is conditional on the state, node and generation read, so two sweeps, or a sweep and a late
placement, change a sandbox once; no leader lease is needed (as for node loss).
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from podbay.contracts.events import EventType
from podbay import lifecycle
from podbay.contracts.states import OperationState, SandboxState
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.outbox import Relay
from podbay.service import wait_stop

__all__ = ["fail_unplaced", "sweep_unplaced", "PendingSweeper", "PLACEMENT_TIMEOUT"]

log = logging.getLogger("podbay.scheduler.pending")

#: Operation error code of a sandbox the sweep failed (its place command was gone).
PLACEMENT_TIMEOUT = "placement_timeout"


async def fail_unplaced(conn: asyncpg.Connection, *, sandbox_id: str, operation_id: str | None, tenant_id: str,
                        generation: int, code: str, reason: str, wake: bool = False) -> bool:
    """End a sandbox no node took, inside the caller's transaction; returns False when it had moved on.

    A create (``wake`` False): ``pending`` at ``generation`` -> ``failed`` with ``reason``; event ``failed``.
    A wake: ``resuming`` with no node at ``generation`` -> ``suspended`` (its snapshot is intact); event
    ``suspended`` saying the resume failed. Either way the operation (when given and unfinished) fails with
    ``code`` and ``reason``. Call ``Relay.kick()`` after the commit.
    """
    outcome = None if operation_id is None else OperationOutcome(
        operation_id, OperationState.FAILED, error_code=code, error_message=reason,
        only_from=(OperationState.PENDING, OperationState.RUNNING))
    data = {"operation_id": operation_id, "code": code}
    if wake:
        moved = await lifecycle.apply(
            conn, sandbox_id, Verb.WAKE_FAILED, states=SandboxState.RESUMING, node=None, generation=generation,
            operation=outcome, event=SandboxEvent(EventType.SUSPENDED, reason=f"resume failed: {reason}", tenant_id=tenant_id,
                                                  generation=generation, data=data))
    else:
        moved = await lifecycle.apply(
            conn, sandbox_id, Verb.FAIL, states=SandboxState.PENDING, node=None, generation=generation,
            values={"failure_reason": reason}, operation=outcome,
            event=SandboxEvent(EventType.FAILED, reason=reason, tenant_id=tenant_id, generation=generation, data=data))
    if moved is None:
        return False
    return True


_STRANDED = (
    "SELECT s.id, s.tenant_id, s.state, s.generation,"
    " extract(epoch FROM now() - s.updated_at)::float8 AS waited_s,"
    " (SELECT o.id FROM operations o WHERE o.sandbox_id = s.id AND o.state IN ('pending', 'running')"
    "   ORDER BY o.created_at DESC LIMIT 1) AS op_id"
    " FROM sandboxes s"
    " WHERE (s.state = 'pending' OR (s.state = 'resuming' AND s.node_id IS NULL)) AND s.node_id IS NULL"
    " AND s.updated_at < now() - make_interval(secs => $1)"
    " ORDER BY s.updated_at LIMIT $2 FOR UPDATE OF s SKIP LOCKED")


async def sweep_unplaced(pool: asyncpg.Pool, *, timeout_s: float, batch: int = 100) -> list[str]:
    """One pass: end every sandbox that has waited for a node longer than ``timeout_s`` seconds (module
    docstring). Returns the ids it ended, oldest first."""
    ended: list[str] = []
    async with pool.acquire() as conn, conn.transaction():
        for r in await conn.fetch(_STRANDED, timeout_s, batch):
            wake = r["state"] == "resuming"
            what = "resumed" if wake else "placed"
            reason = (f"not {what} within {timeout_s:g} s (waited {r['waited_s']:.0f} s): its place command "
                      "is gone")
            if await fail_unplaced(conn, sandbox_id=r["id"], operation_id=r["op_id"], tenant_id=r["tenant_id"],
                                   generation=r["generation"], code=PLACEMENT_TIMEOUT, reason=reason, wake=wake):
                ended.append(r["id"])
    return ended


class PendingSweeper:
    """The scheduler's loop running :func:`sweep_unplaced` every ``interval_s`` seconds."""

    def __init__(self, pool: asyncpg.Pool, relay: Relay, *, timeout_s: float, interval_s: float) -> None:
        self.pool, self.relay = pool, relay
        self.timeout_s, self.interval_s = timeout_s, interval_s

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep until ``stop``; a failed pass is logged and retried at the next interval."""
        while not stop.is_set():
            try:
                ended = await sweep_unplaced(self.pool, timeout_s=self.timeout_s)
                if ended:
                    self.relay.kick()
                    log.warning("ended %d sandbox(es) left without a node for over %g s: %s", len(ended),
                                self.timeout_s, ", ".join(ended))
            except Exception:
                log.exception("pending sweep failed; retrying")
            await wait_stop(stop, self.interval_s)
