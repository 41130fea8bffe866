"""``podbay.build_state`` against a real PostgreSQL: the schema's CHECKs refuse a state the enums do not name,
and each named statement moves a build only from the states its step leaves."""

from __future__ import annotations

import asyncpg
import pytest

from podbay import build_state
from podbay.contracts.states import E2BBuildState
from podbay.contracts.templates import BuildState
from podbay.errors import InvalidState
from podbay.outbox import new_id


async def _build(pool: asyncpg.Pool) -> str:
    bid = new_id("bld")
    await build_state.insert_build(pool, bid, name=f"t-{bid}", alias=f"t-{bid}", tenant_id="tnt_x", node_id="n1",
                                   dockerfile="FROM base", parent="base", egress_policy=None, owner_tenant=None)
    return bid


async def _state(pool: asyncpg.Pool, table: str, bid: str) -> tuple[str, bool]:
    r = await pool.fetchrow(f"SELECT state, finished_at IS NOT NULL AS done FROM {table} WHERE id=$1", bid)
    return r["state"], r["done"]


async def test_the_checks_allow_exactly_the_enums_states(pool: asyncpg.Pool) -> None:
    bid = await _build(pool)
    for state in BuildState:
        await pool.execute("UPDATE template_builds SET state=$2 WHERE id=$1", bid, state.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE template_builds SET state='cancelled' WHERE id=$1", bid)
    eid = new_id("bld")
    await build_state.insert_e2b_build(pool, eid, template="t", tenant_id="tnt_x", cpu_count=None, memory_mb=None)
    for e2b in E2BBuildState:
        await pool.execute("UPDATE e2b_template_builds SET state=$2 WHERE id=$1", eid, e2b.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE e2b_template_builds SET state='failed' WHERE id=$1", eid)


async def test_a_build_ends_once(pool: asyncpg.Pool) -> None:
    bid = await _build(pool)
    assert await _state(pool, "template_builds", bid) == ("running", False)
    assert await build_state.finish_build(pool, bid, BuildState.SUCCEEDED, "sha256:1", None) == "UPDATE 1"
    assert await _state(pool, "template_builds", bid) == ("succeeded", True)
    assert not await build_state.fail_build(pool, bid, {"code": "interrupted", "message": "late"})
    await build_state.fail_interrupted_builds(pool, "n1", {"code": "interrupted", "message": "restart"})
    assert await _state(pool, "template_builds", bid) == ("succeeded", True)
    with pytest.raises(InvalidState):  # not an outcome: refused before any SQL
        await build_state.finish_build(pool, bid, BuildState.RUNNING, None, None)


async def test_a_restart_fails_only_its_nodes_running_builds(pool: asyncpg.Pool) -> None:
    bid = await _build(pool)
    await build_state.fail_interrupted_builds(pool, "n2", {"code": "interrupted", "message": "restart"})
    assert await _state(pool, "template_builds", bid) == ("running", False)
    await build_state.fail_interrupted_builds(pool, "n1", {"code": "interrupted", "message": "restart"})
    assert await _state(pool, "template_builds", bid) == ("failed", True)
    assert await pool.fetchval("SELECT error->>'code' FROM template_builds WHERE id=$1", bid) == "interrupted"


async def test_an_e2b_build_starts_once_and_ends_once(pool: asyncpg.Pool) -> None:
    eid = new_id("bld")
    await build_state.insert_e2b_build(pool, eid, template="t", tenant_id="tnt_x", cpu_count=2, memory_mb=1024)
    assert await _state(pool, "e2b_template_builds", eid) == ("waiting", False)
    await build_state.finish_e2b_build(pool, eid)  # not building yet: refused by the fence
    assert await _state(pool, "e2b_template_builds", eid) == ("waiting", False)
    await build_state.fail_e2b_build(pool, eid, {"message": "no"}, building_only=True)
    assert await _state(pool, "e2b_template_builds", eid) == ("waiting", False)
    await build_state.start_e2b_build(pool, eid, "bld_pb", [1, 2])
    assert await _state(pool, "e2b_template_builds", eid) == ("building", False)
    await build_state.start_e2b_build(pool, eid, "bld_other", [3])  # started already: stays as it is
    assert await pool.fetchval("SELECT podbay_build_id FROM e2b_template_builds WHERE id=$1", eid) == "bld_pb"
    await build_state.finish_e2b_build(pool, eid)
    assert await _state(pool, "e2b_template_builds", eid) == ("ready", True)
    await build_state.fail_e2b_build(pool, eid, {"message": "late"})
    assert await _state(pool, "e2b_template_builds", eid) == ("ready", True)
