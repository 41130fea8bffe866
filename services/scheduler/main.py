"""``podbay-scheduler``: places pending sandboxes on nodes (docs/DESIGN.md §1, §4).

Consumes ``podbay.cmd.scheduler.place`` (durable consumer ``scheduler``, explicit ack). For each command, in
one transaction: read live nodes from the ``podbay_nodes`` KV bucket (a watcher's cache) and the committed load
of a few candidates from PostgreSQL, choose a node and reserve it (its own advisory lock, then its load read
again: ``Scheduler._reserve``), move the sandbox ``pending -> starting`` with a new
generation; then publish ``podbay.cmd.node.<node>.create``. A ``wake`` command places a ``resuming`` (suspended)
sandbox the same way, on any node with room and its template, and sends ``wake`` (see ``wake.py``). A redelivered command finds the sandbox already
``starting`` and re-sends the same node command (same ``Nats-Msg-Id``, so the server drops a duplicate).
When no node fits, the command is retried every second until ``PODBAY_PLACEMENT_RETRY_S`` after it was
published (capacity freed meanwhile is used), then the sandbox fails with ``no_capacity`` and the reason
(``pending.py``: a create's sandbox fails, a wake goes back to ``suspended``); the last delivery JetStream
allows fails it too, so a command never runs out of deliveries unanswered. A third loop ends sandboxes left
waiting for a node past ``PODBAY_PENDING_TIMEOUT_S`` (their command is gone; ``pending.py``).

Replicas: any number of schedulers may run. They share the one durable consumer, so JetStream hands each
command to one of them; a command whose handler died unacked is redelivered (after ``ack_wait``) to any of
them. Placement is exactly-once all the same: placements on one node are serialised by that node's advisory
lock, taken before its load is read the second time (so two replicas never both count a node's last free MiB,
while placements on different nodes run in parallel), the row is read ``FOR UPDATE``, and the update is conditional on the
state, node and generation just read; the node command's ``Nats-Msg-Id`` is ``<operation>.g<generation>``, so
a re-send after a crash between commit and ack is dropped by the server. Load comes from a query of the
candidate nodes' rows per placement (``load.py``: K random nodes placement keeps plus the affine ones, so its
cost does not grow with the fleet), scoring from ``placement.py``. Only nodes that are live (heartbeat key present)
AND ``ready`` in ``nodes.state`` are candidates (:func:`.placement.ready_nodes`). A second loop declares
silent nodes lost and moves their sandboxes (``nodeloss.py``); with several schedulers, one conditional
update decides which of them acts on a lost node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
from pydantic import BaseModel

from podbay import db, volume_state
from podbay.bus import MAX_DELIVER, Bus, connect_bus, consume
from podbay.config import Settings, get_settings
from podbay.contracts import subjects
from podbay.contracts.messages import CreateSandboxCmd, DrainNodeCmd, NodeHeartbeat, PlaceSandbox
from podbay.health import consumer_check, nats_check, pg_check
from podbay.logs import bind_log_context
from podbay import lifecycle
from podbay.contracts.states import OperationState
from podbay.lifecycle import OperationOutcome, Verb
from podbay.outbox import Relay
from podbay.service import health_app, run_service, serve_http
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS

from .drain import drain_node
from .load import candidate_loads, node_loads
from .nodeloss import NodeLossWatcher
from .pending import PendingSweeper, fail_unplaced
from .placement import NoCapacity, NodeLoad, Request, choose_node, ready_nodes, unready_reason, with_volumes
from .wake import wake_command

__all__ = ["main"]

log = logging.getLogger("podbay.scheduler")

#: First key of a node's placement lock (two-int advisory lock: this, ``hashtext(node_id)``).
PLACEMENT_LOCK_ID = 0x706C6163  # "plac"
#: Nodes one placement tries to reserve before it gives up for this delivery (:meth:`Scheduler._reserve`).
RESERVE_TRIES = 4
#: Redelivery delay of a place command that found no node, seconds.
NO_NODE_RETRY_DELAY_S = 1.0


def _kept(n: NodeLoad, req: Request) -> bool:
    """Whether placement's filter keeps ``n`` for ``req``: :func:`.placement.choose_node` asked of the node
    alone (so the filter stays choose_node's, whatever it checks)."""
    try:
        choose_node([n], req, k=1)
    except NoCapacity:
        return False
    return True


def with_volumes_hb(nodes: list[NodeHeartbeat], volume_node: str | None) -> list[NodeHeartbeat]:
    """The heartbeats of the nodes a sandbox may run on given where its volumes live (as
    :func:`.placement.with_volumes` for loads)."""
    return nodes if volume_node is None else [hb for hb in nodes if hb.node_id == volume_node]


class Scheduler:
    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: Bus, relay: Relay) -> None:
        self.settings = settings
        self.pool = pool
        self.bus = bus
        self.relay = relay

    async def _reserve(self, conn: asyncpg.Connection, candidates: list[NodeLoad], req: Request, *, k: int,
                       tenant_id: str, digest: str | None, snapshot_id: str | None) -> NodeHeartbeat:
        """Choose a node among ``candidates`` and hold it for this placement until the caller's transaction
        ends: the node's advisory lock (:data:`PLACEMENT_LOCK_ID`, ``hashtext(node_id)``), then its load read again, which now counts
        every placement on it that committed (a placement on a node holds its lock until its commit). When
        the node no longer fits, the next best candidate is tried, up to :data:`RESERVE_TRIES` nodes.

        Only the first lock is waited for; later ones are tried (``pg_try_advisory_xact_lock``) and a busy
        node is passed by, so a transaction never waits while it holds a node's lock, and two placements
        cannot deadlock. Raises :class:`NoCapacity` when every candidate filled meanwhile (the command is
        then retried as for a full fleet)."""
        left = list(candidates)
        for attempt in range(RESERVE_TRIES):
            chosen = choose_node(left, req, k=k)
            if attempt == 0:
                await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", PLACEMENT_LOCK_ID,
                                   chosen.node_id)
                got = True
            else:
                got = bool(await conn.fetchval("SELECT pg_try_advisory_xact_lock($1, hashtext($2))",
                                               PLACEMENT_LOCK_ID, chosen.node_id))
            if got:
                [fresh] = await node_loads(conn, [chosen], tenant_id=tenant_id, template=req.template,
                                           digest=digest, snapshot_id=snapshot_id)
                if _kept(fresh, req):
                    return chosen
            left = [n for n in left if n.node_id != chosen.node_id]
            if not left:
                break
        raise NoCapacity("the nodes with room filled up while this sandbox was being placed")

    async def handle(self, cmd: PlaceSandbox, waited_s: float, *, last_try: bool = False) -> bool:
        """Place one sandbox. Returns False to ask for redelivery (no node yet, within the retry window).

        ``waited_s``: seconds since the command was published; ``last_try``: JetStream will not deliver it
        again, so no node means failing now.
        """
        t0 = time.perf_counter()
        t = time.perf_counter()
        nodes = await self.bus.live_nodes()
        HOP_SECONDS.labels("scheduler", "kv").observe(time.perf_counter() - t)
        create: CreateSandboxCmd | None = None
        node_id: str | None = None
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                "SELECT state, node_id, generation, template_digest, hostname, memory_mib, vcpus,"
                " suspended_snapshot_id FROM sandboxes WHERE id = $1 FOR UPDATE", cmd.sandbox_id)
            if row is None:
                log.warning("place: sandbox %s does not exist; dropping", cmd.sandbox_id)
                return True
            want = "resuming" if cmd.wake else "pending"
            placed = "resuming" if cmd.wake else "starting"
            if row["state"] == placed and row["node_id"]:
                node_id = row["node_id"]  # redelivery after we placed it: re-send the same node command
                gen = row["generation"]
            elif row["state"] != want:
                return True  # deleted or failed meanwhile: nothing to do
            else:
                # Its volumes' rows stay locked until commit (in id order, so two sandboxes sharing them never
                # deadlock): a second sandbox sharing a volume that has no node yet waits here, then sees the
                # node the first one gave it, so both run where the volume lives.
                volume_node = next((r["node_id"] for r in await conn.fetch(
                    "SELECT v.node_id FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id"
                    " WHERE sv.sandbox_id = $1 ORDER BY v.id FOR UPDATE OF v", cmd.sandbox_id)
                    if r["node_id"] is not None), None)
                # A promoted build may go to any node holding the base it was built on (fetched there).
                fetch_root = await conn.fetchval(
                    "SELECT root FROM template_promotions WHERE name=$1 AND digest=$2 AND state='promoted'",
                    cmd.template, row["template_digest"])
                req = Request(cmd.template, cmd.resources.memory_mib, cmd.resources.vcpus, wake=cmd.wake,
                              fetch_root=fetch_root,
                              memory_overcommit=self.settings.memory_overcommit_ratio,
                              vcpu_overcommit=self.settings.vcpu_overcommit_ratio,
                              memory_estimate_mib=self.settings.memory_sandbox_estimate_mib)
                t = time.perf_counter()
                snapshot_id = row["suspended_snapshot_id"] if cmd.wake else None
                k = self.settings.placement_candidates
                # The loads of K random nodes placement keeps plus the affine ones (load.py): a query of a
                # few nodes' sandboxes, whatever the fleet's size. choose_node then scores all of them.
                candidates = await candidate_loads(
                    conn, with_volumes_hb(nodes, volume_node), keep=lambda n: _kept(n, req), k=k, wake=cmd.wake,
                    tenant_id=cmd.tenant_id, template=cmd.template, digest=row["template_digest"],
                    snapshot_id=snapshot_id)
                k = len(candidates)
                states: dict[str, str] = {}
                if not candidates:
                    # Nothing kept: every live node's state and load, for the answer choose_node gives.
                    states = {r["id"]: r["state"] for r in await conn.fetch("SELECT id, state FROM nodes")}
                    candidates = with_volumes(await node_loads(
                        conn, ready_nodes(nodes, states), tenant_id=cmd.tenant_id, template=cmd.template,
                        digest=row["template_digest"], snapshot_id=snapshot_id), volume_node)
                    k = self.settings.placement_candidates
                HOP_SECONDS.labels("scheduler", "load").observe(time.perf_counter() - t)
                try:
                    if volume_node is not None and not candidates:
                        raise NoCapacity(f"node {volume_node}, which holds the sandbox's volumes, is not live "
                                         "and ready")
                    if not candidates and (why := unready_reason(nodes, states)) is not None:
                        raise NoCapacity(why)
                    chosen = await self._reserve(conn, candidates, req, k=k, tenant_id=cmd.tenant_id,
                                                 digest=row["template_digest"], snapshot_id=snapshot_id)
                except NoCapacity as exc:
                    if waited_s < self.settings.placement_retry_s and not last_try:
                        log.info("place %s: %s; retrying", cmd.sandbox_id, exc)
                        return False
                    await fail_unplaced(conn, sandbox_id=cmd.sandbox_id, operation_id=cmd.operation_id,
                                        tenant_id=cmd.tenant_id, generation=row["generation"], code="no_capacity",
                                        reason=str(exc), wake=cmd.wake)
                    self.relay.kick()
                    LIFECYCLE_OPERATIONS.labels("scheduler", "place", "failed").inc()
                    return True
                node_id = chosen.node_id
                # Conditional on the state we read: whichever replica gets here second (a redelivery racing
                # the first delivery) changes nothing, so a sandbox is placed and its generation bumped once.
                moved = await lifecycle.apply(
                    conn, cmd.sandbox_id, Verb.PLACE, states=want, generation=row["generation"], node=row["node_id"],
                    set_node=node_id, bump_generation=True,
                    operation=OperationOutcome(cmd.operation_id, OperationState.RUNNING, finished=None))
                if moved is None:
                    log.info("place %s: placed by another scheduler meanwhile", cmd.sandbox_id)
                    return True
                gen = moved["generation"]
                # Its volumes that have no node yet live where it runs from now on (their rows are locked
                # since the start, so two sandboxes sharing a new volume agree on the node).
                await volume_state.place_of_sandbox(conn, cmd.sandbox_id, node_id)
            if cmd.wake:
                wake = await wake_command(conn, cmd, int(gen))
            create = CreateSandboxCmd(
                operation_id=cmd.operation_id, sandbox_id=cmd.sandbox_id, tenant_id=cmd.tenant_id,
                template=cmd.template, template_digest=row["template_digest"], generation=int(gen),
                resources=cmd.resources, hostname=row["hostname"])
        assert node_id is not None and create is not None
        if cmd.wake:
            await self.bus.publish_command(subjects.node_cmd(node_id, "wake"), wake,
                                           msg_id=f"{cmd.operation_id}.g{create.generation}")
        else:
            await self.bus.publish_command(subjects.node_cmd(node_id, "create"), create,
                                           msg_id=f"{cmd.operation_id}.g{create.generation}")
        LIFECYCLE_OPERATION_SECONDS.labels("scheduler", "place", "ok").observe(time.perf_counter() - t0)
        LIFECYCLE_OPERATIONS.labels("scheduler", "place", "ok").inc()
        log.info("placed %s on %s (generation %d)", cmd.sandbox_id, node_id, create.generation)
        return True


_Cmd = TypeVar("_Cmd", bound=BaseModel)


async def _parse(msg: Any, model: type[_Cmd], what: str) -> _Cmd | None:
    """The command a JetStream message (nats-py's ``Msg``: ``data`` is its JSON) carries, or None after a
    malformed one was dropped (``term``: it is never redelivered)."""
    try:
        return model.model_validate_json(msg.data)
    except ValueError as exc:
        log.error("dropping malformed %s command: %s", what, exc)
        await msg.term()
        return None


async def _consume(sched: Scheduler, stop: asyncio.Event, bound: dict[str, object]) -> None:
    sub = await sched.bus.pull_subscribe(subjects.SCHEDULER_CONSUMER, subjects.SCHEDULER_PLACE, ack_wait_s=30.0)
    bound["sub"] = sub

    async def one(msg: object) -> None:
        cmd = await _parse(msg, PlaceSandbox, "place")
        if cmd is None:
            return
        bind_log_context(sandbox_id=cmd.sandbox_id, operation_id=cmd.operation_id)
        # Time since the command was stored (JetStream's clock), so every replica and a restarted scheduler
        # count the retry window from the same moment.
        meta = msg.metadata  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
        waited_s = max(0.0, (datetime.now(UTC) - meta.timestamp).total_seconds())
        try:
            done = await sched.handle(cmd, waited_s, last_try=meta.num_delivered >= MAX_DELIVER)
        except Exception:
            log.exception("place %s failed; will be redelivered", cmd.sandbox_id)
            await msg.nak(delay=1.0)  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
            return
        if done:
            await msg.ack()  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
        else:
            await msg.nak(delay=NO_NODE_RETRY_DELAY_S)  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback

    await consume(sub, one, stop, finish_timeout_s=10)


async def _consume_drains(sched: Scheduler, stop: asyncio.Event) -> None:
    """``podbay.cmd.scheduler.drain``: one drain at a time per scheduler; the message is kept alive with
    ``in_progress`` while sandboxes move (a drain takes as long as its migrations)."""
    sub = await sched.bus.pull_subscribe(subjects.SCHEDULER_DRAIN_CONSUMER, subjects.SCHEDULER_DRAIN, ack_wait_s=60.0)

    async def one(msg: object) -> None:
        cmd = await _parse(msg, DrainNodeCmd, "drain")
        if cmd is None:
            return
        last = time.monotonic()

        async def keepalive() -> None:
            nonlocal last
            if time.monotonic() - last > 15:
                last = time.monotonic()
                await msg.in_progress()  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback

        try:
            await drain_node(sched.pool, sched.bus, cmd, migrate_timeout_s=sched.settings.migrate_timeout_s,
                             keepalive=keepalive, suspend_timeout_s=sched.settings.suspend_timeout_s,
                             kick=sched.relay.kick)
        except Exception:
            log.exception("drain of %s failed; will be redelivered", cmd.node_id)
            await msg.nak(delay=2.0)  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
            return
        await msg.ack()  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback

    await consume(sub, one, stop, finish_timeout_s=10)


async def _main(stop: asyncio.Event) -> None:
    settings = get_settings()
    pool = await db.connect_pool(settings.pg_dsn, min_size=1, max_size=10)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name="podbay-scheduler", heartbeat_ttl_s=settings.node_heartbeat_ttl_s)
    relay = Relay(pool, bus)
    sched = Scheduler(settings, pool, bus, relay)
    bound: dict[str, object] = {}
    app = health_app("scheduler", lambda: {"ok": bus.nc.is_connected}, {
        "nats": nats_check(bus), "postgres": pg_check(pool), "consumer": consumer_check(lambda: bound.get("sub"))})
    watcher = NodeLossWatcher(pool, bus, relay, grace_s=settings.node_lost_grace_s,
                              interval_s=settings.node_loss_check_s)
    sweeper = PendingSweeper(pool, relay, timeout_s=settings.pending_timeout_s,
                             interval_s=settings.pending_check_s)
    tasks = [asyncio.create_task(relay.run()), asyncio.create_task(_consume(sched, stop, bound)),
             asyncio.create_task(_consume_drains(sched, stop)),
             asyncio.create_task(serve_http(app, settings.health_host, settings.scheduler_port, stop)),
             asyncio.create_task(watcher.run(stop), name="node-loss"),
             asyncio.create_task(sweeper.run(stop), name="pending-sweep")]
    log.info("scheduler ready")
    await stop.wait()
    await asyncio.wait(tasks[1:], timeout=15)
    tasks[0].cancel()
    await bus.close()
    await pool.close()


def main() -> None:
    raise SystemExit(run_service("scheduler", _main))
