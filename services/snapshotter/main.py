"""``podbay-snapshotter``: one per node; promotes that node's snapshots to S3 and collects garbage (docs/DESIGN.md §5).

- Commands: ``podbay.cmd.snapshotter.<node>.promote`` (durable consumer ``snapshotter-<node>``, explicit
  ack). Each promotes one snapshot (:func:`podbay.promotion.promote`, idempotent), at most two at a time;
  the message is kept alive with ``in_progress`` while it runs and acked after the outcome is in the row
  (``promoted``, or ``failed`` with ``promotion_error``). A crash leaves it unacked, so JetStream
  redelivers it and the promotion is finished; a start-up also resumes this node's ``promoting`` rows.
  An error is retried on redelivery up to ``MAX_DELIVERIES`` times (an object store error up to
  ``STORAGE_MAX_DELIVERIES``, over two minutes: S3 restarting; not for a suspend, whose caller waits), then
  the promotion is ``failed``.
- Cadence: every ``promote_disk_interval_s`` the newest ready disk snapshot of each live sandbox on this
  node is promoted, unless one of its snapshots was promoted more recently (a lost node loses at most that
  much disk work). The node agent takes a disk snapshot only when the disk changed, so an idle sandbox has
  nothing to promote; a promotion hashes only the chunks whose extents differ from the previous promoted
  snapshot's. Promotions are paced by ``cadence_cpu_budget`` (:mod:`podbay.budget`).
- Volumes: every ``volume_promote_interval_s`` each volume of this node whose file changed since its newest
  promoted snapshot is snapshotted (a reflink) and promoted (:mod:`podbay.volume_promotion`); a lost node
  loses at most that much of a volume's writes. A start fails this node's volume snapshots a crash left
  ``promoting``.
- Garbage collection every ``gc_interval_s`` (:func:`podbay.promotion.collect_garbage`).

Serves ``/healthz`` (PostgreSQL, NATS and S3 answer) and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import asyncpg

from podbay import db
from podbay.budget import Budget
from podbay.bus import Bus, connect_bus, consume
from podbay.config import Settings, get_settings
from podbay.contracts import subjects
from podbay.contracts.messages import PromoteCmd
from podbay.errors import PodbayError, StorageError
from podbay.health import consumer_check, nats_check, pg_check
from podbay.logs import bind_log_context
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import Relay
from podbay.promotion import PromoteResult, collect_garbage, promote, snapshot_path
from podbay.service import health_app, run_service, serve_http
from podbay.telemetry import PROMOTION_LAG_SECONDS
from podbay.volume_promotion import due_volumes, fail_interrupted, snapshot_volume, volume_path, volume_snapshots_dir
from podbay import snapshot_state

__all__ = ["main", "Snapshotter"]

log = logging.getLogger("podbay.snapshotter")

MAX_DELIVERIES = 3
#: Deliveries of a promotion that failed for the object store only (S3 down or restarting): the try after
#: delivery n waits ``min(2 n, STORAGE_RETRY_CAP_S)`` s, so 12 deliveries wait out more than two minutes of outage.
STORAGE_MAX_DELIVERIES = 12
STORAGE_RETRY_CAP_S = 30.0
PROMOTIONS_AT_ONCE = 2
ACK_WAIT_S = 60.0


class Snapshotter:
    """Promotion, cadence and garbage collection for one node."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: Bus, store: ObjectStore, relay: Relay) -> None:
        self.settings = settings
        self.pool = pool
        self.bus = bus
        self.store = store
        self.relay = relay
        self.slots = asyncio.Semaphore(PROMOTIONS_AT_ONCE)
        self.budget = Budget(settings.cadence_cpu_budget / 2)  # the other half: the node agent's snapshots
        self._running: dict[str, asyncio.Task[PromoteResult]] = {}

    async def promote_one(self, snapshot_id: str) -> PromoteResult:
        """Promote ``snapshot_id`` (one task per snapshot even when asked twice). Raises what ``promote`` does."""
        task = self._running.get(snapshot_id)
        if task is None:
            task = asyncio.create_task(self._promote(snapshot_id))
            self._running[snapshot_id] = task
            task.add_done_callback(lambda _t: self._running.pop(snapshot_id, None))
        return await asyncio.shield(task)

    async def _promote(self, snapshot_id: str) -> PromoteResult:
        async with self.slots:
            row = await self.pool.fetchrow("SELECT sandbox_id, node_id FROM snapshots WHERE id=$1", snapshot_id)
            if row is None:
                raise PodbayError(f"snapshot {snapshot_id} does not exist")
            node = row["node_id"] or self.settings.node_id
            path = snapshot_path(self.settings.data_dir, node, row["sandbox_id"], snapshot_id)
            res = await promote(self.pool, self.store, self.settings, snapshot_id, path)
            self.relay.kick()
            return res

    async def fail(self, snapshot_id: str, reason: str) -> None:
        await snapshot_state.fail_promotion(self.pool, snapshot_id, reason[:2000])

    async def handle(self, msg: Any) -> None:
        """One promote command: ack on an outcome, nak to retry a retryable error, term a malformed one."""
        try:
            cmd = PromoteCmd.model_validate_json(msg.data)
        except ValueError as exc:
            log.error("dropping malformed promote command: %s", exc)
            await msg.term()
            return
        bind_log_context(sandbox_id=cmd.sandbox_id)
        keepalive = asyncio.create_task(_keep_alive(msg))
        try:
            await self.promote_one(cmd.snapshot_id)
        except Exception as exc:
            reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
            deliveries = getattr(getattr(msg, "metadata", None), "num_delivered", 1) or 1
            # An object store outage (a restart, a rolling update) is waited out longer than other errors; a
            # promotion is recorded only once all its objects are verified (podbay.promotion), so a retry
            # finishes what the outage interrupted.
            # A suspend's promotion is the exception: its caller waits, and a failure leaves the sandbox paused
            # and intact with the error, so it fails as fast as any other error.
            waited_out = isinstance(exc, StorageError) and cmd.reason != "suspend"
            limit = STORAGE_MAX_DELIVERIES if waited_out else MAX_DELIVERIES
            if (isinstance(exc, StorageError) or not isinstance(exc, PodbayError)) and deliveries < limit:
                log.warning("promotion of %s failed (try %d): %s; retrying", cmd.snapshot_id, deliveries, reason)
                await msg.nak(delay=min(2.0 * deliveries, STORAGE_RETRY_CAP_S))
                return
            log.warning("promotion of %s failed: %s", cmd.snapshot_id, reason)
            await self.fail(cmd.snapshot_id, reason)
        finally:
            keepalive.cancel()
        await msg.ack()

    async def resume_interrupted(self) -> None:
        """Finish this node's promotions that a crash left ``promoting`` (their commands may be acked already)."""
        rows = await self.pool.fetch("SELECT id FROM snapshots WHERE node_id=$1 AND promotion='promoting'",
                                     self.settings.node_id)
        for r in rows:
            await self.bus.publish_command(subjects.snapshotter_promote(self.settings.node_id),
                                           await self._cmd_for(r["id"]), msg_id=f"promote.{r['id']}.resume")

    async def _cmd_for(self, snapshot_id: str) -> PromoteCmd:
        sandbox_id = await self.pool.fetchval("SELECT sandbox_id FROM snapshots WHERE id=$1", snapshot_id)
        return PromoteCmd(snapshot_id=snapshot_id, sandbox_id=sandbox_id, reason="request")

    async def cadence_once(self) -> int:
        """Promote the newest ready disk snapshot of each live sandbox here that is due. Returns how many."""
        interval = self.settings.promote_disk_interval_s
        rows = await self.pool.fetch(
            "SELECT DISTINCT ON (s.sandbox_id) s.id FROM snapshots s JOIN sandboxes b ON b.id = s.sandbox_id"
            " WHERE s.node_id=$1 AND s.kind='disk' AND s.state='ready' AND s.promotion='local'"
            " AND b.state IN ('running', 'paused')"
            " AND NOT EXISTS (SELECT 1 FROM snapshots p WHERE p.sandbox_id = s.sandbox_id"
            "                 AND (p.promotion = 'promoting' OR (p.promotion = 'promoted'"
            "                      AND p.promoted_at > now() - make_interval(secs => $2))))"
            " ORDER BY s.sandbox_id, s.created_at DESC", self.settings.node_id, float(interval))
        for r in rows:
            # Paced (cadence_cpu_budget): promotions of many sandboxes spread out instead of hashing back to back.
            await asyncio.sleep(self.budget.wait_s())
            t = time.monotonic()
            try:
                await self.promote_one(r["id"])
            except Exception as exc:
                # The list is read before the promotions run; a snapshot deleted meanwhile (its sandbox
                # deleted, or retention) is no failure, and its files may already be gone.
                state = await self.pool.fetchval("SELECT state FROM snapshots WHERE id=$1", r["id"])
                if state in (None, "deleted"):
                    log.info("cadence promotion of %s skipped: the snapshot was deleted meanwhile", r["id"])
                    continue
                log.warning("cadence promotion of %s failed: %s", r["id"], exc)
                await self.fail(r["id"], str(exc))
            finally:
                self.budget.charge(time.monotonic() - t)
        return len(rows)


    async def volume_cadence_once(self) -> int:
        """Snapshot and promote each volume of this node that is due (module docstring), one at a time.
        Returns how many were promoted; a failure is logged and the volume is tried again next time."""
        s = self.settings
        done = 0
        for vol in await due_volumes(self.pool, s.data_dir, s.node_id, s.volume_promote_interval_s):
            try:
                async with self.slots:
                    await snapshot_volume(self.pool, self.store, s, vol, node_id=s.node_id,
                                          source=volume_path(s.data_dir, s.node_id, vol),
                                          work_dir=volume_snapshots_dir(s.data_dir, s.node_id), reason="cadence")
                done += 1
            except Exception as exc:
                log.warning("cadence promotion of volume %s failed: %s", vol, exc)
        return done


async def _keep_alive(msg: Any) -> None:
    """Tell JetStream a long promotion is still being worked on, so it is not redelivered meanwhile."""
    while True:
        await asyncio.sleep(ACK_WAIT_S / 3)
        with contextlib.suppress(Exception):
            await msg.in_progress()


PROMOTION_LAG_SQL = (
    "SELECT coalesce(max(extract(epoch FROM now() - coalesce(p.newest, s.created_at))), 0)::float8"
    " FROM sandboxes s LEFT JOIN LATERAL (SELECT max(created_at) AS newest FROM snapshots"
    "  WHERE sandbox_id = s.id AND promotion = 'promoted') p ON true"
    " WHERE s.node_id = $1 AND s.state IN ('running', 'paused')")


async def measure_promotion_lag(pool: asyncpg.Pool, node_id: str) -> float:
    """Set ``podbay_snapshot_promotion_lag_seconds`` for ``node_id`` and return it (seconds)."""
    lag = float(await pool.fetchval(PROMOTION_LAG_SQL, node_id))
    PROMOTION_LAG_SECONDS.set(lag)
    return lag


async def _every(seconds: float, stop: asyncio.Event, what: str, fn: Any) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=seconds)
        if stop.is_set():
            return
        try:
            await fn()
        except Exception as exc:
            log.warning("%s failed: %s", what, exc)


async def _main(stop: asyncio.Event) -> None:
    settings = get_settings()
    pool = await db.connect_pool(settings.pg_dsn, min_size=1, max_size=8)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name=f"podbay-snapshotter-{settings.node_id}")
    relay = Relay(pool, bus)
    state: dict[str, object] = {"ok": False, "s3": "unknown"}
    async with open_store(settings) as store:

        async def check_s3() -> None:
            try:
                await store.ensure_bucket()
                state["s3"] = "ok"
            except StorageError as exc:
                state["s3"] = f"error: {exc.message}"
            state["ok"] = state["s3"] == "ok" and bus.nc.is_connected

        await check_s3()
        snap = Snapshotter(settings, pool, bus, store, relay)
        sub = await bus.pull_subscribe(subjects.snapshotter_consumer(settings.node_id),
                                       subjects.snapshotter_promote(settings.node_id), ack_wait_s=ACK_WAIT_S)

        async def s3_ready() -> str | None:
            return None if state["s3"] == "ok" else str(state["s3"])

        app = health_app("snapshotter", lambda: dict(state), {
            "nats": nats_check(bus), "postgres": pg_check(pool), "s3": s3_ready,
            "consumer": consumer_check(lambda: sub)})
        tasks = [
            asyncio.create_task(relay.run()),
            asyncio.create_task(serve_http(app, settings.health_host, settings.snapshotter_port, stop)),
            asyncio.create_task(consume(sub, snap.handle, stop, finish_timeout_s=30)),
            asyncio.create_task(_every(10.0, stop, "S3 health check", check_s3)),
            asyncio.create_task(_every(settings.gc_interval_s, stop, "garbage collection",
                                       lambda: collect_garbage(pool, store, settings.gc_grace_s))),
        ]
        tasks.append(asyncio.create_task(_every(15.0, stop, "promotion lag",
                                                lambda: measure_promotion_lag(pool, settings.node_id))))
        if settings.promote_disk_interval_s > 0:
            tasks.append(asyncio.create_task(_every(min(settings.promote_disk_interval_s, 30.0), stop,
                                                    "disk promotion cadence", snap.cadence_once)))
        if settings.volume_promote_interval_s > 0:
            tasks.append(asyncio.create_task(_every(min(settings.volume_promote_interval_s, 30.0), stop,
                                                    "volume promotion cadence", snap.volume_cadence_once)))
        try:
            await fail_interrupted(pool, settings.node_id)
        except Exception as exc:
            log.warning("failing interrupted volume promotions failed: %s", exc)
        try:
            await snap.resume_interrupted()
        except Exception as exc:
            log.warning("resuming interrupted promotions failed: %s", exc)
        log.info("snapshotter ready (node %s, bucket %s: %s)", settings.node_id, settings.s3_bucket, state["s3"])
        await stop.wait()
        await asyncio.wait(tasks[1:], timeout=45)  # 30 s for promotions in flight, then hand-back
        tasks[0].cancel()
    await bus.close()
    await pool.close()


def main() -> None:
    raise SystemExit(run_service("snapshotter", _main))
