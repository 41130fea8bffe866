"""``podbay.operation_state`` against a real PostgreSQL: the schema's CHECK refuses a state the enum does not
name, and each named statement moves an operation only from the states its step leaves."""

from __future__ import annotations

import asyncpg
import pytest

from podbay import operation_state
from podbay.contracts.states import OperationState
from podbay.outbox import new_id


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> str:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    return tid


async def _row(pool: asyncpg.Pool, op: str) -> tuple[str, str | None, bool]:
    r = await pool.fetchrow("SELECT state, error_code, finished_at IS NOT NULL AS done FROM operations WHERE id=$1",
                            op)
    return r["state"], r["error_code"], r["done"]


async def test_the_check_allows_exactly_the_enums_states(pool: asyncpg.Pool, tenant: str) -> None:
    op = new_id("op")
    await operation_state.insert(pool, op, tenant_id=tenant, kind="drain", node_id="n1")
    for state in OperationState:
        await pool.execute("UPDATE operations SET state=$2 WHERE id=$1", op, state.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE operations SET state='cancelled' WHERE id=$1", op)


async def test_an_operation_starts_once_and_a_success_is_final(pool: asyncpg.Pool, tenant: str) -> None:
    op = new_id("op")
    await operation_state.insert(pool, op, tenant_id=tenant, kind="drain")
    assert await _row(pool, op) == ("pending", None, False)
    await operation_state.start(pool, op)
    assert await _row(pool, op) == ("running", None, False)
    await operation_state.succeed(pool, op, data={"moved": 1})
    assert await _row(pool, op) == ("succeeded", None, True)
    await operation_state.start(pool, op)
    await operation_state.fail(pool, op, "drain_incomplete", "too late")
    assert await _row(pool, op) == ("succeeded", None, True)
    assert await pool.fetchval("SELECT data->>'moved' FROM operations WHERE id=$1", op) == "1"


async def test_a_failed_operation_may_still_succeed(pool: asyncpg.Pool, tenant: str) -> None:
    op = new_id("op")
    await operation_state.insert(pool, op, tenant_id=tenant, kind="pause", state=OperationState.RUNNING)
    await operation_state.fail(pool, op, "invalid_state", "not running")
    assert await _row(pool, op) == ("failed", "invalid_state", True)
    await operation_state.succeed(pool, op)  # a redelivered command that went through
    assert (await _row(pool, op))[0] == "succeeded"


async def test_a_finished_operation_is_born_finished(pool: asyncpg.Pool, tenant: str) -> None:
    op = new_id("op")
    await operation_state.insert(pool, op, tenant_id=tenant, kind="delete", state=OperationState.SUCCEEDED,
                                 finished=True)
    assert await _row(pool, op) == ("succeeded", None, True)
