"""Benchmark: a fleet of simulated nodes under the real api, scheduler and warmpool (issue 42, "a fleet
simulation").

    .venv/bin/python tests/bench/fleet.py --nodes 1000 --json fleet.json [--rate 10000] [--hold N]
        [--duration-s 60] [--heartbeat-s 2]

Starts real NATS (with its monitoring port), real PostgreSQL (with ``pg_stat_statements`` preloaded) and S3,
then the api, scheduler and warmpool processes (one each), and in this process ``--nodes`` simulated node
agents (``podbay.devstack.simnode``: they register, heartbeat and answer their command subjects with fake
VMs). It seeds ``--hold`` running sandboxes spread over the nodes (default 100 per node: 100,000 at 1,000),
then drives ``POST /v1/sandboxes`` (wait for the start) at ``--rate`` creates a minute for ``--duration-s``
seconds, open loop (a create starts on schedule whether or not earlier ones answered, up to 256 at once).

JSON keys (each path with ``p50_ms``/``p99_ms``):

- ``create_e2e``: the create call until it answers 201, as the client sees it;
- ``placement``: the scheduler's placement of one sandbox: from its placing transaction's start to the node
  command stored by JetStream (lock wait, load, update, commit, publish);
- ``placement_queue``: from the API's insert of the row to the node command stored (queueing included);
- ``<counter>_per_create`` (``value``): PostgreSQL statements (``pg_statements``: ``pg_stat_statements``
  calls), rows they returned or touched (``pg_rows``), transactions (``pg_xacts``) and tuples read
  (``pg_tup_returned``: scans show here), and NATS messages into and out of the server (``nats_in_msgs``,
  ``nats_out_msgs``: ``/varz``), over the measured phase divided by the creates that succeeded;
  ``top_statements_per_create``: the statements with most calls per create;
  ``costliest_statements_ms_per_create``: those with most execution time per create (ms);
- ``creates_per_min_sustained``: creates that succeeded over the phase's wall time; ``throughput``: creates
  attempted, succeeded, failed, sandboxes started twice (must be 0), commands a fence turned away, and the
  load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import report, stop_on_sigterm, summarise  # noqa: E402

from podbay import db  # noqa: E402
from podbay.bus import Bus, connect_bus  # noqa: E402
from podbay.config import Settings  # noqa: E402
from podbay.devstack import servers as srv  # noqa: E402
from podbay.devstack.simnode import SimFleet, start_control_plane  # noqa: E402
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays  # noqa: E402
from podbay.devstack.procs import free_ports  # noqa: E402

TEMPLATE, DIGEST = "fleet", "sim0"
HOLD_TENANTS = 100


def _varz(monitor_port: int) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{monitor_port}/varz", timeout=5).json())


async def _pg_stats(superuser_dsn: str) -> tuple[dict[str, tuple[int, int, float]], dict[str, int]]:
    """(per statement: (calls, rows, total ms), the database's xact/tuple counters) of the podbay database."""
    conn = await asyncpg.connect(superuser_dsn)
    try:
        stmts = {r["query"]: (int(r["calls"]), int(r["rows"]), float(r["ms"])) for r in await conn.fetch(
            "SELECT query, sum(calls) AS calls, sum(rows) AS rows, sum(total_exec_time) AS ms"
            " FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = 'podbay' GROUP BY query")}
        row = await conn.fetchrow(
            "SELECT xact_commit, tup_returned, tup_fetched, tup_inserted, tup_updated, tup_deleted"
            " FROM pg_stat_database WHERE datname = 'podbay'")
        return stmts, {k: int(v) for k, v in dict(row).items()}
    finally:
        await conn.close()


async def _seed(pool: asyncpg.Pool, fleet: SimFleet, hold: int, memory_mib: int, vcpus: int) -> None:
    """``hold`` running sandboxes over the nodes (round robin) and ``HOLD_TENANTS`` tenants, in bulk."""
    nodes = list(fleet.nodes)
    await pool.execute("INSERT INTO tenants (id, name) SELECT 'hold-' || i, 'hold-' || i"
                       " FROM generate_series(0, $1::int - 1) i ON CONFLICT DO NOTHING", HOLD_TENANTS)
    step = 20000
    for lo in range(0, hold, step):
        n = min(step, hold - lo)
        await pool.execute(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname, node_id, generation, lease_expires_at)"
            " SELECT 'sbx_hold_' || i, 'hold-' || (i % $4::int), $5, $6, 'running', 'running', $7::int, $8::int, 'h',"
            " ($3::text[])[1 + i % cardinality($3::text[])], 1, now() + interval '1 day'"
            " FROM generate_series($1::int, $1::int + $2::int - 1) i", lo, n, nodes, HOLD_TENANTS, TEMPLATE, DIGEST,
            memory_mib, vcpus)
    for i in range(hold):
        fleet.nodes[nodes[i % len(nodes)]].running[f"sbx_hold_{i}"] = (memory_mib, vcpus)
    await pool.execute("ANALYZE sandboxes")


async def _drive(api_url: str, key: str, *, rate_per_min: float, duration_s: float,
                 concurrency: int = 256) -> tuple[list[float], int, float]:
    """Open-loop creates; returns (latencies of the successful ones, ms; failures; wall seconds)."""
    lat: list[float] = []
    failed = 0
    gate = asyncio.Semaphore(concurrency)
    total = max(1, int(rate_per_min * duration_s / 60))
    gap = 60.0 / rate_per_min
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                                 limits=limits) as client:
        async def one() -> None:
            nonlocal failed
            async with gate:
                t = time.perf_counter()
                try:
                    r = await client.post("/v1/sandboxes", json={"template": TEMPLATE})
                except httpx.HTTPError:
                    failed += 1
                    return
                if r.status_code == 201:
                    lat.append((time.perf_counter() - t) * 1000)
                else:
                    failed += 1
                    if failed <= 3:
                        print(f"create answered {r.status_code}: {r.text[:300]}", file=sys.stderr)

        t0 = time.perf_counter()
        tasks = []
        for i in range(total):
            delay = t0 + i * gap - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return lat, failed, time.perf_counter() - t0


async def run(args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    nats_port, monitor_port, pg_port = free_ports(3)
    servers_dir, logs = root / "servers", root / "logs"
    nats = srv.start_nats(servers_dir / "nats", nats_port, log_dir=logs, monitor_port=monitor_port)
    pg = srv.start_postgres(servers_dir / "postgres", pg_port, log_dir=logs, durable=False)
    stack: Stack | None = None
    pool: asyncpg.Pool | None = None
    bus: Bus | None = None
    fleet: SimFleet | None = None
    try:
        conn = await asyncpg.connect(pg.superuser_dsn)
        await conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        await conn.execute("ALTER SYSTEM SET pg_stat_statements.max = 10000")
        await conn.close()
        pg.stop()
        pg = srv.start_postgres(servers_dir / "postgres", pg_port, log_dir=logs, durable=False)
        conn = await asyncpg.connect(pg.superuser_dsn)
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await conn.close()
        env = {**os.environ, "PODBAY_QUOTA_SANDBOXES": "100000000", "PODBAY_QUOTA_VCPUS": "100000000",
               "PODBAY_QUOTA_MEMORY_MIB": str(1 << 30), "PODBAY_NODE_HEARTBEAT_S": str(args.heartbeat_s),
               "PODBAY_NODE_HEARTBEAT_TTL_S": str(args.heartbeat_s * 5), "PODBAY_LOG_LEVEL": "WARNING"}
        stack = Stack(data_dir=root / "stack", log_dir=logs, cache_dir=Settings().cache_dir, ports=StackPorts.free(),
                      external=External(nats_url=nats.url, pg_dsn=pg.dsn), durable=False, base_env=env)
        stack.start_servers()
        pool = await db.connect_pool(pg.dsn, min_size=2, max_size=20)
        await db.migrate(pool)
        await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, $2, 256, 1)"
                           " ON CONFLICT DO NOTHING", TEMPLATE, DIGEST)
        bus = await connect_bus(nats.url, name="fleet-sim", heartbeat_ttl_s=args.heartbeat_s * 5)
        fleet = SimFleet(pool, bus, [f"sim-{i:04d}" for i in range(args.nodes)], templates={TEMPLATE: DIGEST},
                         heartbeat_s=args.heartbeat_s)
        hold = args.hold if args.hold is not None else 100 * args.nodes
        await fleet.register()
        await _seed(pool, fleet, hold, 256, 1)
        await fleet.start()
        start_control_plane(stack)
        key = stack.create_api_key("fleet", "bench")
        # Warm-up (connections, plans), not measured.
        await _drive(stack.api_url, key, rate_per_min=600, duration_s=2, concurrency=8)
        load0 = os.getloadavg()
        v0, (s0, d0) = _varz(monitor_port), await _pg_stats(pg.superuser_dsn)
        n0 = len(fleet.timings)
        lat, failed, wall = await _drive(stack.api_url, key, rate_per_min=args.rate, duration_s=args.duration_s)
        await asyncio.sleep(0.5)
        v1, (s1, d1) = _varz(monitor_port), await _pg_stats(pg.superuser_dsn)
        load1 = os.getloadavg()
        ok = max(1, len(lat))
        timings = list(fleet.timings.values())[n0:]
        calls = {q: s1[q][0] - s0.get(q, (0, 0, 0.0))[0] for q in s1}
        rows = {q: s1[q][1] - s0.get(q, (0, 0, 0.0))[1] for q in s1}
        spent = {q: s1[q][2] - s0.get(q, (0, 0, 0.0))[2] for q in s1}
        # Our own statistics reads are not the fleet's work.
        own = [q for q in calls if "pg_stat_statements" in q or "pg_stat_database" in q]
        for q in own:
            calls.pop(q), rows.pop(q), spent.pop(q)
        top = sorted(calls.items(), key=lambda kv: -kv[1])[:15]
        costly = sorted(spent.items(), key=lambda kv: -kv[1])[:8]
        doubled = sum(1 for runs in fleet.started.values() if len(runs) > 1)
        per_create = {
            "pg_statements": sum(calls.values()) / ok, "pg_rows": sum(rows.values()) / ok,
            "pg_xacts": (d1["xact_commit"] - d0["xact_commit"]) / ok,
            "pg_tup_returned": (d1["tup_returned"] - d0["tup_returned"]) / ok,
            "nats_in_msgs": (v1["in_msgs"] - v0["in_msgs"]) / ok, "nats_out_msgs": (v1["out_msgs"] - v0["out_msgs"]) / ok,
        }
        results: dict[str, dict[str, Any]] = {
            "create_e2e": summarise(lat),
            "placement": summarise([t.placement_ms for t in timings]),
            "placement_queue": summarise([t.to_node_ms for t in timings]),
            **{f"{k}_per_create": {"value": round(v, 2)} for k, v in per_create.items()},
            "creates_per_min_sustained": {"value": round(len(lat) / wall * 60, 1)},
            "throughput": {"value": {
                "nodes": args.nodes, "held_sandboxes": hold, "rate_per_min_asked": args.rate,
                "attempted": len(lat) + failed, "succeeded": len(lat), "failed": failed, "wall_s": round(wall, 1),
                "doubled_starts": doubled, "fenced_commands": fleet.refused,
                "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in load1],
                "heartbeat_s": args.heartbeat_s}},
            "top_statements_per_create": {"value": {q[:160]: round(c / ok, 3) for q, c in top}},
            "costliest_statements_ms_per_create": {"value": {q[:160]: round(ms / ok, 3) for q, ms in costly}},
        }
        return results
    finally:
        # Ours first (also on SIGTERM or an error), while the servers still answer.
        with contextlib.suppress(Exception):
            if fleet is not None:
                await asyncio.wait_for(fleet.stop(), timeout=30)
            if bus is not None:
                await bus.close()
            if pool is not None:
                await pool.close()
        if stack is not None:
            stack.stop(grace_s=5.0)
        pg.stop()
        nats.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--hold", type=int, default=None, help="running sandboxes seeded (default 100 per node)")
    ap.add_argument("--rate", type=float, default=10000, help="creates a minute asked for")
    ap.add_argument("--duration-s", type=float, default=60)
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    stop_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="podbay-fleet-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    try:
        results = asyncio.run(run(args, root))
    finally:
        kill_strays(root / "stack")
        shutil.rmtree(root, ignore_errors=True)
    report(results, args.json)


if __name__ == "__main__":
    main()
