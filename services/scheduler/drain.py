"""Drain of a node (issue 8): move every sandbox off it, then mark it ``drained``.

``POST /v1/nodes/{id}/drain`` sets the node ``draining`` (placement skips it from then on) and publishes
``podbay.cmd.scheduler.drain`` (durable consumer ``scheduler-drain``). For each sandbox on the node:

- ``running`` or ``paused``: the scheduler picks a destination with the same placement as creates (live,
  ``ready``, has the template, has room; never the draining node), records a ``migrate`` operation for the
  sandbox and sends ``podbay.cmd.node.<node>.migrate_out``; the node agents live-migrate it
  (services/nodeagent/migrate.py; a paused guest moves paused) and the destination emits ``migrated``.
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

from podbay.bus import Bus
from podbay.contracts import subjects
from podbay.contracts.messages import DrainNodeCmd, MigrateOutCmd, NodeHeartbeat
from podbay.outbox import new_id

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
    "reason"}], "moves": [{"sandbox_id", "destination", "downtime_ms", "total_ms"}]}``."""

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
                     keepalive: Callable[[], Awaitable[None]] | None = None) -> DrainProgress:
    """Move every sandbox off ``cmd.node_id`` (see the module docstring); returns the final progress.
    ``keepalive`` is awaited while waiting (the JetStream message's ``in_progress``)."""
    op_id = cmd.operation_id
    await pool.execute("UPDATE operations SET state='running' WHERE id=$1 AND state='pending'", op_id)
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
        else:
            await _move_one(pool, bus, cmd, row, prog, migrate_timeout_s, keepalive)
        await _save(pool, op_id, prog)
    async with pool.acquire() as conn, conn.transaction():
        if prog.complete:
            await conn.execute("UPDATE nodes SET state='drained' WHERE id=$1 AND state='draining'", cmd.node_id)
            await conn.execute("UPDATE operations SET state='succeeded', finished_at=now() WHERE id=$1", op_id)
        else:
            msg = (f"{len(prog.failed)} of {prog.total} sandboxes could not move and still run on "
                   f"{cmd.node_id}: " + "; ".join(f"{f['sandbox_id']}: {f['reason']}" for f in prog.failed))
            await conn.execute("UPDATE operations SET state='failed', error_code='drain_incomplete',"
                               " error_message=$2, finished_at=now() WHERE id=$1", op_id, msg[:2000])
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


async def _move_one(pool: asyncpg.Pool, bus: Bus, cmd: DrainNodeCmd, row: Any, prog: DrainProgress,
                    timeout_s: float, keepalive: Callable[[], Awaitable[None]] | None) -> None:
    sid = row["id"]
    # A destination is looked for again for PLACE_RETRY_S before the sandbox is reported unmovable: the live
    # nodes are read from a NATS watcher's cache, which a connection blip empties until it reconnects.
    place_deadline = time.monotonic() + PLACE_RETRY_S
    while True:
        nodes = await bus.live_nodes()
        async with pool.acquire() as conn:
            candidates = await node_loads(conn, nodes, exclude=cmd.node_id)
        try:
            dest = choose_node(candidates, template=row["template"], memory_mib=row["memory_mib"],
                               vcpus=row["vcpus"]).node_id
            break
        except NoCapacity as exc:
            if time.monotonic() > place_deadline:
                prog.failed.append({"sandbox_id": sid, "reason": str(exc)})
                return
        if keepalive:
            await keepalive()
        await asyncio.sleep(1.0)
    mig_op = new_id("op")
    await pool.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state, node_id) VALUES"
                       " ($1,$2,$3,'migrate','running',$4)", mig_op, row["tenant_id"], sid, cmd.node_id)
    out = MigrateOutCmd(operation_id=mig_op, sandbox_id=sid, generation=int(row["generation"]), dest_node=dest)
    await bus.publish_command(subjects.node_cmd(cmd.node_id, "migrate_out"), out,
                              msg_id=f"{mig_op}.g{out.generation}")
    deadline = time.monotonic() + timeout_s + 120
    while True:
        op = await pool.fetchrow("SELECT state, error_message, data FROM operations WHERE id=$1", mig_op)
        if op["state"] in ("succeeded", "failed"):
            break
        if time.monotonic() > deadline:
            # Not answered in time: the source keeps the sandbox unless it finishes later (fenced either way).
            prog.failed.append({"sandbox_id": sid, "reason": "the migration did not finish in time"})
            return
        if keepalive:
            await keepalive()
        await asyncio.sleep(0.5)
    if op["state"] == "failed":
        prog.failed.append({"sandbox_id": sid, "reason": op["error_message"] or "migration failed"})
        return
    data = op["data"] or {}
    prog.moved += 1
    prog.moves.append({"sandbox_id": sid, "destination": dest, "downtime_ms": data.get("downtime_ms"),
                       "total_ms": data.get("total_ms")})


async def _save(pool: asyncpg.Pool, op_id: str, prog: DrainProgress) -> None:
    await pool.execute("UPDATE operations SET progress=$2 WHERE id=$1", op_id, prog.as_json())


async def _notify(bus: Bus, op_id: str, error: str | None) -> None:
    from podbay.contracts.messages import OperationDone

    body = OperationDone(operation_id=op_id, state="failed" if error else "succeeded", error=error)
    try:
        await bus.nc.publish(subjects.operation_done(op_id), body.model_dump_json().encode())
    except Exception as exc:  # the row is the truth; the notice only wakes a waiting caller
        log.debug("notice for %s not sent: %s", op_id, exc)
