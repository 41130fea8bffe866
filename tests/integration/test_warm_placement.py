"""The warm-pool service's pass against real PostgreSQL and NATS: targets follow demand within the pool's
bounds and each node's memory, changed nodes are kicked, and slot rows of a node that is gone are dropped."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

import pytest

from podbay import db
from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.contracts import subjects
from podbay.contracts.messages import NodeHeartbeat
from podbay_warmpool.main import reconcile_targets

pytestmark = pytest.mark.integration


async def test_targets_follow_demand_within_bounds_and_memory(nats_url: str, pg_dsn: str) -> None:
    tag = os.urandom(3).hex()
    tpl, node_a, node_b, gone = f"wt-{tag}", f"wa-{tag}", f"wb-{tag}", f"wg-{tag}"
    settings = Settings(warm_demand_window_s=60, warm_demand_horizon_s=10)
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=2)
    bus = await connect_bus(nats_url, name="warm-targets-test", heartbeat_ttl_s=60)
    kicks: list[str] = []

    async def kicked(msg: object) -> None:
        kicks.append(msg.subject)  # type: ignore[attr-defined]

    sub = await bus.nc.subscribe(subjects.warm_kick(node_a), cb=kicked)
    kv = await bus.nodes_kv()
    try:
        await db.migrate(pool)
        await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", f"t-{tag}")
        await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)", tpl)
        for node, mem in ((node_a, 4096), (node_b, 512), (gone, 4096)):
            await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES"
                               " ($1, 'http://127.0.0.1:1', $2, 8, 'tcg')", node, mem)
            if node != gone:
                hb = NodeHeartbeat(node_id=node, dataplane_url="http://127.0.0.1:1", memory_mib=mem, memory_used_mib=0,
                                   vcpus=8, vcpus_used=0, sandboxes=0, templates=[tpl], accel="tcg",
                                   at=datetime.now(UTC))
                await kv.put(node, hb.model_dump_json().encode())
        await pool.execute("INSERT INTO warm_pools (template, min_size, max_size) VALUES ($1, 2, 10)", tpl)
        await pool.execute("INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state)"
                           " VALUES ($1, $2, $3, 'd', 256, 1, 'ready')", f"sbx_{tag}", gone, tpl)

        targets = await reconcile_targets(settings, pool, bus)
        assert (targets[(tpl, node_a)], targets[(tpl, node_b)]) == (1, 1)  # the floor, spread evenly
        assert (tpl, gone) not in targets
        # The gone node's slot can no longer be claimed.
        assert await pool.fetchval("SELECT count(*) FROM warm_slots WHERE node_id=$1", gone) == 0

        # 30 creates in the last minute = 0.5/s; 10 s of that is 5 slots; node b's memory holds 2 of them.
        await pool.executemany(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname) VALUES ($1, $2, $3, 'd', 'deleted', 'deleted', 256, 1, 'h')",
            [(f"sbx_{tag}_{i}", f"t-{tag}", tpl) for i in range(30)])
        targets = await reconcile_targets(settings, pool, bus)
        assert (targets[(tpl, node_a)], targets[(tpl, node_b)]) == (3, 2)
        rows = await pool.fetch("SELECT node_id, target FROM warm_targets WHERE template=$1 ORDER BY node_id", tpl)
        assert [(r["node_id"], r["target"]) for r in rows] == [(node_a, 3), (node_b, 2)]

        # Demand above the pool's max is cut to it.
        await pool.executemany(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname) VALUES ($1, $2, $3, 'd', 'deleted', 'deleted', 256, 1, 'h')",
            [(f"sbx_{tag}_x{i}", f"t-{tag}", tpl) for i in range(300)])
        targets = await reconcile_targets(settings, pool, bus)
        assert targets[(tpl, node_a)] + targets[(tpl, node_b)] == 10 and targets[(tpl, node_b)] == 2

        await bus.nc.flush()
        for _ in range(100):
            if kicks:
                break
            await asyncio.sleep(0.02)
        assert kicks and set(kicks) == {subjects.warm_kick(node_a)}
    finally:
        await sub.unsubscribe()
        for node in (node_a, node_b):
            try:
                await kv.delete(node)
            except Exception:
                pass
        await pool.execute("DELETE FROM warm_pools WHERE template=$1", tpl)
        await pool.execute("DELETE FROM warm_targets WHERE template=$1", tpl)
        await bus.close()
        await pool.close()


async def test_the_scheduler_counts_warm_slots_against_node_memory(nats_url: str, pg_dsn: str) -> None:
    from podbay.contracts.messages import PlaceSandbox, Resources
    from podbay.outbox import Relay
    from podbay_scheduler.main import Scheduler

    tag = os.urandom(3).hex()
    tpl, node, sid = f"st-{tag}", f"sn-{tag}", f"sbx_s{tag}"
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=2)
    bus = await connect_bus(nats_url, name="warm-scheduler-test", heartbeat_ttl_s=60)
    kv = await bus.nodes_kv()
    try:
        await db.migrate(pool)
        await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", f"t-{tag}")
        await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)", tpl)
        await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES"
                           " ($1, 'http://127.0.0.1:1', 512, 8, 'tcg')", node)
        hb = NodeHeartbeat(node_id=node, dataplane_url="http://127.0.0.1:1", memory_mib=512, memory_used_mib=0,
                           vcpus=8, vcpus_used=0, sandboxes=0, templates=[tpl], accel="tcg", at=datetime.now(UTC))
        await kv.put(node, hb.model_dump_json().encode())
        # Two waiting slots fill the node's 512 MiB.
        for i in range(2):
            await pool.execute("INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus,"
                               " state) VALUES ($1, $2, $3, 'd', 256, 1, 'ready')", f"sbx_w{tag}{i}", node, tpl)
        await pool.execute(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname) VALUES ($1, $2, $3, 'd', 'pending', 'running', 256, 1, 'h')", sid, f"t-{tag}", tpl)
        await pool.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"
                           " ($1, $2, $3, 'create', 'pending')", f"op_{tag}", f"t-{tag}", sid)
        sched = Scheduler(Settings(), pool, bus, Relay(pool, bus))
        cmd = PlaceSandbox(operation_id=f"op_{tag}", sandbox_id=sid, tenant_id=f"t-{tag}", template=tpl,
                           resources=Resources(memory_mib=256, vcpus=1))
        assert await sched.handle(cmd, 0.0) is False  # no room: asks to be retried
        assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "pending"
        # A claimed slot is a sandbox now and no longer counts as a slot; this one simply goes away.
        await pool.execute("DELETE FROM warm_slots WHERE id=$1", f"sbx_w{tag}0")
        assert await sched.handle(cmd, 0.0) is True
        row = await pool.fetchrow("SELECT state, node_id FROM sandboxes WHERE id=$1", sid)
        assert (row["state"], row["node_id"]) == ("starting", node)
    finally:
        try:
            await kv.delete(node)
        except Exception:
            pass
        await pool.execute("DELETE FROM warm_slots WHERE node_id=$1", node)
        await bus.close()
        await pool.close()
