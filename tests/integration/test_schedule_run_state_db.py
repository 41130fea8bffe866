"""``podbay.schedule_run_state`` against a real PostgreSQL: the schema's CHECK refuses a state the enum does not
name, a run is claimed once, finished once by its owner, and a skipped one is born finished."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg
import pytest

from podbay import schedule_run_state
from podbay.contracts.schedules import ScheduleRunState
from podbay.outbox import new_id

FIRE = datetime(2026, 1, 1, tzinfo=UTC)
NO_OUTPUT = dict.fromkeys(schedule_run_state.OUTPUT_COLUMNS)


@pytest.fixture
async def schedule(pool: asyncpg.Pool) -> tuple[str, str, str]:
    """(tenant, sandbox, schedule): a paused sandbox with a cron schedule."""
    tid, sid, sch = new_id("tnt"), new_id("sbx"), new_id("sch")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('runstate-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, lease_s) VALUES ($1,$2,'runstate-test','d','paused','running',1,256,1,"
        " 'h',600)", sid, tid)
    await pool.execute("INSERT INTO schedules (id, tenant_id, sandbox_id, cron) VALUES ($1,$2,$3,'* * * * *')",
                       sch, tid, sid)
    return tid, sid, sch


async def _insert(pool: asyncpg.Pool, s: tuple[str, str, str], state: ScheduleRunState,
                  fire_at: datetime = FIRE) -> str | None:
    return await schedule_run_state.insert(pool, new_id("run"), schedule_id=s[2], sandbox_id=s[1], tenant_id=s[0],
                                           fire_at=fire_at, due_at=fire_at, state=state, reason=None)


async def test_the_check_allows_exactly_the_enums_states(pool: asyncpg.Pool, schedule: tuple[str, str, str]) -> None:
    run = await _insert(pool, schedule, ScheduleRunState.QUEUED)
    for state in ScheduleRunState:
        await pool.execute("UPDATE schedule_runs SET state=$2 WHERE id=$1", run, state.value)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE schedule_runs SET state='paused' WHERE id=$1", run)


async def test_a_run_is_claimed_once_and_finished_once_by_its_owner(pool: asyncpg.Pool,
                                                                   schedule: tuple[str, str, str]) -> None:
    run = await _insert(pool, schedule, ScheduleRunState.QUEUED)
    assert run is not None
    assert await _insert(pool, schedule, ScheduleRunState.QUEUED) is None  # that firing is recorded already
    assert await schedule_run_state.claim(pool, run, "a") == "paused"
    assert await schedule_run_state.claim(pool, run, "b") is None
    assert await schedule_run_state.finish(pool, run, "b", ScheduleRunState.FAILED, reason="x", message=None,
                                           output=NO_OUTPUT, output_key=None) is None
    assert await schedule_run_state.finish(pool, run, "a", ScheduleRunState.SUCCEEDED, reason=None, message=None,
                                           output={**NO_OUTPUT, "exit_code": 0}, output_key=None) == run
    assert await schedule_run_state.finish(pool, run, "a", ScheduleRunState.FAILED, reason="late", message=None,
                                           output=NO_OUTPUT, output_key=None) is None
    row = await pool.fetchrow("SELECT state, exit_code, finished_at IS NOT NULL AS done FROM schedule_runs"
                              " WHERE id=$1", run)
    assert (row["state"], row["exit_code"], row["done"]) == ("succeeded", 0, True)


async def test_a_skipped_run_is_born_finished(pool: asyncpg.Pool, schedule: tuple[str, str, str]) -> None:
    run = await _insert(pool, schedule, ScheduleRunState.SKIPPED, datetime(2026, 1, 2, tzinfo=UTC))
    assert await schedule_run_state.claim(pool, run or "", "a") is None
    row = await pool.fetchrow("SELECT state, finished_at IS NOT NULL AS done FROM schedule_runs WHERE id=$1", run)
    assert (row["state"], row["done"]) == ("skipped", True)
