"""``podbay.lifecycle`` against a real PostgreSQL: a transition is fenced by state, generation and node; when it
applies, its operation, event and audit record commit with it in that order; when the fence refuses, nothing
but an ``always`` operation outcome is written; leases are set, extended only when asked, and renewed."""

from __future__ import annotations


import asyncpg
import pytest

from podbay import lifecycle
from podbay.contracts.states import OperationState, SandboxState
from podbay.errors import InvalidState
from podbay.lifecycle import AuditRecord, NewOperation, OperationOutcome, SandboxEvent, Verb
from podbay.outbox import new_id


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> str:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('lifecycle-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    for node in ("lifecycle-a", "lifecycle-b"):  # drained: no placement test takes them
        await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                           " ($1, 'http://127.0.0.1:1', 1024, 1, 'tcg', 'drained') ON CONFLICT DO NOTHING", node)
    return tid


async def _sandbox(pool: asyncpg.Pool, tenant: str, state: str, node: str | None = None) -> str:
    sid = new_id("sbx")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, node_id, lease_s) VALUES ($1,$2,'lifecycle-test','d',$3,'running',3,256,1,"
        " 'h',$4,600)", sid, tenant, state, node)
    return sid


async def test_an_applied_transition_writes_the_row_operation_event_and_audit(pool: asyncpg.Pool,
                                                                             tenant: str) -> None:
    sid, op, snap = await _sandbox(pool, tenant, "running"), new_id("op"), new_id("snap")
    await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation)"
                       " VALUES ($1,$2,$3,'full','creating',3)", snap, tenant, sid)
    async with pool.acquire() as conn, conn.transaction():
        row = await lifecycle.apply(
            conn, sid, Verb.SUSPEND, states=SandboxState.RUNNING, generation=3,
            values={"suspended_snapshot_id": snap}, operation=NewOperation(op, tenant, "suspend"),
            event=SandboxEvent("suspending", tenant_id=tenant, generation=3, data={"operation_id": op}),
            audit=AuditRecord(tenant, "key_1", "sandbox.suspend"))
    assert row is not None and row["state"] == "suspending" and row["generation"] == 3
    got = await pool.fetchrow("SELECT state, suspended_snapshot_id, event_seq FROM sandboxes WHERE id=$1", sid)
    assert (got["state"], got["suspended_snapshot_id"], got["event_seq"]) == ("suspending", snap, 1)
    assert await pool.fetchval("SELECT kind || ':' || state FROM operations WHERE id=$1", op) == "suspend:pending"
    subjects = [r["subject"] for r in await pool.fetch(
        "SELECT subject FROM outbox WHERE payload->>'sandbox_id' = $1 ORDER BY id", sid)]
    assert subjects == [f"podbay.evt.sandbox.{sid}.suspending", f"podbay.evt.audit.{tenant}.sandbox.suspend"]
    assert await pool.fetchval("SELECT actor FROM audit_log WHERE sandbox_id=$1", sid) == "key_1"


async def test_a_refused_fence_writes_nothing_but_an_always_outcome(pool: asyncpg.Pool, tenant: str) -> None:
    sid = await _sandbox(pool, tenant, "running", node="lifecycle-a")
    op, op2 = new_id("op"), new_id("op")
    for o in (op, op2):
        await pool.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"
                           " ($1,$2,$3,'pause','pending')", o, tenant, sid)
    async with pool.acquire() as conn, conn.transaction():
        stale = await lifecycle.apply(
            conn, sid, Verb.PAUSE, states="running", generation=2,
            operation=OperationOutcome(op, OperationState.SUCCEEDED, always=True), event=SandboxEvent("paused"))
        other_node = await lifecycle.apply(
            conn, sid, Verb.FAIL, states=["running"], generation=3, node="lifecycle-b", values={"failure_reason": "x"},
            operation=OperationOutcome(op2, OperationState.FAILED, error_code="sandbox_failed"),
            event=SandboxEvent("failed"))
    assert stale is None and other_node is None
    assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "running"
    assert await pool.fetchval("SELECT state FROM operations WHERE id=$1", op) == "succeeded"
    assert await pool.fetchval("SELECT state FROM operations WHERE id=$1", op2) == "pending"
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE payload->>'sandbox_id' = $1", sid) == 0


async def test_a_node_move_keeps_the_state_and_a_verb_in_the_wrong_state_is_refused(pool: asyncpg.Pool,
                                                                                     tenant: str) -> None:
    sid = await _sandbox(pool, tenant, "paused", node="lifecycle-a")
    async with pool.acquire() as conn, conn.transaction():
        row = await lifecycle.apply(conn, sid, Verb.MOVE, states=lifecycle.sources(Verb.MOVE), generation=3,
                                    node="lifecycle-a", set_node="lifecycle-b", new_generation=4)
        assert row is not None and (row["state"], row["node_id"], row["generation"]) == ("paused", "lifecycle-b", 4)
        with pytest.raises(InvalidState):
            await lifecycle.apply(conn, sid, Verb.PAUSE, states="paused")


async def test_leases_are_set_extended_only_when_asked_and_renewed(pool: asyncpg.Pool, tenant: str) -> None:
    sid = await _sandbox(pool, tenant, "running")

    async def left_s() -> float:
        return float(await pool.fetchval("SELECT extract(epoch FROM lease_expires_at - now()) FROM sandboxes"
                                         " WHERE id=$1", sid))

    assert await lifecycle.set_lease(pool, sid, 3600, action="delete")
    assert 3000 < await left_s() <= 3600
    assert await pool.fetchval("SELECT lease_action FROM sandboxes WHERE id=$1", sid) == "delete"
    assert not await lifecycle.set_lease(pool, sid, 60, only_extend=True)  # ends later already: kept
    assert 3000 < await left_s()
    assert await lifecycle.set_lease(pool, sid, 60)
    assert await left_s() <= 60
    await lifecycle.renew_lease(pool, sid)  # its whole length again: 60 s
    assert 0 < await left_s() <= 60
    await lifecycle.expire_lease(pool, sid, "pause")
    assert await left_s() <= 0
    assert await pool.fetchval("SELECT lease_action FROM sandboxes WHERE id=$1", sid) == "pause"


async def test_a_finished_operation_is_recorded_with_its_end_and_deleted_sets_deleted_at(pool: asyncpg.Pool,
                                                                                        tenant: str) -> None:
    sid, op = await _sandbox(pool, tenant, "pending"), new_id("op")
    async with pool.acquire() as conn, conn.transaction():
        row = await lifecycle.apply(
            conn, sid, Verb.DELETED, states="pending", node=None, values={"desired_state": "deleted"},
            operation=NewOperation(op, tenant, "delete", OperationState.SUCCEEDED, finished=True),
            event=SandboxEvent("deleted", tenant_id=tenant))
    assert row is not None
    got = await pool.fetchrow("SELECT state, desired_state, deleted_at FROM sandboxes WHERE id=$1", sid)
    assert (got["state"], got["desired_state"]) == ("deleted", "deleted") and got["deleted_at"] is not None
    assert await pool.fetchval("SELECT state || ':' || (finished_at IS NOT NULL) FROM operations WHERE id=$1",
                               op) == "succeeded:true"
