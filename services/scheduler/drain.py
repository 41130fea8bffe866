"""Drain of a node (issue 8): move every sandbox off it, then mark it ``drained``.

``POST /v1/nodes/{id}/drain`` sets the node ``draining`` (placement skips it from then on) and publishes
``podbay.cmd.scheduler.drain`` (durable consumer ``scheduler-drain``). For each sandbox on the node:

- ``running`` or ``paused``: the scheduler picks a destination with the same placement as creates (live,
  ``ready``, has the template, has room; never the draining node), records a ``migrate`` operation for the
  sandbox and sends ``podbay.cmd.node.<node>.migrate_out``; the node agents live-migrate it
  (services/nodeagent/vm/migrate.py; a paused guest moves paused) and the destination emits ``migrated``.
- ``running`` or ``paused`` with read-write volumes: a live migration does not carry a volume's file, so the
  sandbox moves the way a suspend and a wake elsewhere do (:func:`_move_by_suspend`): the scheduler records
  a suspend (``suspend`` operation, snapshot row, state ``suspending``, through :func:`podbay.lifecycle.apply`)
  and sends ``podbay.cmd.node.<node>.suspend``; the node promotes the full snapshot and the volumes' own
  snapshots while the guest is stopped, frees the VM and unbinds the volumes. Then it records the wake
  (``resume`` operation, ``resuming``) and publishes ``podbay.cmd.scheduler.place`` with ``wake``; placement
  skips the draining node, and the destination fetches the snapshot and the volumes. A sandbox that was paused
  is paused again there. Its processes and memory carry on, as after any wake; the downtime is the whole
  suspend and wake. A sandbox with a read-only volume cannot move (the volume stays on this node, where other
  sandboxes may read it); the API refuses such a drain up front (409 ``volume_in_use``).
- ``suspended`` sandboxes have no node; ``pending``/``starting``/other transitional states are waited for
  once (bounded), then counted as not moved.

Progress (``operations.progress``: total, moved, failed with reasons, each move's downtime) is written
after every sandbox. A sandbox that cannot move stays running where it is; the drain then ends ``failed``
with ``drain_incomplete`` and the node stays ``draining``. All moved: the node becomes ``drained`` and the
operation ``succeeded``. A redelivered drain starts over with what is still on the node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from podbay.contracts.events import EventType
from podbay import lifecycle
from podbay.bus import Bus
from podbay.contracts import subjects
from podbay.contracts.messages import DrainNodeCmd, MigrateOutCmd, NodeHeartbeat, PlaceSandbox, Resources, SandboxOpCmd
from podbay.contracts.states import NodeState, OperationState, SandboxState
from podbay.errors import Conflict
from podbay.lifecycle import AuditRecord, NewOperation, SandboxEvent, Verb
from podbay.outbox import new_id
from podbay import operation_state

from .placement import NodeLoad, NoCapacity, choose_node, ready_nodes

__all__ = ["LOAD_SQL", "node_loads", "DrainProgress", "drain_node"]

log = logging.getLogger("podbay.scheduler.drain")

LOAD_SQL = (
    # Paused sandboxes use no CPU; their memory still counts (until released, which the scheduler does not
    # see). Warm slots wait paused: their memory counts too.
    "SELECT node_id, sum(mem)::int AS mem, sum(cpu)::int AS cpu FROM ("
    " SELECT node_id, memory_mib AS mem, CASE WHEN state <> 'paused' THEN vcpus ELSE 0 END AS cpu"
    " FROM sandboxes WHERE node_id IS NOT NULL AND state NOT IN ('deleted', 'failed')"
    " UNION ALL SELECT node_id, memory_mib, 0 FROM warm_slots WHERE state IN ('preparing', 'ready')"
    ") l GROUP BY node_id")
_MOVABLE = ("running", "paused")
_SETTLING = ("pending", "starting", "resuming", "suspending", "deleting")


async def node_loads(conn: asyncpg.Connection, nodes: list[NodeHeartbeat], *,
                     exclude: str | None = None) -> list[NodeLoad]:
    """Live nodes that may take sandboxes (``nodes.state`` is ``ready``; not ``exclude``) with their load."""
    loads = {r["node_id"]: r for r in await conn.fetch(LOAD_SQL)}
    states = {r["id"]: r["state"] for r in await conn.fetch("SELECT id, state FROM nodes")}
    return [NodeLoad(hb, int(loads[hb.node_id]["mem"]) if hb.node_id in loads else 0,
                     int(loads[hb.node_id]["cpu"]) if hb.node_id in loads else 0)
            for hb in ready_nodes(nodes, states) if hb.node_id != exclude]


class DrainProgress:
    """What ``operations.progress`` of a drain holds: ``{"total", "moved", "failed": [{"sandbox_id",
    "reason"}], "moves": [{"sandbox_id", "destination", "downtime_ms", "total_ms", "how"}]}``; ``how`` is
    ``migrate`` (live migration) or ``suspend`` (suspend and wake, for a sandbox with volumes)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.moved = 0
        self.failed: list[dict[str, str]] = []
        self.moves: list[dict[str, Any]] = []

    def as_json(self) -> dict[str, Any]:
        return {"total": self.total, "moved": self.moved, "failed": self.failed, "moves": self.moves}

    @property
    def complete(self) -> bool:
        return not self.failed and self.moved == self.total


#: How long a drain looks for a destination for one sandbox before reporting it unmovable, seconds.
PLACE_RETRY_S = 10.0


async def drain_node(pool: asyncpg.Pool, bus: Bus, cmd: DrainNodeCmd, *, migrate_timeout_s: float,
                     keepalive: Callable[[], Awaitable[None]] | None = None,
                     suspend_timeout_s: float | None = None, kick: Callable[[], None] | None = None) -> DrainProgress:
    """Move every sandbox off ``cmd.node_id`` (see the module docstring); returns the final progress.
    ``keepalive`` is awaited while waiting (the JetStream message's ``in_progress``). ``suspend_timeout_s``
    bounds each step of a move by suspend and wake (default ``migrate_timeout_s``); ``kick`` wakes the outbox
    relay after a transition this drain recorded (it sweeps on its own otherwise)."""
    op_id = cmd.operation_id
    await operation_state.start(pool, op_id)
    ids = [r["id"] for r in await pool.fetch(
        "SELECT id FROM sandboxes WHERE node_id=$1 AND state NOT IN ('deleted','failed','suspended')"
        " ORDER BY created_at", cmd.node_id)]
    prog = DrainProgress(len(ids))
    await _save(pool, op_id, prog)
    for sid in ids:
        row = await _settled(pool, sid, keepalive)
        if row is None or row["node_id"] != cmd.node_id or row["state"] in ("deleted", "suspended", "failed"):
            prog.total -= 1  # left the node by itself meanwhile
        elif row["state"] not in _MOVABLE:
            prog.failed.append({"sandbox_id": sid, "reason": f"it stayed {row['state']}"})
        elif await pool.fetchval("SELECT true FROM sandbox_volumes WHERE sandbox_id=$1 LIMIT 1", sid):
            await _move_by_suspend(pool, bus, cmd, row, prog, suspend_timeout_s or migrate_timeout_s, keepalive,
                                   kick)
        else:
            await _move_one(pool, bus, cmd, row, prog, migrate_timeout_s, keepalive)
        await _save(pool, op_id, prog)
    async with pool.acquire() as conn, conn.transaction():
        if prog.complete:
            await conn.execute("UPDATE nodes SET state=$2 WHERE id=$1 AND state=$3", cmd.node_id, NodeState.DRAINED,
                               NodeState.DRAINING)
            await operation_state.succeed(conn, op_id)
        else:
            msg = (f"{len(prog.failed)} of {prog.total} sandboxes could not move and still run on "
                   f"{cmd.node_id}: " + "; ".join(f"{f['sandbox_id']}: {f['reason']}" for f in prog.failed))
            await operation_state.fail(conn, op_id, "drain_incomplete", msg[:2000])
    await _notify(bus, op_id, None if prog.complete else "drain_incomplete")
    log.info("drain of %s: %d of %d moved, %d failed", cmd.node_id, prog.moved, prog.total, len(prog.failed))
    return prog


async def _settled(pool: asyncpg.Pool, sid: str, keepalive: Callable[[], Awaitable[None]] | None,
                   wait_s: float = 60.0) -> Any:
    """The sandbox row once it is out of a transitional state (bounded by ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        row = await pool.fetchrow("SELECT id, state, node_id, generation, tenant_id, template, memory_mib, vcpus"
                                  " FROM sandboxes WHERE id=$1", sid)
        if row is None or row["state"] not in _SETTLING or time.monotonic() > deadline:
            return row
        if keepalive:
            await keepalive()
        await asyncio.sleep(1.0)


async def _destination(pool: asyncpg.Pool, bus: Bus, cmd: DrainNodeCmd, row: Any, prog: DrainProgress,
                       keepalive: Callable[[], Awaitable[None]] | None) -> str | None:
    """A node that can take the sandbox, or None (recorded in ``prog`` as not movable)."""
    # A destination is looked for again for PLACE_RETRY_S before the sandbox is reported unmovable: the live
    # nodes are read from a NATS watcher's cache, which a connection blip empties until it reconnects.
    place_deadline = time.monotonic() + PLACE_RETRY_S
    while True:
        nodes = await bus.live_nodes()
        async with pool.acquire() as conn:
            candidates = await node_loads(conn, nodes, exclude=cmd.node_id)
        try:
            return choose_node(candidates, template=row["template"], memory_mib=row["memory_mib"],
                               vcpus=row["vcpus"]).node_id
        except NoCapacity as exc:
            if time.monotonic() > place_deadline:
                prog.failed.append({"sandbox_id": row["id"], "reason": str(exc)})
                return None
        if keepalive:
            await keepalive()
        await asyncio.sleep(1.0)


async def _await_op(pool: asyncpg.Pool, op_id: str, timeout_s: float,
                    keepalive: Callable[[], Awaitable[None]] | None) -> Any:
    """The operation row once ``succeeded`` or ``failed``, or None when ``timeout_s`` ran out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        op = await pool.fetchrow("SELECT state, error_message, data FROM operations WHERE id=$1", op_id)
        if op["state"] in ("succeeded", "failed"):
            return op
        if time.monotonic() > deadline:
            return None
        if keepalive:
            await keepalive()
        await asyncio.sleep(0.5)


async def _move_one(pool: asyncpg.Pool, bus: Bus, cmd: DrainNodeCmd, row: Any, prog: DrainProgress,
                    timeout_s: float, keepalive: Callable[[], Awaitable[None]] | None) -> None:
    sid = row["id"]
    dest = await _destination(pool, bus, cmd, row, prog, keepalive)
    if dest is None:
        return
    mig_op = new_id("op")
    await operation_state.insert(pool, mig_op, tenant_id=row["tenant_id"], sandbox_id=sid, kind="migrate",
                                 state=OperationState.RUNNING, node_id=cmd.node_id)
    out = MigrateOutCmd(operation_id=mig_op, sandbox_id=sid, generation=int(row["generation"]), dest_node=dest)
    await bus.publish_command(subjects.node_cmd(cmd.node_id, "migrate_out"), out,
                              msg_id=f"{mig_op}.g{out.generation}")
    op = await _await_op(pool, mig_op, timeout_s + 120, keepalive)
    if op is None:
        # Not answered in time: the source keeps the sandbox unless it finishes later (fenced either way).
        prog.failed.append({"sandbox_id": sid, "reason": "the migration did not finish in time"})
        return
    if op["state"] == "failed":
        prog.failed.append({"sandbox_id": sid, "reason": op["error_message"] or "migration failed"})
        return
    data = op["data"] or {}
    prog.moved += 1
    prog.moves.append({"sandbox_id": sid, "destination": dest, "downtime_ms": data.get("downtime_ms"),
                       "total_ms": data.get("total_ms"), "how": "migrate"})


async def _move_by_suspend(pool: asyncpg.Pool, bus: Bus, cmd: DrainNodeCmd, row: Any, prog: DrainProgress,
                           timeout_s: float, keepalive: Callable[[], Awaitable[None]] | None,
                           kick: Callable[[], None] | None) -> None:
    """Move a sandbox with read-write volumes by suspend and wake (module docstring). Failures land in
    ``prog``: a failed suspend leaves the sandbox paused on this node (as any failed suspend), a failed wake
    leaves it suspended (nothing lost; a later resume wakes it)."""
    sid, tenant = row["id"], row["tenant_id"]
    ro = [r["name"] for r in await pool.fetch(
        "SELECT v.name FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id"
        " WHERE sv.sandbox_id=$1 AND sv.readonly ORDER BY v.name", sid)]
    if ro:
        prog.failed.append({"sandbox_id": sid, "reason": f"it has volume(s) {', '.join(ro)} read-only, which stay "
                            "on this node (other sandboxes may read them)"})
        return
    if await _destination(pool, bus, cmd, row, prog, keepalive) is None:
        return  # no node could take it: do not suspend it for nothing
    t0 = time.perf_counter()
    op_id, snap_id = new_id("op"), new_id("snap")
    async with pool.acquire() as conn, conn.transaction():
        cur = await conn.fetchrow("SELECT state, node_id, generation FROM sandboxes WHERE id=$1 FOR UPDATE", sid)
        if cur is None or cur["node_id"] != cmd.node_id or cur["state"] not in _MOVABLE:
            prog.failed.append({"sandbox_id": sid, "reason": "it changed state while the drain moved it"})
            return
        try:
            await lifecycle.suspend(conn, sid, tenant_id=tenant, state=cur["state"], node_id=cmd.node_id,
                                    generation=cur["generation"], operation_id=op_id, snapshot_id=snap_id,
                                    actor="scheduler", fence=True, event_data={"drain": cmd.operation_id},
                                    audit_detail={"drain": cmd.operation_id})
        except Conflict as exc:
            prog.failed.append({"sandbox_id": sid, "reason": str(exc)})
            return
    was_paused = cur["state"] == SandboxState.PAUSED
    if kick:
        kick()
    await bus.publish_command(subjects.node_cmd(cmd.node_id, "suspend"),
                              SandboxOpCmd(operation_id=op_id, sandbox_id=sid, generation=int(cur["generation"])),
                              msg_id=op_id)
    op = await _await_op(pool, op_id, timeout_s + 120, keepalive)
    if op is None or op["state"] == "failed":
        why = "did not finish in time" if op is None else (op["error_message"] or "failed")
        prog.failed.append({"sandbox_id": sid, "reason": f"its suspend (to move its volumes) {why}"})
        return

    wake_op = new_id("op")
    async with pool.acquire() as conn, conn.transaction():
        woke = await lifecycle.apply(
            conn, sid, Verb.RESUME, states=SandboxState.SUSPENDED, renew_lease=True,
            operation=NewOperation(wake_op, tenant, "resume"),
            event=SandboxEvent(EventType.RESUMING, tenant_id=tenant, data={"operation_id": wake_op, "fallback": False,
                                                                   "drain": cmd.operation_id}),
            audit=AuditRecord(tenant, "scheduler", "sandbox.resume", detail={"drain": cmd.operation_id}))
    if woke is None:
        prog.failed.append({"sandbox_id": sid, "reason": "it is suspended; it changed state before its wake"})
        return
    if kick:
        kick()
    await bus.publish_command(subjects.SCHEDULER_PLACE, PlaceSandbox(
        operation_id=wake_op, sandbox_id=sid, tenant_id=tenant, template=row["template"],
        resources=Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"]), wake=True), msg_id=wake_op)
    op = await _await_op(pool, wake_op, timeout_s + 120, keepalive)
    if op is None or op["state"] == "failed":
        why = "did not finish in time" if op is None else (op["error_message"] or "failed")
        prog.failed.append({"sandbox_id": sid, "reason": f"it is suspended; its wake elsewhere {why}"})
        return
    downtime_ms = round((time.perf_counter() - t0) * 1000)
    dest = await pool.fetchrow("SELECT node_id, generation FROM sandboxes WHERE id=$1", sid)
    if was_paused:
        await _pause_again(pool, bus, sid, tenant, dest, timeout_s, keepalive)
    prog.moved += 1
    prog.moves.append({"sandbox_id": sid, "destination": dest["node_id"], "downtime_ms": downtime_ms,
                       "total_ms": round((time.perf_counter() - t0) * 1000), "how": "suspend"})


async def _pause_again(pool: asyncpg.Pool, bus: Bus, sid: str, tenant: str, dest: Any, timeout_s: float,
                       keepalive: Callable[[], Awaitable[None]] | None) -> None:
    """Pause a sandbox that was paused before its move by suspend (a wake leaves it running), as the API's
    pause does: a ``pause`` operation and ``podbay.cmd.node.<node>.pause``; the node applies the transition.
    A pause that fails leaves it running on its new node: it did move, so only a warning is logged."""
    op_id = new_id("op")
    await operation_state.insert(pool, op_id, tenant_id=tenant, sandbox_id=sid, kind="pause")
    await bus.publish_command(subjects.node_cmd(dest["node_id"], "pause"),
                              SandboxOpCmd(operation_id=op_id, sandbox_id=sid, generation=int(dest["generation"])),
                              msg_id=op_id)
    op = await _await_op(pool, op_id, timeout_s, keepalive)
    if op is None or op["state"] == "failed":
        log.warning("drain: %s moved but did not pause again on %s: %s", sid, dest["node_id"],
                    "no answer in time" if op is None else op["error_message"])


async def _save(pool: asyncpg.Pool, op_id: str, prog: DrainProgress) -> None:
    await operation_state.set_progress(pool, op_id, prog.as_json())


async def _notify(bus: Bus, op_id: str, error: str | None) -> None:
    from podbay.contracts.messages import OperationDone

    body = OperationDone(operation_id=op_id, state="failed" if error else "succeeded", error=error)
    try:
        await bus.nc.publish(subjects.operation_done(op_id), body.model_dump_json().encode())
    except Exception as exc:  # the row is the truth; the notice only wakes a waiting caller
        log.debug("notice for %s not sent: %s", op_id, exc)
