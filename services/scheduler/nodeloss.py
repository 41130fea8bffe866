"""Node loss: a node whose heartbeat stays gone is marked ``lost`` and its sandboxes move elsewhere.

A node's heartbeat key in the ``podbay_nodes`` KV bucket expires ``PODBAY_NODE_HEARTBEAT_TTL_S`` after its
last put. Each scheduler polls the bucket every ``PODBAY_NODE_LOSS_CHECK_S`` and remembers since when each
``ready`` or ``draining`` node has been absent (:func:`lost_nodes`, pure). Once absent for
``PODBAY_NODE_LOST_GRACE_S`` it acts (:func:`declare_lost`), in one transaction:

1. ``UPDATE nodes SET state='lost' ... WHERE id=$1 AND state IN ('ready','draining') RETURNING id``: with two
   schedulers running, exactly one gets the row back and goes on; the other does nothing.
2. Each sandbox on the node is fenced: its generation goes up by one and its node is cleared, so any command
   the old node still acts on is refused (a node agent checks node and generation on every command), and a
   node agent that comes back stops its copy (``services/nodeagent/ops/fence.py``).
   - with a promoted full snapshot (the newest one): ``resuming`` from it, exactly like a resume of a
     suspended sandbox (``wake.py``); event ``rescheduled`` says which node was lost and how much work was
     lost (``lost_work_s``: seconds between that snapshot and the loss);
   - ``starting`` without one (a create in flight): back to ``pending`` and placed again;
   - ``suspending`` with a promoted full snapshot: ``suspended`` at it (what was asked);
   - ``deleting``: deleted (its files went with the node);
   - with a read-write volume: ``failed`` (its memory holds the volume's mount, and the volume's newest
     promoted snapshot is not of the same moment); the volume stays its, and mounts again from that
     snapshot on a rollback to a disk snapshot or in a later sandbox;
   - otherwise: ``failed`` with a reason that says so.
   Its ready or preparing warm slots fail; operations in flight on those sandboxes fail with ``node_lost``.
3. Volumes bound to the node that have a promoted snapshot are unbound: the next sandbox using one, on any
   node, fetches that snapshot (at most ``volume_promote_interval_s`` of its writes are lost). Volumes
   never promoted stay bound to the lost node.
4. Event ``podbay.evt.node.<id>.lost`` with what became of each sandbox.

After the commit the wake and create placements are published to ``podbay.cmd.scheduler.place`` (the
operation id is the ``Nats-Msg-Id``, so a retry is dropped as a duplicate).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import asyncpg

from podbay.contracts.events import EventType
from podbay.bus import Bus
from podbay.contracts import subjects
from podbay.contracts.messages import Event, PlaceSandbox, Resources
from podbay import lifecycle
from podbay.contracts.states import NodeState, OperationState
from podbay.lifecycle import NewOperation, OperationOutcome, SandboxEvent, Verb
from podbay.outbox import Relay, emit, new_id
from podbay.service import run_every
from podbay import operation_state
from podbay import warm_slot_state
from podbay import volume_state

__all__ = ["WATCHED_STATES", "lost_nodes", "LossReport", "declare_lost", "NodeLossWatcher"]

log = logging.getLogger("podbay.scheduler.nodeloss")

#: Node states whose silence means loss (a drained node holds nothing; a lost one is already handled).
WATCHED_STATES = frozenset({NodeState.READY, NodeState.DRAINING})


def lost_nodes(now: float, live: set[str], states: dict[str, str], absent_since: dict[str, float],
               grace_s: float) -> list[str]:
    """Nodes to declare lost now, sorted.

    ``now``: monotonic seconds; ``live``: node ids with a heartbeat key; ``states``: node id -> ``nodes.state``;
    ``absent_since``: node id -> when this scheduler first saw it absent (updated in place: set on the first
    absence, dropped when the node is live again, not watched or gone). A watched node counts once it has
    been absent for at least ``grace_s`` seconds *as seen by this scheduler*, so a scheduler that just started
    waits a whole grace before it acts.
    """
    for nid in list(absent_since):
        if nid not in states or nid in live or states[nid] not in WATCHED_STATES:
            del absent_since[nid]
    out = []
    for nid, state in states.items():
        if nid in live or state not in WATCHED_STATES:
            continue
        first = absent_since.setdefault(nid, now)
        if now - first >= grace_s:
            out.append(nid)
    return sorted(out)


@dataclass
class LossReport:
    """What :func:`declare_lost` did: ``acted`` False when another scheduler (or a state change) won."""

    node_id: str
    acted: bool = False
    rescheduled: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # creates in flight, placed again
    failed: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    suspended: list[str] = field(default_factory=list)  # was suspending: suspended at its promoted snapshot
    placements: list[PlaceSandbox] = field(default_factory=list)


_SANDBOXES = (
    "SELECT s.id, s.tenant_id, s.state, s.template, s.memory_mib, s.vcpus, s.generation,"
    " (SELECT o.id FROM operations o WHERE o.sandbox_id = s.id ORDER BY o.created_at DESC LIMIT 1) AS op_id,"
    " (SELECT o.kind FROM operations o WHERE o.sandbox_id = s.id ORDER BY o.created_at DESC LIMIT 1) AS op_kind,"
    " s.source_snapshot_id"
    " FROM sandboxes s WHERE s.node_id = $1 AND s.state NOT IN ('deleted', 'failed', 'suspended')"
    " ORDER BY s.id FOR UPDATE")
_NEWEST_PROMOTED = (
    "SELECT id, created_at, extract(epoch FROM now() - created_at)::float8 AS age_s FROM snapshots"
    " WHERE sandbox_id=$1 AND kind='full' AND promotion='promoted' AND state='ready'"
    " ORDER BY created_at DESC LIMIT 1")


async def declare_lost(conn: asyncpg.Connection, node_id: str) -> LossReport:
    """Mark ``node_id`` lost and fence and move its sandboxes (module docstring), inside the caller's
    transaction. Returns what was done; the caller publishes ``report.placements`` after the commit."""
    report = LossReport(node_id)
    won = await conn.fetchval(
        "UPDATE nodes SET state=$2, lost_at=now(), state_changed_at=now() WHERE id=$1"
        " AND state IN ($3, $4) RETURNING id", node_id, NodeState.LOST, NodeState.READY, NodeState.DRAINING)
    if won is None:
        return report
    report.acted = True
    for r in await conn.fetch(_SANDBOXES, node_id):
        await _move(conn, node_id, r, report)
    await volume_state.release_of_lost_node(conn, node_id)
    await warm_slot_state.fail_on_lost_node(conn, node_id, f"node {node_id} was lost")
    event = Event(id=new_id("evt"), type="lost", node_id=node_id, state=NodeState.LOST, at=datetime.now(UTC),
                  reason="heartbeat absent beyond the grace period",
                  data={"rescheduled": report.rescheduled, "replaced": report.replaced, "failed": report.failed,
                        "deleted": report.deleted, "suspended": report.suspended})
    await emit(conn, subjects.node_event(node_id, "lost"), event)
    return report


async def _move(conn: asyncpg.Connection, node_id: str, r: asyncpg.Record, report: LossReport) -> None:
    sid, tenant, state = r["id"], r["tenant_id"], r["state"]
    lost = f"node {node_id} was lost"
    # Whatever was in flight on the lost node will not finish there.
    await operation_state.fail_in_flight(conn, sid, "node_lost", lost)
    res = Resources(memory_mib=r["memory_mib"], vcpus=r["vcpus"])
    if state == "deleting":
        await lifecycle.apply(
            conn, sid, Verb.DELETED, states=state, set_node=None, bump_generation=True,
            operation=OperationOutcome(r["op_id"], OperationState.SUCCEEDED, error_code=None, error_message=None,
                                       finished=None),
            event=SandboxEvent(EventType.DELETED, reason=lost, tenant_id=tenant, new_generation=True,
                               data={"lost_node": node_id}))
        report.deleted.append(sid)
        return
    snap = await conn.fetchrow(_NEWEST_PROMOTED, sid)
    if snap is not None and await conn.fetchval(
            "SELECT true FROM sandbox_volumes WHERE sandbox_id=$1 AND NOT readonly LIMIT 1", sid):
        snap = None  # its memory's mount would not match the volume's promoted copy: failed below
    if snap is not None and state == "suspending":
        # It was being suspended: it ends suspended (at its newest promoted snapshot), as asked.
        await lifecycle.apply(
            conn, sid, Verb.SUSPENDED, states=state, set_node=None, bump_generation=True,
            values={"suspended_snapshot_id": snap["id"]},
            event=SandboxEvent(EventType.SUSPENDED, tenant_id=tenant, new_generation=True,
                               reason=f"{lost} while suspending; suspended at snapshot {snap['id']}",
                               data={"lost_node": node_id, "snapshot_id": snap["id"],
                                     "lost_work_s": round(float(snap["age_s"]), 3)}))
        report.suspended.append(sid)
        return
    if snap is not None:
        op_id = new_id("op")
        lost_work_s = round(float(snap["age_s"]), 3)
        await lifecycle.apply(
            conn, sid, Verb.RESCHEDULE, states=state, set_node=None, bump_generation=True,
            values={"suspended_snapshot_id": snap["id"]}, operation=NewOperation(op_id, tenant, "reschedule"),
            event=SandboxEvent(
                EventType.RESCHEDULED, tenant_id=tenant, new_generation=True,
                reason=f"{lost}; restoring snapshot {snap['id']} taken {lost_work_s:.1f} s before the loss",
                data={"lost_node": node_id, "previous_state": state, "snapshot_id": snap["id"],
                      "snapshot_at": snap["created_at"].isoformat(), "lost_work_s": lost_work_s,
                      "operation_id": op_id}))
        report.rescheduled.append(sid)
        report.placements.append(PlaceSandbox(operation_id=op_id, sandbox_id=sid, tenant_id=tenant,
                                              template=r["template"], resources=res, wake=True, fallback=True))
        return
    if state in ("pending", "starting") and r["op_kind"] == "create" and not r["source_snapshot_id"] and r["op_id"]:
        # A create that had not finished: nothing of the guest was there yet; place it again.
        await lifecycle.apply(
            conn, sid, Verb.REQUEUE, states=state, set_node=None, bump_generation=True,
            operation=OperationOutcome(r["op_id"], OperationState.PENDING, error_code=None, error_message=None,
                                       finished=False))
        report.replaced.append(sid)
        report.placements.append(PlaceSandbox(operation_id=r["op_id"], sandbox_id=sid, tenant_id=tenant,
                                              template=r["template"], resources=res))
        return
    reason = f"{lost} and the sandbox had no promoted full snapshot to restore (or has a read-write volume)"
    await lifecycle.apply(
        conn, sid, Verb.FAIL, states=state, set_node=None, bump_generation=True, values={"failure_reason": reason},
        event=SandboxEvent(EventType.FAILED, reason=reason, tenant_id=tenant, new_generation=True,
                           data={"lost_node": node_id, "previous_state": state}))
    report.failed.append(sid)


class NodeLossWatcher:
    """The scheduler's loop that finds and handles lost nodes (module docstring)."""

    def __init__(self, pool: asyncpg.Pool, bus: Bus, relay: Relay, *, grace_s: float, interval_s: float) -> None:
        self.pool, self.bus, self.relay = pool, bus, relay
        self.grace_s, self.interval_s = grace_s, interval_s
        self.absent_since: dict[str, float] = {}
        #: Placements committed but not yet published (NATS failed): retried every pass.
        self.unsent: list[PlaceSandbox] = []

    async def check(self) -> list[LossReport]:
        """One pass: read live heartbeats and node states, declare what is lost, publish its placements."""
        await self._publish()
        live = {hb.node_id for hb in await self.bus.live_nodes()}
        states = {r["id"]: r["state"] for r in await self.pool.fetch("SELECT id, state FROM nodes")}
        reports = []
        for nid in lost_nodes(time.monotonic(), live, states, self.absent_since, self.grace_s):
            async with self.pool.acquire() as conn, conn.transaction():
                report = await declare_lost(conn, nid)
            self.absent_since.pop(nid, None)
            if not report.acted:
                continue
            self.relay.kick()
            log.warning("node %s lost: %d rescheduled, %d placed again, %d failed, %d deleted", nid,
                        len(report.rescheduled), len(report.replaced), len(report.failed), len(report.deleted))
            self.unsent.extend(report.placements)
            reports.append(report)
        await self._publish()
        return reports

    async def _publish(self) -> None:
        # The operation id is the Nats-Msg-Id, so a placement sent twice is dropped as a duplicate.
        while self.unsent:
            place = self.unsent[0]
            await self.bus.publish_command(subjects.SCHEDULER_PLACE, place, msg_id=place.operation_id)
            self.unsent.pop(0)

    async def run(self, stop: asyncio.Event) -> None:
        """:meth:`check` every ``interval_s`` until ``stop``; a failed pass is logged and retried."""
        await run_every(stop, self.interval_s, self.check, log, "node loss check failed; retrying")
