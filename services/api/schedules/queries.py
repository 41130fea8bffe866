"""The named queries of the ``schedules`` table and the reads of ``schedule_runs`` that
``/v1/sandboxes/{id}/schedules`` (services/api/schedules/routes.py) makes. A run's state changes go through
``podbay.schedule_run_state``; a schedule removed here takes its runs with it (the foreign key cascades).

Every function takes a connection or a pool (``conn``): inside the caller's transaction when it passes one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg

__all__ = ["SCHEDULE_COLS", "RUN_META", "RUN_COLS", "count_of", "insert", "list_of", "get", "delete",
           "last_runs", "last_run", "runs"]

#: The columns of a schedule the API shows (``podbay.contracts.schedules.ScheduleInfo`` but ``last_run``).
SCHEDULE_COLS = "id, sandbox_id, cron, tz, at, command, awake_s, overlap, missed, next_fire_at, created_at"
#: The columns of a run without its output (``ScheduleRunInfo`` but ``duration_ms`` and the output heads and tails).
RUN_META = ("id, schedule_id, sandbox_id, fire_at, due_at, state, reason, message, prior_state, started_at,"
            " awake_at, command_started_at, finished_at, exit_code, stdout_bytes, stderr_bytes, output_key")
#: :data:`RUN_META` with the heads and tails of the run's output.
RUN_COLS = RUN_META + ", stdout_head, stdout_tail, stderr_head, stderr_tail"


async def count_of(conn: Any, sandbox_id: str) -> int:
    """How many schedules the sandbox has."""
    return int(await conn.fetchval("SELECT count(*) FROM schedules WHERE sandbox_id=$1", sandbox_id))


async def insert(conn: Any, schedule_id: str, *, tenant_id: str, sandbox_id: str, cron: str | None, tz: str | None,
                 at: datetime | None, command: dict[str, Any] | None, awake_s: int, overlap: str, missed: str,
                 next_fire_at: datetime) -> asyncpg.Record:
    """Write schedule ``schedule_id``; its row (:data:`SCHEDULE_COLS`)."""
    row: asyncpg.Record = await conn.fetchrow(
        "INSERT INTO schedules (id, tenant_id, sandbox_id, cron, tz, at, command, awake_s, overlap, missed,"
        f" next_fire_at) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11) RETURNING {SCHEDULE_COLS}",
        schedule_id, tenant_id, sandbox_id, cron, tz, at, command, awake_s, overlap, missed, next_fire_at)
    return row


async def list_of(conn: Any, tenant_id: str, sandbox_id: str) -> list[asyncpg.Record]:
    """The tenant's schedules of the sandbox (:data:`SCHEDULE_COLS`), oldest first."""
    return list(await conn.fetch(
        f"SELECT {SCHEDULE_COLS} FROM schedules WHERE sandbox_id=$1 AND tenant_id=$2 ORDER BY created_at, id",
        sandbox_id, tenant_id))


async def get(conn: Any, tenant_id: str, sandbox_id: str, schedule_id: str) -> asyncpg.Record | None:
    """The tenant's schedule ``schedule_id`` of the sandbox (:data:`SCHEDULE_COLS`), or None."""
    row: asyncpg.Record | None = await conn.fetchrow(
        f"SELECT {SCHEDULE_COLS} FROM schedules WHERE id=$1 AND sandbox_id=$2 AND tenant_id=$3",
        schedule_id, sandbox_id, tenant_id)
    return row


async def delete(conn: Any, tenant_id: str, sandbox_id: str, schedule_id: str) -> bool:
    """Remove the tenant's schedule ``schedule_id`` of the sandbox (and its runs); False when there was none."""
    gone = await conn.fetchval("DELETE FROM schedules WHERE id=$1 AND sandbox_id=$2 AND tenant_id=$3"
                               " RETURNING id", schedule_id, sandbox_id, tenant_id)
    return gone is not None


async def last_runs(conn: Any, schedule_ids: list[str]) -> dict[str, asyncpg.Record]:
    """The newest run (:data:`RUN_META`) of each of the schedules that has one, by schedule id."""
    return {r["schedule_id"]: r for r in await conn.fetch(
        f"SELECT DISTINCT ON (schedule_id) {RUN_META} FROM schedule_runs WHERE schedule_id = ANY($1::text[])"
        " ORDER BY schedule_id, fire_at DESC", schedule_ids)}


async def last_run(conn: Any, schedule_id: str) -> asyncpg.Record | None:
    """The schedule's newest run (:data:`RUN_META`), or None."""
    row: asyncpg.Record | None = await conn.fetchrow(
        f"SELECT {RUN_META} FROM schedule_runs WHERE schedule_id=$1 ORDER BY fire_at DESC LIMIT 1", schedule_id)
    return row


async def runs(conn: Any, schedule_id: str, limit: int) -> list[asyncpg.Record]:
    """The schedule's newest ``limit`` runs (:data:`RUN_COLS`), newest first."""
    return list(await conn.fetch(
        f"SELECT {RUN_COLS} FROM schedule_runs WHERE schedule_id=$1 ORDER BY fire_at DESC LIMIT $2",
        schedule_id, limit))
