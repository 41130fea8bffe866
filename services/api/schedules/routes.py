"""``/v1/sandboxes/{id}/schedules``: add, list, remove schedules and read their runs.

Validation happens before anything is written; the count against ``PODBAY_SCHEDULES_PER_SANDBOX_MAX`` and the
insert share one transaction with the sandbox row locked, so two concurrent adds cannot both pass the limit.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, Query, Response

from podbay.contracts.schedules import (
    DEFAULT_WAKE_ONLY_AWAKE_S,
    ScheduleCommand,
    ScheduleCreate,
    ScheduleInfo,
    ScheduleList,
    ScheduleRunInfo,
    ScheduleRunList,
)
from podbay.contracts.states import SandboxState
from podbay.errors import InvalidState, LimitExceeded, NotFound
from podbay.outbox import new_id

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services.sandbox_lookup import audit, load_sandbox
from . import queries
from .cron import first_fire

__all__ = ["router", "run_info"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/schedules")
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


def run_info(row: asyncpg.Record | dict[str, Any]) -> ScheduleRunInfo:
    """The API shape of a ``schedule_runs`` row (output columns when selected)."""
    data = dict(row)
    start, end = data.get("started_at"), data.get("finished_at")
    data["duration_ms"] = (end - start).total_seconds() * 1000 if start and end else None
    return ScheduleRunInfo(**data)


def _schedule_info(row: asyncpg.Record, last: asyncpg.Record | None) -> ScheduleInfo:
    data = dict(row)
    data["command"] = ScheduleCommand(**data["command"]) if data["command"] else None
    return ScheduleInfo(**data, last_run=run_info(last) if last is not None else None)


async def _live_sandbox(conn: Any, who: Principal, sandbox_id: str, *, for_update: bool = False) -> asyncpg.Record:
    row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=for_update)
    if row["state"] in (SandboxState.DELETING, SandboxState.DELETED):
        raise InvalidState(f"sandbox {sandbox_id} is {row['state']}", details={"state": row["state"]})
    return row


@router.post("", status_code=201, response_model=ScheduleInfo)
async def add_schedule(sandbox_id: str, body: ScheduleCreate, ctx: CtxDep, who: PrincipalDep) -> ScheduleInfo:
    """Add a schedule: at each fire time the sandbox is woken (from suspended, paused or paused with its RAM
    released), the command runs, and the sandbox goes back to the state it was in.

    Errors, with nothing stored: 400 ``invalid_cron``, ``unknown_time_zone``, ``time_in_past``; 404
    ``not_found`` (no such sandbox of this tenant); 409 ``limit_exceeded`` (``details.limit``); 409
    ``invalid_state`` (the sandbox is deleted); 422 ``validation_error`` (body shape).
    """
    next_at = first_fire(cron=body.cron, tz=body.tz, at=body.at, now=datetime.now(UTC))
    awake_s = body.awake_s if body.awake_s is not None else (0 if body.command else DEFAULT_WAKE_ONLY_AWAKE_S)
    schedule_id = new_id("sch")
    limit = ctx.settings.schedules_per_sandbox_max
    async with ctx.pool.acquire() as conn, conn.transaction():
        await _live_sandbox(conn, who, sandbox_id, for_update=True)
        count = await queries.count_of(conn, sandbox_id)
        if count >= limit:
            raise LimitExceeded(f"sandbox {sandbox_id} has {count} schedules, the most it may have",
                                details={"limit": limit, "setting": "PODBAY_SCHEDULES_PER_SANDBOX_MAX"})
        row = await queries.insert(
            conn, schedule_id, tenant_id=who.tenant_id, sandbox_id=sandbox_id,
            cron=" ".join(body.cron.split()) if body.cron else None, tz=body.tz,
            at=next_at if body.at is not None else None,
            command=body.command.model_dump(exclude_none=True) if body.command else None, awake_s=awake_s,
            overlap=body.overlap, missed=body.missed, next_fire_at=next_at)
        await audit(conn, who, "sandbox.schedule.add", sandbox_id,
                    detail={"schedule_id": schedule_id, "cron": body.cron, "at": next_at.isoformat()
                            if body.at else None, "program": body.command.argv[0][:256] if body.command else None})
    return _schedule_info(row, None)


@router.get("", response_model=ScheduleList)
async def list_schedules(sandbox_id: str, ctx: CtxDep, who: PrincipalDep) -> ScheduleList:
    """The sandbox's schedules, oldest first, each with its next fire time and its newest run."""
    await load_sandbox(ctx.pool, who.tenant_id, sandbox_id)
    rows = await queries.list_of(ctx.pool, who.tenant_id, sandbox_id)
    lasts = await queries.last_runs(ctx.pool, [r["id"] for r in rows])
    return ScheduleList(schedules=[_schedule_info(r, lasts.get(r["id"])) for r in rows])


async def _schedule_row(ctx: ApiContext, who: Principal, sandbox_id: str, schedule_id: str) -> asyncpg.Record:
    await load_sandbox(ctx.pool, who.tenant_id, sandbox_id)
    row = await queries.get(ctx.pool, who.tenant_id, sandbox_id, schedule_id)
    if row is None:
        raise NotFound(f"schedule {schedule_id} of sandbox {sandbox_id} does not exist",
                       details={"schedule_id": schedule_id})
    return row


@router.get("/{schedule_id}", response_model=ScheduleInfo)
async def get_schedule(sandbox_id: str, schedule_id: str, ctx: CtxDep, who: PrincipalDep) -> ScheduleInfo:
    """One schedule with its newest run. 404 ``not_found``."""
    row = await _schedule_row(ctx, who, sandbox_id, schedule_id)
    last = await queries.last_run(ctx.pool, schedule_id)
    return _schedule_info(row, last)


@router.delete("/{schedule_id}", status_code=204)
async def remove_schedule(sandbox_id: str, schedule_id: str, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Remove a schedule and its run history. A run in progress finishes (and puts the sandbox back); no
    further fire happens. 404 ``not_found``."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        await load_sandbox(conn, who.tenant_id, sandbox_id)
        if not await queries.delete(conn, who.tenant_id, sandbox_id, schedule_id):
            raise NotFound(f"schedule {schedule_id} of sandbox {sandbox_id} does not exist",
                           details={"schedule_id": schedule_id})
        await audit(conn, who, "sandbox.schedule.remove", sandbox_id, detail={"schedule_id": schedule_id})
    return Response(status_code=204)


@router.get("/{schedule_id}/runs", response_model=ScheduleRunList)
async def list_runs(sandbox_id: str, schedule_id: str, ctx: CtxDep, who: PrincipalDep,
                    limit: int = Query(20, ge=1, le=1000)) -> ScheduleRunList:
    """The schedule's runs, newest first, with the head and tail of their output. 404 ``not_found``."""
    await _schedule_row(ctx, who, sandbox_id, schedule_id)
    rows = await queries.runs(ctx.pool, schedule_id, limit)
    return ScheduleRunList(runs=[run_info(r) for r in rows])
