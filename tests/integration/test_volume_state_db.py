"""``podbay.volume_state`` against a real PostgreSQL: the schema's CHECK refuses a state the enum does not
name, and each named statement moves a volume only from the states its step leaves."""

from __future__ import annotations

import asyncpg
import pytest

from podbay import volume_state
from podbay.contracts.states import VolumeState
from podbay.errors import InvalidState
from podbay.outbox import new_id


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> str:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    return tid


async def _state(pool: asyncpg.Pool, vid: str) -> str | None:
    state: str | None = await pool.fetchval("SELECT state FROM volumes WHERE id=$1", vid)
    return state


async def test_the_check_allows_exactly_the_enums_states(pool: asyncpg.Pool, tenant: str) -> None:
    vid = new_id("vol")
    await volume_state.insert(pool, vid, tenant_id=tenant, name="data", size_bytes=1 << 20)
    for state in VolumeState:
        await pool.execute("UPDATE volumes SET state=$2 WHERE id=$1", vid, state.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE volumes SET state='archived' WHERE id=$1", vid)


async def test_a_volume_is_born_available_or_a_view_and_deleted_once(pool: asyncpg.Pool, tenant: str) -> None:
    vid = new_id("vol")
    row = await volume_state.insert(pool, vid, tenant_id=tenant, name="data", size_bytes=1 << 20,
                                    returning="id, state, node_id")
    assert row is not None and (row["id"], row["state"], row["node_id"]) == (vid, "available", None)
    with pytest.raises(asyncpg.UniqueViolationError):  # the tenant's names are unique among available ones
        await volume_state.insert(pool, new_id("vol"), tenant_id=tenant, name="data", size_bytes=1 << 20)
    with pytest.raises(ValueError):
        await volume_state.insert(pool, new_id("vol"), tenant_id=tenant, name="x", size_bytes=1,
                                  state=VolumeState.DELETING)
    with pytest.raises(InvalidState):
        volume_state.next_state(VolumeState.DELETING, volume_state.VolumeVerb.DELETE)
    await volume_state.mark_deleting(pool, vid)
    assert await _state(pool, vid) == "deleting"
    await volume_state.remove_unplaced(pool, vid)  # (it is unplaced) gone
    assert await _state(pool, vid) is None


async def test_a_placed_volume_goes_after_its_file(pool: asyncpg.Pool, tenant: str) -> None:
    vid = new_id("vol")
    await volume_state.insert(pool, vid, tenant_id=tenant, name="placed", size_bytes=1 << 20, node_id="n1")
    await volume_state.remove_deleted(pool, vid)  # not deleting: stays
    await volume_state.remove_unplaced(pool, vid)  # placed: stays
    assert await _state(pool, vid) == "available"
    await volume_state.mark_deleting(pool, vid)
    await volume_state.remove_deleted(pool, vid)
    assert await _state(pool, vid) is None


async def test_a_view_goes_with_its_deleted_sandbox(pool: asyncpg.Pool, tenant: str) -> None:
    sbx, node = new_id("sbx"), f"vol-{new_id('n')[-8:].lower()}"
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('vol-test', 'd1', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1,'x',1,1,'tcg')",
                       node)
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, node_id) VALUES ($1,$2,'vol-test','d1','running','running',256,1,'h',$3)", sbx, tenant, node)
    vid = new_id("vol")
    await volume_state.insert(pool, vid, tenant_id=tenant, name="v", size_bytes=1 << 20, node_id=node,
                              owner_sandbox_id=sbx, state=VolumeState.VIEW)
    await volume_state.mark_views_of_deleted_sandboxes(pool, node)
    assert await _state(pool, vid) == "view"
    await pool.execute("UPDATE sandboxes SET state='deleted' WHERE id=$1", sbx)
    await volume_state.mark_views_of_deleted_sandboxes(pool, "another-node")
    assert await _state(pool, vid) == "view"
    await volume_state.mark_views_of_deleted_sandboxes(pool, node)
    assert await _state(pool, vid) == "deleting"
