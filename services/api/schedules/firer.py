"""The schedule firer: one API replica at a time (leader lease ``schedules``) turns due schedules into runs
and carries them out.

Why in the API process: a run is a sequence of API operations (resume, exec through the node's data plane,
pause or suspend with their operation rows, audit and events, waiting on the API's event waiter). Running it
where those live composes them instead of copying them into another service; the lease makes it a singleton
among API replicas, as the webhook deliverer runs beside the API.

Each tick (``PODBAY_SCHEDULE_TICK_S``), while the lease is held:

1. **Fire.** In one transaction, schedules whose ``next_fire_at`` has come are locked (``FOR UPDATE SKIP
   LOCKED``); for each, one ``schedule_runs`` row is inserted for that fire time (unique on
   ``(schedule_id, fire_at)``) and ``next_fire_at`` advances. The insert and the advance commit together, so a
   fire is recorded exactly once however many replicas try and wherever one dies. A fire found more than
   ``PODBAY_SCHEDULE_MISSED_GRACE_S`` late was missed (everything was down): ``missed=catch_up_once`` runs it
   once (later missed times are not fired one by one), ``skip`` records it ``skipped``. A fire while the
   schedule's previous run is still queued or running is recorded ``skipped`` (``overlap=skip``) or queued.
2. **Start.** Queued runs whose jittered time (``due_at``) has come start, one at a time per sandbox and at
   most ``PODBAY_SCHEDULE_NODE_WAKES_MAX`` at once per node (suspended sandboxes share one pool until placed).
3. **Heartbeat and recovery.** Runs in flight here renew ``heartbeat_at``; a ``running`` run whose heartbeat
   is older than the lease TTL plus two ticks lost its process (SIGKILL, crash): it is taken over, its
   sandbox put back to its state before the wake, and it is marked ``interrupted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

from podbay.contracts.events import EventType
from podbay.contracts.schedules import ScheduleRunState
from podbay.lease import Lease
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import emit_sandbox_event, new_id
from podbay.telemetry import SCHEDULE_RUNS
from podbay import schedule_run_state

from ..core.context import ApiContext
from .cron import due_after_missed, jitter
from .run import Run, execute, finish_event, recover

__all__ = ["ScheduleFirer", "LEASE_NAME", "UNPLACED"]

log = logging.getLogger("podbay.api.schedules")

LEASE_NAME = "schedules"
#: The wake pool of sandboxes with no node (suspended): they count against one shared limit until placed.
UNPLACED = "(unplaced)"
#: Schedules fired per transaction; more wait for the next tick.
FIRE_BATCH = 500


class ScheduleFirer:
    """Fires schedules while this process holds the ``schedules`` lease. ``run(stop)`` until ``stop`` is set."""

    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.lease = Lease(ctx.bus, LEASE_NAME, ttl_s=self.settings.lease_ttl_s)
        self.owner = self.lease.holder
        self.tasks: dict[str, asyncio.Task[None]] = {}  # run id -> its task
        self.busy_sandboxes: set[str] = set()
        self.node_of: dict[str, str] = {}  # run id -> the wake pool it counts against
        self.store: ObjectStore | None = None

    @property
    def stale_after_s(self) -> float:
        """A ``running`` run whose heartbeat is older than this lost its process."""
        return self.settings.lease_ttl_s + 2 * self.settings.schedule_tick_s

    async def run(self, stop: asyncio.Event) -> None:
        every = min(self.settings.schedule_tick_s, self.lease.renew_every_s)
        async with contextlib.AsyncExitStack() as stack:
            try:
                self.store = await stack.enter_async_context(open_store(self.settings))
            except Exception as exc:  # the head and tail of output still go to PostgreSQL
                log.warning("schedules: no object store (%s); run output is kept in PostgreSQL only", exc)
            while not stop.is_set():
                try:
                    # Runs in flight keep their heartbeat even without the lease (NATS trouble): they are
                    # still being carried out here, and must not be taken over while they are.
                    await self._heartbeat()
                    if await self.lease.tick():
                        await self.tick()
                except Exception:
                    log.exception("schedules: tick failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=every)
            # Runs in flight stay `running`: the next holder puts their sandboxes back (recover).
            for task in self.tasks.values():
                task.cancel()
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()), timeout=5)
            await self.lease.release()

    async def _heartbeat(self) -> None:
        if self.tasks:
            await schedule_run_state.heartbeat(self.ctx.pool, list(self.tasks))

    async def tick(self) -> None:
        """One pass as the lease holder: recovery, fire due schedules, start due runs."""
        await self._take_over_stale()
        await self.fire_due()
        await self._start_due()

    async def _take_over_stale(self) -> None:
        rows = await schedule_run_state.take_over_stale(self.ctx.pool, self.owner, self.stale_after_s,
                                                        list(self.tasks))
        for r in rows:
            log.warning("schedules: run %s lost its process; putting sandbox %s back", r["id"], r["sandbox_id"])
            self._spawn(r["id"], r["sandbox_id"], UNPLACED, recover(self.ctx, r["id"], self.owner))

    async def fire_due(self, now: datetime | None = None, *, only: list[str] | None = None) -> int:
        """Record one run (or a skip) for each schedule whose time has come by ``now`` (default: the clock;
        ``only``: these schedule ids alone); returns how many were recorded."""
        now = now or datetime.now(UTC)
        grace = self.settings.schedule_missed_grace_s
        recorded = 0
        skipped: list[tuple[str, str, str, str, str]] = []
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            due = await conn.fetch(
                "SELECT s.id, s.sandbox_id, s.tenant_id, s.cron, s.tz, s.overlap, s.missed, s.next_fire_at,"
                " EXISTS (SELECT 1 FROM schedule_runs r WHERE r.schedule_id = s.id AND r.state IN ('queued','running'))"
                " AS open FROM schedules s WHERE s.next_fire_at <= $1 AND ($3::text[] IS NULL OR s.id = ANY($3::text[]))"
                " ORDER BY s.next_fire_at LIMIT $2 FOR UPDATE OF s SKIP LOCKED", now, FIRE_BATCH, only)
            for s in due:
                fire_at: datetime = s["next_fire_at"]
                missed = (now - fire_at).total_seconds() > grace
                state, reason = ScheduleRunState.QUEUED, None
                if missed and s["missed"] == "skip":
                    state, reason = ScheduleRunState.SKIPPED, "missed"
                elif s["open"] and s["overlap"] == "skip":
                    state, reason = ScheduleRunState.SKIPPED, "overlap"
                due_at = (now if missed else fire_at) + jitter(s["id"], fire_at, self.settings.schedule_jitter_s)
                run_id = new_id("run")
                inserted = await schedule_run_state.insert(
                    conn, run_id, schedule_id=s["id"], sandbox_id=s["sandbox_id"], tenant_id=s["tenant_id"],
                    fire_at=fire_at, due_at=due_at, state=state, reason=reason)
                await conn.execute("UPDATE schedules SET next_fire_at=$2 WHERE id=$1", s["id"],
                                   due_after_missed(cron=s["cron"], tz=s["tz"], fire_at=fire_at, now=now))
                if inserted is None:
                    continue
                recorded += 1
                if state == ScheduleRunState.SKIPPED:
                    assert reason is not None
                    skipped.append((run_id, s["id"], s["sandbox_id"], s["tenant_id"], reason))
                    await emit_sandbox_event(conn, s["sandbox_id"], EventType.SCHEDULE_FINISHED, tenant_id=s["tenant_id"],
                                             data=finish_event(run_id, s["id"], state, reason=reason,
                                                               fire_at=fire_at.isoformat()))
        if skipped:
            self.ctx.relay.kick()
            SCHEDULE_RUNS.labels(ScheduleRunState.SKIPPED.value).inc(len(skipped))
        return recorded

    async def _start_due(self) -> None:
        rows = await self.ctx.pool.fetch(
            "SELECT r.id, r.schedule_id, r.sandbox_id, r.tenant_id, r.fire_at, s.command, s.awake_s, sb.node_id"
            " FROM schedule_runs r JOIN schedules s ON s.id = r.schedule_id JOIN sandboxes sb ON sb.id = r.sandbox_id"
            " WHERE r.state='queued' AND r.due_at <= now() ORDER BY r.due_at LIMIT 1000")
        in_pool: dict[str, int] = {}
        for node in self.node_of.values():
            in_pool[node] = in_pool.get(node, 0) + 1
        for r in rows:
            if r["id"] in self.tasks or r["sandbox_id"] in self.busy_sandboxes:
                continue  # one run at a time per sandbox: a queued run waits for the one before it
            node = r["node_id"] or UNPLACED
            if in_pool.get(node, 0) >= self.settings.schedule_node_wakes_max:
                continue
            in_pool[node] = in_pool.get(node, 0) + 1
            run = Run(id=r["id"], schedule_id=r["schedule_id"], sandbox_id=r["sandbox_id"], tenant_id=r["tenant_id"],
                      fire_at=r["fire_at"], command=r["command"], awake_s=r["awake_s"])
            self._spawn(run.id, run.sandbox_id, node, execute(self.ctx, self.store, run, self.owner))

    def _spawn(self, run_id: str, sandbox_id: str, node: str, work: Any) -> None:
        self.busy_sandboxes.add(sandbox_id)
        self.node_of[run_id] = node

        async def guarded() -> None:
            t0 = time.perf_counter()
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("schedules: run %s failed unexpectedly; putting its sandbox back", run_id)
                with contextlib.suppress(Exception):
                    await recover(self.ctx, run_id, self.owner)
            finally:
                log.info("schedules: run %s done in %.1f s", run_id, time.perf_counter() - t0)
                self.tasks.pop(run_id, None)
                self.node_of.pop(run_id, None)
                self.busy_sandboxes.discard(sandbox_id)

        self.tasks[run_id] = asyncio.create_task(guarded(), name=f"schedule-run-{run_id}")
