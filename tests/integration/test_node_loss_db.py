"""Declaring a node lost against a real PostgreSQL (services/scheduler/nodeloss.py :func:`declare_lost`):
two schedulers racing act once; each sandbox is fenced and becomes resuming from its newest promoted full
snapshot, placed again (a create in flight), deleted (a delete in flight) or failed with the reason."""

from __future__ import annotations

import asyncio
import json

import asyncpg

from podbay.outbox import new_id
from podbay_scheduler.nodeloss import declare_lost


async def _node(pool: asyncpg.Pool, state: str = "ready") -> str:
    node = f"n-{new_id('x')[2:14]}"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://x', 4096, 8, 'tcg', $2)", node, state)
    return node


async def _sandbox(pool: asyncpg.Pool, tenant: str, node: str, state: str, op_kind: str = "create") -> str:
    sid = new_id("sbx")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, node_id, generation,"
        " memory_mib, vcpus, hostname) VALUES ($1,$2,'loss-test','d',$3,'running',$4,2,256,1,'h')",
        sid, tenant, state, node)
    await pool.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES ($1,$2,$3,$4,'running')",
                       new_id("op"), tenant, sid, op_kind)
    return sid


async def _snapshot(pool: asyncpg.Pool, tenant: str, sid: str, *, promotion: str, kind: str = "full",
                    age_s: float = 0.0) -> str:
    snap = new_id("snap")
    await pool.execute(
        "INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation, promotion, created_at)"
        " VALUES ($1,$2,$3,$4,'ready',2,$5, now() - make_interval(secs => $6))",
        snap, tenant, sid, kind, promotion, age_s)
    return snap


async def test_two_schedulers_declare_a_node_lost_once_and_every_sandbox_is_fenced(pool: asyncpg.Pool) -> None:
    tenant = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('loss-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    node = await _node(pool)
    with_snap = await _sandbox(pool, tenant, node, "running")
    await _snapshot(pool, tenant, with_snap, promotion="promoted", age_s=120)
    newest = await _snapshot(pool, tenant, with_snap, promotion="promoted", age_s=30)
    await _snapshot(pool, tenant, with_snap, promotion="local", age_s=1)  # newer but only on the lost node
    await _snapshot(pool, tenant, with_snap, promotion="promoted", kind="disk", age_s=2)  # no memory: not used
    no_snap = await _sandbox(pool, tenant, node, "paused")
    creating = await _sandbox(pool, tenant, node, "starting")
    deleting = await _sandbox(pool, tenant, node, "deleting", op_kind="delete")
    suspending = await _sandbox(pool, tenant, node, "suspending", op_kind="suspend")
    suspend_snap = await _snapshot(pool, tenant, suspending, promotion="promoted")

    async def race() -> object:
        async with pool.acquire() as conn, conn.transaction():
            return await declare_lost(conn, node)

    reports = await asyncio.gather(race(), race())
    acted = [r for r in reports if r.acted]  # type: ignore[attr-defined]
    assert len(acted) == 1
    report = acted[0]
    assert (report.rescheduled, report.failed, report.replaced, report.deleted) == (
        [with_snap], [no_snap], [creating], [deleting])
    assert report.suspended == [suspending]
    rows = {r["id"]: r for r in await pool.fetch(
        "SELECT id, state, node_id, generation, suspended_snapshot_id, failure_reason FROM sandboxes"
        " WHERE id = ANY($1::text[])", [with_snap, no_snap, creating, deleting, suspending])}
    assert all(r["node_id"] is None and r["generation"] == 3 for r in rows.values())
    assert rows[with_snap]["state"] == "resuming" and rows[with_snap]["suspended_snapshot_id"] == newest
    assert rows[no_snap]["state"] == "failed" and node in rows[no_snap]["failure_reason"]
    assert "no promoted full snapshot" in rows[no_snap]["failure_reason"]
    assert rows[creating]["state"] == "pending" and rows[deleting]["state"] == "deleted"
    assert rows[suspending]["state"] == "suspended" and rows[suspending]["suspended_snapshot_id"] == suspend_snap
    assert {p.sandbox_id: p.wake for p in report.placements} == {with_snap: True, creating: False}
    assert await pool.fetchval("SELECT state FROM nodes WHERE id=$1", node) == "lost"

    payload = await pool.fetchval("SELECT payload FROM outbox WHERE subject = $1",
                                  f"podbay.evt.sandbox.{with_snap}.rescheduled")
    event = json.loads(payload) if isinstance(payload, str) else payload
    assert event["data"]["lost_node"] == node and event["data"]["snapshot_id"] == newest
    assert 25 <= event["data"]["lost_work_s"] < 600
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE subject = $1",
                               f"podbay.evt.node.{node}.lost") == 1
    # The failed sandbox's operation in flight failed with node_lost.
    assert await pool.fetchval("SELECT error_code FROM operations WHERE sandbox_id=$1", no_snap) == "node_lost"


async def test_only_ready_or_draining_nodes_are_declared_lost(pool: asyncpg.Pool) -> None:
    for state, acts in (("drained", False), ("lost", False), ("draining", True)):
        node = await _node(pool, state)
        async with pool.acquire() as conn, conn.transaction():
            assert (await declare_lost(conn, node)).acted is acts


async def test_a_lost_node_unbinds_its_promoted_volumes_and_fails_sandboxes_writing_one(pool: asyncpg.Pool) -> None:
    tenant = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('loss-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    node = await _node(pool)
    writer = await _sandbox(pool, tenant, node, "running")
    await _snapshot(pool, tenant, writer, promotion="promoted", age_s=30)
    promoted, never = new_id("vol"), new_id("vol")
    for vol, name in ((promoted, "promoted"), (never, "never")):
        await pool.execute("INSERT INTO volumes (id, tenant_id, name, size_bytes, node_id) VALUES ($1,$2,$3,1048576,$4)",
                           vol, tenant, name, node)
    vsnap = new_id("vsnap")
    await pool.execute("INSERT INTO volume_snapshots (id, volume_id, node_id, reason, state, taken_at)"
                       " VALUES ($1,$2,$3,'cadence','promoted',now())", vsnap, promoted, node)
    await pool.execute("UPDATE volumes SET snapshot_id=$2, snapshot_at=now() WHERE id=$1", promoted, vsnap)
    await pool.execute("INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly)"
                       " VALUES ($1,$2,0,'/mnt/data',false)", writer, promoted)

    async with pool.acquire() as conn, conn.transaction():
        report = await declare_lost(conn, node)
    # Its memory holds the volume's mount, which the volume's promoted copy does not match: not woken.
    assert report.failed == [writer] and report.rescheduled == []
    assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", writer) == "failed"
    rows = {r["id"]: r for r in await pool.fetch(
        "SELECT id, node_id, released_at FROM volumes WHERE id = ANY($1::text[])", [promoted, never])}
    assert {v: r["node_id"] for v, r in rows.items()} == {promoted: None, never: node}
    # A file of it left on the node, should the node come back, is older than this: it is fetched anew.
    assert rows[promoted]["released_at"] is not None and rows[never]["released_at"] is None
