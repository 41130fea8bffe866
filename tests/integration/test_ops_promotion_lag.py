"""``podbay_snapshot_promotion_lag_seconds``: per node, the largest age of a live sandbox's newest promoted
snapshot (or of the sandbox itself when it has none), measured by the snapshotter from PostgreSQL."""

from __future__ import annotations


import asyncpg
import pytest

from podbay.outbox import new_id
from podbay.telemetry import PROMOTION_LAG_SECONDS
from podbay_snapshotter.main import measure_promotion_lag

pytestmark = pytest.mark.integration


async def _sandbox(pool: asyncpg.Pool, tenant: str, node: str, *, state: str, age_s: int) -> str:
    sid = new_id("sbx")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, node_id, created_at) VALUES ($1,$2,'lag-test','d',$3,'running',256,1,'h',$4,"
        " now() - make_interval(secs => $5))", sid, tenant, state, node, age_s)
    return sid


async def _snapshot(pool: asyncpg.Pool, tenant: str, sid: str, *, promotion: str, age_s: int) -> None:
    await pool.execute(
        "INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation, promotion, created_at)"
        " VALUES ($1,$2,$3,'full','ready',1,$4, now() - make_interval(secs => $5))",
        new_id("snap"), tenant, sid, promotion, age_s)


async def test_lag_is_the_oldest_newest_promoted_snapshot_of_a_live_sandbox(pool: asyncpg.Pool) -> None:
    tenant, node = new_id("tnt"), f"lag-{new_id('n')[-8:].lower()}"
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('lag-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1,'x',1,1,'tcg')",
                       node)
    assert await measure_promotion_lag(pool, node) == 0.0  # nothing on the node: nothing to lose

    a = await _sandbox(pool, tenant, node, state="running", age_s=7200)
    await _snapshot(pool, tenant, a, promotion="promoted", age_s=3000)
    await _snapshot(pool, tenant, a, promotion="promoted", age_s=600)  # the newest promoted one counts
    await _snapshot(pool, tenant, a, promotion="local", age_s=10)  # not in S3 yet: does not count
    lag = await measure_promotion_lag(pool, node)
    assert 600 <= lag < 3000
    assert PROMOTION_LAG_SECONDS._value.get() == lag  # noqa: SLF001 - the exported gauge

    await _sandbox(pool, tenant, node, state="paused", age_s=5000)  # never promoted: its whole life
    assert 5000 <= await measure_promotion_lag(pool, node) < 7200
    await _sandbox(pool, tenant, node, state="deleted", age_s=90000)  # gone: nothing to lose
    assert await measure_promotion_lag(pool, node) < 7200
