"""``podbay-warmpool``: decides how many warm slots each node keeps (docs/DESIGN.md §1, §5 warm pools).

Every ``warm_interval_s``, and at once when the API announces new bounds on ``podbay.warm.pools.changed``:

1. read the pools (``warm_pools``: min and max per template), the live nodes (``podbay_nodes`` KV) and
   recent demand (creates per template over ``warm_demand_window_s``);
2. size each pool for ``warm_demand_horizon_s`` of that demand within its bounds, and share it among the
   live nodes carrying the template as far as their memory allows (``targets.py``);
3. write ``warm_targets`` and kick each node whose target changed (``podbay.warm.<node>.kick``);
4. tidy: drop targets and unclaimed slot rows of nodes that are gone (so no create claims them), and
   claimed/failed slot rows older than the demand window.

The node agents do the work (services/nodeagent/ops/warm.py): this service never touches a VM.

Replicas: any number may run; one leads. The leader holds the ``warmpool`` lease in the ``podbay_leases`` KV
bucket (``podbay.lease``: created when absent, renewed with a revision check every third of
``lease_ttl_s``); the others renew nothing and retry the lease on the same cadence, so a standby takes over
within ``lease_ttl_s`` of the leader's death (at once when it stops cleanly and releases). Only the leader
writes targets; each pass also runs under a PostgreSQL advisory lock, so even two passes that overlapped
while a lease changed hands would be serialised rather than interleaved.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from podbay import db
from podbay.bus import Bus, connect_bus
from podbay.config import Settings, get_settings
from podbay.contracts import subjects
from podbay.health import nats_check, pg_check, task_check
from podbay.lease import Lease
from podbay.service import health_app, run_service, serve_http
from podbay.telemetry import HOP_SECONDS
from podbay import warm_slot_state

from .targets import NodeRoom, PoolBounds, pool_size, spread

__all__ = ["main", "reconcile_targets"]

log = logging.getLogger("podbay.warmpool")

WARMPOOL_LOCK_ID = 0x7761726D  # "warm": serialises reconcile passes of replicas
LEASE_NAME = "warmpool"


async def reconcile_targets(settings: Settings, pool: asyncpg.Pool, bus: Bus) -> dict[tuple[str, str], int]:
    """One pass of steps 1-4 above; returns the targets written, by (template, node)."""
    nodes = [hb for hb in await bus.live_nodes() if hb.schedulable]
    live = [hb.node_id for hb in nodes]
    window = settings.warm_demand_window_s
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", WARMPOOL_LOCK_ID)
        bounds = [PoolBounds(r["template"], r["min_size"], r["max_size"])
                  for r in await conn.fetch("SELECT template, min_size, max_size FROM warm_pools")]
        demand = {r["template"]: int(r["n"]) for r in await conn.fetch(
            "SELECT template, count(*) AS n FROM sandboxes WHERE created_at > now() - make_interval(secs => $1)"
            " GROUP BY template", window)}
        # Memory already committed per node: sandboxes, plus slots (which the node may keep or trade).
        used = {r["node_id"]: (int(r["mem"]), int(r["slot_mem"])) for r in await conn.fetch(
            "SELECT node_id, sum(mem)::int AS mem, sum(slot_mem)::int AS slot_mem FROM ("
            " SELECT node_id, memory_mib AS mem, 0 AS slot_mem FROM sandboxes WHERE node_id IS NOT NULL"
            " AND state NOT IN ('deleted', 'failed')"
            " UNION ALL SELECT node_id, 0, memory_mib FROM warm_slots WHERE state IN ('preparing', 'ready')"
            ") u GROUP BY node_id")}
        have = {(r["template"], r["node_id"]): int(r["n"]) for r in await conn.fetch(
            "SELECT template, node_id, count(*) AS n FROM warm_slots WHERE state IN ('preparing', 'ready')"
            " GROUP BY template, node_id")}
        tpl_mem = {r["name"]: int(r["memory_mib"]) for r in await conn.fetch("SELECT name, memory_mib FROM templates")}
        old = {(r["template"], r["node_id"]): int(r["target"])
               for r in await conn.fetch("SELECT template, node_id, target FROM warm_targets")}
        new: dict[tuple[str, str], int] = {}
        for b in bounds:
            size = pool_size(b, demand.get(b.template, 0), window_s=window, horizon_s=settings.warm_demand_horizon_s)
            mem = tpl_mem.get(b.template, 0) or 1
            rooms = []
            for hb in nodes:
                if b.template not in hb.templates:
                    continue
                sandboxes_mib, slots_mib = used.get(hb.node_id, (0, 0))
                free = hb.memory_mib - sandboxes_mib - slots_mib
                rooms.append(NodeRoom(hb.node_id, free // mem))
            current = {n.node_id: have.get((b.template, n.node_id), 0) for n in rooms}
            for node_id, target in spread(size, rooms, current).items():
                new[(b.template, node_id)] = target
        for (template, node_id), target in new.items():
            if old.get((template, node_id)) != target:
                await conn.execute(
                    "INSERT INTO warm_targets (template, node_id, target) VALUES ($1,$2,$3) ON CONFLICT"
                    " (template, node_id) DO UPDATE SET target=$3, updated_at=now()", template, node_id, target)
        for key in set(old) - set(new):
            await conn.execute("DELETE FROM warm_targets WHERE template=$1 AND node_id=$2", *key)
        if live:  # no heartbeat at all is more likely our own NATS trouble than every node gone
            await warm_slot_state.prune_absent_nodes(conn, live)
        await warm_slot_state.prune_old(conn, window)
    changed = {node for key, node in ((k, k[1]) for k in set(old) | set(new)) if old.get(key) != new.get(key)}
    for node_id in sorted(changed & set(live)):
        await bus.nc.publish(subjects.warm_kick(node_id), b"")
    return new


async def _loop(settings: Settings, pool: asyncpg.Pool, bus: Bus, stop: asyncio.Event, lease: Lease) -> None:
    wake = asyncio.Event()

    async def _changed(msg: object) -> None:
        wake.set()

    sub = await bus.nc.subscribe(subjects.WARM_POOLS_CHANGED, cb=_changed)
    loop = asyncio.get_running_loop()
    next_tick = 0.0
    try:
        while not stop.is_set():
            t = loop.time()
            if t >= next_tick or not lease.held:
                await lease.tick()
                next_tick = t + lease.renew_every_s
            if lease.held:
                try:
                    await reconcile_targets(settings, pool, bus)
                except Exception:
                    log.exception("warm targets not updated; trying again")
                HOP_SECONDS.labels("warmpool", "reconcile").observe(loop.time() - t)
            # A standby waits for the lease, a leader for its next pass or renewal, whichever comes first.
            wait_s = min(settings.warm_interval_s, lease.renew_every_s)
            stopper = asyncio.ensure_future(stop.wait())
            waker = asyncio.ensure_future(wake.wait())
            await asyncio.wait({stopper, waker}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            waker.cancel()
            wake.clear()
    finally:
        await lease.release()
        await sub.unsubscribe()


async def _main(stop: asyncio.Event) -> None:
    settings = get_settings()
    pool = await db.connect_pool(settings.pg_dsn, min_size=1, max_size=2)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name="podbay-warmpool", heartbeat_ttl_s=settings.node_heartbeat_ttl_s)

    lease = Lease(bus, LEASE_NAME, ttl_s=settings.lease_ttl_s)

    def health() -> dict[str, object]:
        return {"ok": bus.nc.is_connected and not pool._closed,  # noqa: SLF001  # asyncpg has no public flag
                "leader": lease.held}

    worker = asyncio.create_task(_loop(settings, pool, bus, stop, lease), name="warm-targets")
    app = health_app("warmpool", health, {"nats": nats_check(bus), "postgres": pg_check(pool),
                                          "targets loop": task_check("warm-target loop", lambda: worker)})
    log.info("warm-pool manager ready")
    await serve_http(app, settings.health_host, settings.warmpool_port, stop)
    await asyncio.wait({worker}, timeout=10)
    await bus.close()
    await pool.close()


def main() -> None:
    raise SystemExit(run_service("warmpool", _main))
