"""``podbay.snapshot_state`` against a real PostgreSQL: the schema's CHECKs refuse a state the enums do not
name, and each named statement moves a snapshot only from the states its step leaves."""

from __future__ import annotations

import asyncpg
import pytest

from podbay import snapshot_state
from podbay.contracts.states import PromotionState, SnapshotState
from podbay.outbox import new_id


@pytest.fixture
async def sandbox(pool: asyncpg.Pool) -> tuple[str, str]:
    """(tenant id, sandbox id): a running sandbox of a fresh tenant, on no node."""
    tid, sid = new_id("tnt"), new_id("sbx")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('snapstate-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, lease_s) VALUES ($1,$2,'snapstate-test','d','running','running',1,256,1,"
        " 'h',600)", sid, tid)
    return tid, sid


async def _snap(pool: asyncpg.Pool, sandbox: tuple[str, str], kind: str = "full") -> str:
    snap = new_id("snap")
    await snapshot_state.insert(pool, snap, tenant_id=sandbox[0], sandbox_id=sandbox[1], node_id=None, kind=kind,
                                parent_id=None, generation=1)
    return snap


async def _state(pool: asyncpg.Pool, snap: str) -> tuple[str, str]:
    row = await pool.fetchrow("SELECT state, promotion FROM snapshots WHERE id=$1", snap)
    return row["state"], row["promotion"]


async def test_the_checks_allow_exactly_the_enums_states(pool: asyncpg.Pool, sandbox: tuple[str, str]) -> None:
    snap = await _snap(pool, sandbox)
    for state in SnapshotState:
        await pool.execute("UPDATE snapshots SET state=$2 WHERE id=$1", snap, state.value)
    for promotion in PromotionState:
        await pool.execute("UPDATE snapshots SET promotion=$2 WHERE id=$1", snap, promotion.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE snapshots SET state='taken' WHERE id=$1", snap)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE snapshots SET promotion='uploaded' WHERE id=$1", snap)


async def test_a_snapshot_is_born_creating_and_becomes_ready_once(pool: asyncpg.Pool,
                                                                  sandbox: tuple[str, str]) -> None:
    snap = await _snap(pool, sandbox)
    assert await _state(pool, snap) == ("creating", "local")
    await snapshot_state.mark_ready(pool, snap, size_bytes=10, paused_ms=1.5)
    assert await _state(pool, snap) == ("ready", "local")
    await snapshot_state.fail(pool, snap, "too late")  # ready -> failed is not a step: nothing changes
    assert await _state(pool, snap) == ("ready", "local")
    assert await pool.fetchval("SELECT error FROM snapshots WHERE id=$1", snap) is None


async def test_a_deleted_snapshot_stays_deleted(pool: asyncpg.Pool, sandbox: tuple[str, str]) -> None:
    snap = await _snap(pool, sandbox)
    await snapshot_state.delete(pool, [snap])
    await snapshot_state.mark_ready(pool, snap, size_bytes=10, paused_ms=1.0)  # deleted -> ready is refused
    assert await _state(pool, snap) == ("deleted", "local")


async def test_a_sandboxs_deletion_keeps_its_pinned_promoted_snapshots(pool: asyncpg.Pool,
                                                                      sandbox: tuple[str, str]) -> None:
    kept, local, pinned_local = [await _snap(pool, sandbox) for _ in range(3)]
    for snap in (kept, local, pinned_local):
        await snapshot_state.mark_ready(pool, snap, size_bytes=1, paused_ms=1.0)
    await snapshot_state.pin(pool, kept)
    await snapshot_state.pin(pool, pinned_local)
    assert await snapshot_state.start_promotion(pool, kept, {"files": []}) == kept
    assert await snapshot_state.mark_promoted(pool, kept, uploaded_bytes=1, stored_bytes=1) == kept
    assert await snapshot_state.mark_promoted(pool, kept, uploaded_bytes=1, stored_bytes=1) is None
    await snapshot_state.fail_promotion(pool, kept, "late failure")  # promoted stays promoted
    await snapshot_state.delete_of_deleted_sandbox(pool, sandbox[1])
    assert [await _state(pool, s) for s in (kept, local, pinned_local)] == [
        ("ready", "promoted"), ("deleted", "local"), ("deleted", "local")]


async def test_an_interrupted_snapshot_fails_and_a_suspend_drops_the_local_ones(
        pool: asyncpg.Pool, sandbox: tuple[str, str]) -> None:
    node = "snapstate-node"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:1', 1024, 1, 'tcg', 'drained') ON CONFLICT DO NOTHING", node)
    snap = await _snap(pool, sandbox)
    assert await snapshot_state.move_to_node(pool, snap, node) == "full"
    rows = await snapshot_state.fail_interrupted(pool, node, "interrupted")
    assert [(r["id"], r["sandbox_id"]) for r in rows] == [(snap, sandbox[1])]
    assert await _state(pool, snap) == ("failed", "local")
    assert await snapshot_state.start_promotion(pool, snap, {"files": []}) is None  # only a ready one
    await snapshot_state.delete_local_of_sandbox(pool, sandbox[1])
    assert await _state(pool, snap) == ("deleted", "local")
