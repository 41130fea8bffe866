"""``podbay.warm_slot_state`` against a real PostgreSQL: the schema's CHECK refuses a state the enum does not
name, and each named statement moves a slot only from the states its step leaves."""

from __future__ import annotations

import asyncpg
import pytest

from podbay import warm_slot_state
from podbay.contracts.states import WarmSlotState
from podbay.outbox import new_id

NODE = "warmstate-node"


@pytest.fixture
async def node(pool: asyncpg.Pool) -> str:
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('warmstate-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:1', 1024, 1, 'tcg', 'drained') ON CONFLICT DO NOTHING", NODE)
    await pool.execute("DELETE FROM warm_slots WHERE node_id=$1", NODE)
    return NODE


async def _slot(pool: asyncpg.Pool, node: str) -> str:
    sid = new_id("sbx")
    await warm_slot_state.insert(pool, sid, node_id=node, template="warmstate-test", template_digest="d",
                                 memory_mib=256, vcpus=1)
    return sid


async def _state(pool: asyncpg.Pool, slot: str) -> str | None:
    state: str | None = await pool.fetchval("SELECT state FROM warm_slots WHERE id=$1", slot)
    return state


async def test_the_check_allows_exactly_the_enums_states(pool: asyncpg.Pool, node: str) -> None:
    slot = await _slot(pool, node)
    for state in WarmSlotState:
        await pool.execute("UPDATE warm_slots SET state=$2 WHERE id=$1", slot, state.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE warm_slots SET state='warm' WHERE id=$1", slot)


async def test_a_slot_is_born_preparing_and_a_claimed_one_stays(pool: asyncpg.Pool, node: str) -> None:
    slot, failed = await _slot(pool, node), await _slot(pool, node)
    assert await _state(pool, slot) == "preparing"
    await warm_slot_state.end(pool, failed, "prepare: no guest")
    await warm_slot_state.mark_ready(pool, failed)  # failed -> ready is not a step
    assert await _state(pool, failed) == "failed"
    await warm_slot_state.mark_ready(pool, slot)
    assert await _state(pool, slot) == "ready"
    await pool.execute("UPDATE warm_slots SET state='claimed', claimed_at=now() WHERE id=$1", slot)  # the claim
    await warm_slot_state.end(pool, slot, "too late", state=WarmSlotState.RETIRED)
    await warm_slot_state.fail_on_lost_node(pool, node, "lost")
    await warm_slot_state.forget_node(pool, node)
    assert await _state(pool, slot) == "claimed"
    assert await _state(pool, failed) is None


async def test_a_lost_nodes_live_slots_fail(pool: asyncpg.Pool, node: str) -> None:
    preparing, retired = await _slot(pool, node), await _slot(pool, node)
    await warm_slot_state.end(pool, retired, "above target", state=WarmSlotState.RETIRED)
    await warm_slot_state.fail_on_lost_node(pool, node, f"node {node} was lost")
    assert [await _state(pool, s) for s in (preparing, retired)] == ["failed", "retired"]
    await warm_slot_state.prune_absent_nodes(pool, ["some-other-node"])
    assert [await _state(pool, s) for s in (preparing, retired)] == [None, None]
