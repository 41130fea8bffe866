"""Scheduler replicas against real PostgreSQL and JetStream: one place command delivered to two schedulers at
once places the sandbox once (one generation bump, one node command), and the load query sees what placement
scores (tenant sandboxes, warm slots, template digest, snapshot node)."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

import pytest

from podbay import db
from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.contracts import subjects
from podbay.contracts.messages import NodeHeartbeat, PlaceSandbox, Resources
from podbay.outbox import Relay
from podbay_scheduler.load import node_loads
from podbay_scheduler.main import Scheduler

pytestmark = pytest.mark.integration


def _hb(node: str, tpl: str) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, dataplane_url="http://127.0.0.1:1", memory_mib=4096, memory_used_mib=0,
                         vcpus=8, vcpus_used=0, sandboxes=0, templates=[tpl], accel="tcg", at=datetime.now(UTC))


async def _seed(pool: object, tag: str, tpl: str, nodes: list[str]) -> str:
    tenant = f"t-{tag}"
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)  # type: ignore[attr-defined]
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)",  # type: ignore[attr-defined]
                       tpl)
    for node in nodes:
        await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES"  # type: ignore[attr-defined]
                           " ($1, 'http://127.0.0.1:1', 4096, 8, 'tcg')", node)
    return tenant


async def _pending(pool: object, tag: str, i: int, tenant: str, tpl: str) -> PlaceSandbox:
    sid, op = f"sbx_{tag}_{i}", f"op_{tag}_{i}"
    await pool.execute(  # type: ignore[attr-defined]
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname) VALUES ($1, $2, $3, 'd', 'pending', 'running', 256, 1, 'h')", sid, tenant, tpl)
    await pool.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"  # type: ignore[attr-defined]
                       " ($1, $2, $3, 'create', 'pending')", op, tenant, sid)
    return PlaceSandbox(operation_id=op, sandbox_id=sid, tenant_id=tenant, template=tpl,
                        resources=Resources(memory_mib=256, vcpus=1))


async def test_one_command_at_two_schedulers_places_once(nats_url: str, pg_dsn: str) -> None:
    tag = os.urandom(3).hex()
    tpl, node = f"rt-{tag}", f"rn-{tag}"
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=6)
    buses = [await connect_bus(nats_url, name=f"sched-{i}", heartbeat_ttl_s=60) for i in range(2)]
    kv = await buses[0].nodes_kv()
    try:
        await db.migrate(pool)
        tenant = await _seed(pool, tag, tpl, [node])
        await kv.put(node, _hb(node, tpl).model_dump_json().encode())
        scheds = [Scheduler(Settings(), pool, bus, Relay(pool, bus)) for bus in buses]
        cmds = [await _pending(pool, tag, i, tenant, tpl) for i in range(5)]
        # Each command handled by both replicas at the same time (a redelivery racing the first delivery).
        done = await asyncio.gather(*(s.handle(c, 0.0) for c in cmds for s in scheds))
        assert all(done)
        for c in cmds:
            row = await pool.fetchrow("SELECT state, node_id, generation FROM sandboxes WHERE id=$1", c.sandbox_id)
            assert (row["state"], row["node_id"], row["generation"]) == ("starting", node, 1)
        # Both replicas published the node command, with the same Nats-Msg-Id: the stream kept one per sandbox.
        info = await buses[0].js.stream_info(subjects.CMD_STREAM, subjects_filter=subjects.node_cmd(node, "create"))
        per_subject = info.state.subjects or {}
        assert per_subject.get(subjects.node_cmd(node, "create")) == len(cmds)
    finally:
        await buses[0].js.purge_stream(subjects.CMD_STREAM, subject=subjects.node_cmd(node, "create"))
        await kv.delete(node)
        for bus in buses:
            await bus.close()
        await pool.close()


async def test_load_query_counts_what_placement_scores(pg_dsn: str) -> None:
    tag = os.urandom(3).hex()
    tpl, a, b = f"lt-{tag}", f"la-{tag}", f"lb-{tag}"
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=2)
    try:
        await db.migrate(pool)
        tenant = await _seed(pool, tag, tpl, [a, b])
        other = f"o-{tag}"
        await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", other)
        rows = [(f"sbx_{tag}_{i}", t, node, state) for i, (t, node, state) in enumerate(
            [(tenant, a, "running"), (tenant, a, "paused"), (other, a, "running"), (tenant, b, "deleted")])]
        await pool.executemany(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname, node_id) VALUES ($1, $2, $5, 'd', $4, 'running', 256, 1, 'h', $3)",
            [(*r, tpl) for r in rows])
        await pool.execute("INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state)"
                           " VALUES ($1, $2, $3, 'd', 128, 1, 'ready')", f"sbx_{tag}_w", b, tpl)
        await pool.execute("INSERT INTO node_templates (node_id, template, digest) VALUES ($1, $2, 'd'), ($3, $2, 'old')",
                           a, tpl, b)
        await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, generation)"
                           " VALUES ($1, $2, $3, $4, 'full', 'ready', 1)", f"snp_{tag}", tenant, f"sbx_{tag}_3", b)
        async with pool.acquire() as conn:
            loads = {n.node_id: n for n in await node_loads(conn, [_hb(a, tpl), _hb(b, tpl)], tenant_id=tenant,
                                                             template=tpl, digest="d", snapshot_id=f"snp_{tag}")}
        la, lb = loads[a], loads[b]
        # a: three live sandboxes (the paused one holds memory but no vCPU), two of them the tenant's.
        assert (la.memory_used_mib, la.vcpus_used, la.tenant_sandboxes) == (768, 2, 2)
        assert (la.warm_ready, la.has_digest, la.holds_snapshot) == (0, True, False)
        # b: the deleted sandbox counts for nothing; the warm slot's memory counts; the old digest does not.
        assert (lb.memory_used_mib, lb.vcpus_used, lb.tenant_sandboxes) == (128, 0, 0)
        assert (lb.warm_ready, lb.has_digest, lb.holds_snapshot) == (1, False, True)
    finally:
        await pool.close()


async def test_concurrent_placements_never_overcommit_a_node(nats_url: str, pg_dsn: str) -> None:
    """Three replicas place 12 sandboxes at once on two nodes with room for 3 each (768 MiB, sandboxes of
    256 MiB): each node's reservation (its advisory lock, then its load read again) lets exactly 3 land on it,
    and the 6 others wait for capacity (asked to be redelivered), none placed on a full node."""
    tag = os.urandom(3).hex()
    tpl, nodes = f"oc-{tag}", [f"oa-{tag}", f"ob-{tag}"]
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=12)
    buses = [await connect_bus(nats_url, name=f"sched-oc-{i}", heartbeat_ttl_s=60) for i in range(3)]
    kv = await buses[0].nodes_kv()
    try:
        await db.migrate(pool)
        tenant = await _seed(pool, tag, tpl, nodes)
        for node in nodes:
            hb = _hb(node, tpl).model_copy(update={"memory_mib": 768})
            await kv.put(node, hb.model_dump_json().encode())
        scheds = [Scheduler(Settings(), pool, bus, Relay(pool, bus)) for bus in buses]
        cmds = [await _pending(pool, tag, i, tenant, tpl) for i in range(12)]
        done = await asyncio.gather(*(scheds[i % 3].handle(c, 0.0) for i, c in enumerate(cmds)))
        per_node = {r["node_id"]: r["n"] for r in await pool.fetch(
            "SELECT node_id, count(*)::int AS n FROM sandboxes WHERE node_id = ANY($1::text[])"
            " AND state = 'starting' GROUP BY node_id", nodes)}
        assert per_node == {nodes[0]: 3, nodes[1]: 3}
        assert sorted(done) == [False] * 6 + [True] * 6
        assert await pool.fetchval("SELECT count(*) FROM sandboxes WHERE tenant_id=$1 AND state='pending'",
                                   tenant) == 6
    finally:
        for node in nodes:
            await buses[0].js.purge_stream(subjects.CMD_STREAM, subject=subjects.node_cmd(node, "create"))
            await kv.delete(node)
        for bus in buses:
            await bus.close()
        await pool.close()


async def test_sandboxes_sharing_a_new_volume_placed_at_once_land_on_its_node(nats_url: str, pg_dsn: str) -> None:
    """Six sandboxes sharing a volume that has no node yet, placed at once by three replicas over four nodes
    with room to spare: the first placement gives the volume its node (its row is locked until commit), and
    every other one runs there too."""
    tag = os.urandom(3).hex()
    tpl, nodes = f"vt-{tag}", [f"vn-{tag}-{i}" for i in range(4)]
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=12)
    buses = [await connect_bus(nats_url, name=f"sched-vol-{i}", heartbeat_ttl_s=60) for i in range(3)]
    kv = await buses[0].nodes_kv()
    try:
        await db.migrate(pool)
        tenant = await _seed(pool, tag, tpl, nodes)
        for node in nodes:
            await kv.put(node, _hb(node, tpl).model_dump_json().encode())
        vol = f"vol_{tag}"
        await pool.execute("INSERT INTO volumes (id, tenant_id, name, size_bytes) VALUES ($1, $2, $1, 1048576)",
                           vol, tenant)
        cmds = [await _pending(pool, tag, i, tenant, tpl) for i in range(6)]
        await pool.executemany("INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly)"
                               " VALUES ($1, $2, 0, '/data', true)", [(c.sandbox_id, vol) for c in cmds])
        scheds = [Scheduler(Settings(), pool, bus, Relay(pool, bus)) for bus in buses]
        assert all(await asyncio.gather(*(scheds[i % 3].handle(c, 0.0) for i, c in enumerate(cmds))))
        where = await pool.fetchval("SELECT node_id FROM volumes WHERE id=$1", vol)
        assert where in nodes
        placed = await pool.fetch("SELECT state, node_id FROM sandboxes WHERE id = ANY($1::text[])",
                                  [c.sandbox_id for c in cmds])
        assert [(r["state"], r["node_id"]) for r in placed] == [("starting", where)] * 6
    finally:
        for node in nodes:
            await buses[0].js.purge_stream(subjects.CMD_STREAM, subject=subjects.node_cmd(node, "create"))
            await kv.delete(node)
        for bus in buses:
            await bus.close()
        await pool.close()
