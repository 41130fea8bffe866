"""Sandboxes left waiting for a node, against a real PostgreSQL (services/scheduler/pending.py): the sweep
ends those past the bound (a create fails with the reason, its operation and an event; a wake goes back to
suspended), leaves fresh ones and rows a placement holds alone, and two sweeps at once end each sandbox once."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest

from podbay.outbox import new_id
from podbay_scheduler.pending import PLACEMENT_TIMEOUT, fail_unplaced, sweep_unplaced

TIMEOUT_S = 300.0  # far above the age of any other test's rows in the shared database


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> str:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('sweep-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    return tid


async def _waiting(pool: asyncpg.Pool, tenant: str, *, state: str = "pending", age_s: float = 600.0,
                   kind: str = "create") -> tuple[str, str]:
    sid, op = new_id("sbx"), new_id("op")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, updated_at) VALUES ($1,$2,'sweep-test','d',$3,'running',1,256,1,'h',"
        " now() - make_interval(secs => $4))", sid, tenant, state, age_s)
    await pool.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES ($1,$2,$3,$4,"
                       "'pending')", op, tenant, sid, kind)
    return sid, op


async def _events(pool: asyncpg.Pool, sid: str) -> list[dict[str, object]]:
    rows = await pool.fetch("SELECT payload FROM outbox WHERE subject LIKE $1 ORDER BY id",
                            f"podbay.evt.sandbox.{sid}.%")
    return [dict(r["payload"]) for r in rows]


async def test_a_stranded_create_fails_with_reason_operation_and_event_and_a_fresh_one_is_kept(
        pool: asyncpg.Pool, tenant: str) -> None:
    old, old_op = await _waiting(pool, tenant)
    fresh, fresh_op = await _waiting(pool, tenant, age_s=1)
    ended = await sweep_unplaced(pool, timeout_s=TIMEOUT_S)
    assert old in ended and fresh not in ended
    row = await pool.fetchrow("SELECT state, failure_reason FROM sandboxes WHERE id=$1", old)
    assert row["state"] == "failed" and "not placed within 300 s" in row["failure_reason"]
    op = await pool.fetchrow("SELECT state, error_code, error_message, finished_at FROM operations WHERE id=$1",
                             old_op)
    assert (op["state"], op["error_code"]) == ("failed", PLACEMENT_TIMEOUT)
    assert op["error_message"] == row["failure_reason"] and op["finished_at"] is not None
    (event,) = await _events(pool, old)
    assert event["type"] == "failed" and event["state"] == "failed" and event["reason"] == row["failure_reason"]
    assert event["data"]["operation_id"] == old_op and event["data"]["code"] == PLACEMENT_TIMEOUT
    assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", fresh) == "pending"
    assert await pool.fetchval("SELECT state FROM operations WHERE id=$1", fresh_op) == "pending"
    assert await _events(pool, fresh) == []


async def test_a_stranded_wake_goes_back_to_suspended(pool: asyncpg.Pool, tenant: str) -> None:
    sid, op = await _waiting(pool, tenant, state="resuming", kind="resume")
    assert sid in await sweep_unplaced(pool, timeout_s=TIMEOUT_S)
    assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "suspended"
    assert await pool.fetchval("SELECT error_code FROM operations WHERE id=$1", op) == PLACEMENT_TIMEOUT
    (event,) = await _events(pool, sid)
    assert event["type"] == "suspended" and str(event["reason"]).startswith("resume failed: not resumed within")


async def test_a_row_a_placement_holds_is_skipped(pool: asyncpg.Pool, tenant: str) -> None:
    sid, _ = await _waiting(pool, tenant)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM sandboxes WHERE id=$1 FOR UPDATE", sid)  # as the place handler does
        assert sid not in await sweep_unplaced(pool, timeout_s=TIMEOUT_S)
    assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "pending"
    assert sid in await sweep_unplaced(pool, timeout_s=TIMEOUT_S)


async def test_two_sweeps_at_once_end_each_sandbox_once(pool: asyncpg.Pool, tenant: str) -> None:
    mine = {(await _waiting(pool, tenant))[0] for _ in range(6)}
    a, b = await asyncio.gather(sweep_unplaced(pool, timeout_s=TIMEOUT_S), sweep_unplaced(pool, timeout_s=TIMEOUT_S))
    assert mine <= set(a) | set(b) and not set(a) & set(b)
    for sid in mine:
        assert [e["type"] for e in await _events(pool, sid)] == ["failed"]


async def test_the_failure_is_fenced_by_state_and_generation(pool: asyncpg.Pool, tenant: str) -> None:
    sid, op = await _waiting(pool, tenant)
    async with pool.acquire() as conn, conn.transaction():
        # Placed meanwhile (generation 2): a failure decided on generation 1 changes nothing.
        await conn.execute("UPDATE sandboxes SET generation=2 WHERE id=$1", sid)
        assert not await fail_unplaced(conn, sandbox_id=sid, operation_id=op, tenant_id=tenant, generation=1,
                                       code="no_capacity", reason="full")
    assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "pending"
    assert await pool.fetchval("SELECT state FROM operations WHERE id=$1", op) == "pending"
    async with pool.acquire() as conn, conn.transaction():
        assert await fail_unplaced(conn, sandbox_id=sid, operation_id=op, tenant_id=tenant, generation=2,
                                   code="no_capacity", reason="no node has room for 256 MiB")
    row = await pool.fetchrow("SELECT state, failure_reason FROM sandboxes WHERE id=$1", sid)
    assert (row["state"], row["failure_reason"]) == ("failed", "no node has room for 256 MiB")
    assert await pool.fetchval("SELECT error_code FROM operations WHERE id=$1", op) == "no_capacity"


async def test_no_room_is_retried_within_the_window_then_fails_with_no_capacity(
        pool: asyncpg.Pool, tenant: str, nats_url: str) -> None:
    from podbay.bus import connect_bus
    from podbay.config import Settings
    from podbay.contracts.messages import NodeHeartbeat, PlaceSandbox, Resources
    from podbay.outbox import Relay
    from podbay_scheduler.main import Scheduler

    node = f"full-{new_id('n')[2:10]}"
    bus = await connect_bus(nats_url, name="no-capacity-test", heartbeat_ttl_s=60)
    kv = await bus.nodes_kv()
    try:
        await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES"
                           " ($1, 'http://127.0.0.1:1', 128, 8, 'tcg')", node)  # less than one sandbox
        hb = NodeHeartbeat(node_id=node, dataplane_url="http://127.0.0.1:1", memory_mib=128, memory_used_mib=0,
                           vcpus=8, vcpus_used=0, sandboxes=0, templates=["sweep-test"], accel="tcg",
                           at=datetime.now(UTC))
        await kv.put(node, hb.model_dump_json().encode())
        sched = Scheduler(Settings(placement_retry_s=15.0), pool, bus, Relay(pool, bus))

        def place(sid: str, op: str) -> PlaceSandbox:
            return PlaceSandbox(operation_id=op, sandbox_id=sid, tenant_id=tenant, template="sweep-test",
                                resources=Resources(memory_mib=256, vcpus=1))

        sid, op = await _waiting(pool, tenant, age_s=0)
        assert await sched.handle(place(sid, op), 3.0) is False  # within the window: retried
        assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "pending"
        assert await sched.handle(place(sid, op), 15.5) is True  # past it: failed
        row = await pool.fetchrow("SELECT state, failure_reason FROM sandboxes WHERE id=$1", sid)
        assert row["state"] == "failed" and "no node has room" in row["failure_reason"]
        assert await pool.fetchval("SELECT error_code FROM operations WHERE id=$1", op) == "no_capacity"
        assert [(e["type"], e["reason"]) for e in await _events(pool, sid)] == [("failed", row["failure_reason"])]
        # The last delivery JetStream allows fails at once, inside the window too.
        sid2, op2 = await _waiting(pool, tenant, age_s=0)
        assert await sched.handle(place(sid2, op2), 1.0, last_try=True) is True
        assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid2) == "failed"
    finally:
        await kv.delete(node)
        await bus.close()
