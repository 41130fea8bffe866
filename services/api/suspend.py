"""Suspend to object storage and resume anywhere (docs/DESIGN.md §5; docs/ARCHITECTURE.md "Suspend and resume").

- ``POST /v1/sandboxes/{id}/suspend`` (running or paused): in one transaction insert the full snapshot row
  (``creating``), set the sandbox ``suspending`` with that snapshot, record the operation and emit
  ``suspending``; then send ``podbay.cmd.node.<node>.suspend`` and wait (bounded by ``suspend_timeout_s``)
  for the node's notice. The node snapshots, has the snapshotter promote, and frees the VM; a failed
  promotion leaves the sandbox ``paused`` with the error on the operation (409 ``suspend_failed``).
- ``POST /v1/sandboxes/{id}/resume`` of a suspended sandbox (:func:`resume_suspended`): set ``resuming``
  and ask the scheduler to place it (``PlaceSandbox`` with ``wake``); the chosen node fetches, verifies and
  restores it. A corrupt snapshot answers 502 ``snapshot_corrupt`` and the sandbox stays ``suspended``;
  ``?fallback=true`` restores the newest older intact promoted full snapshot instead.
- Exec and file calls with ``?auto_resume=true`` on a suspended (or paused) sandbox resume it first
  (:func:`auto_resume`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from podbay.contracts import subjects
from podbay.contracts.api import SandboxInfo
from podbay.contracts.messages import PlaceSandbox, Resources, SandboxOpCmd
from podbay.contracts.states import SandboxCommand, SandboxState, check_allowed
from podbay.errors import (
    InvalidState,
    NoCapacity,
    NotFound,
    PodbayError,
    SandboxFailed,
    SnapshotCorrupt,
    SuspendFailed,
    Unavailable,
)
from podbay.faults import fault_point
from podbay.logs import bind_log_context
from podbay.outbox import emit_sandbox_event, new_id
from podbay.telemetry import LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS

from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep, principal_dep
from .sandboxes import audit, load_sandbox, sandbox_info

__all__ = ["router", "resume_suspended", "auto_resume", "republish_unfinished"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


async def _wait(fut: asyncio.Future[dict[str, object]] | None, timeout_s: float) -> bool:
    if fut is None:
        return False
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_s)
        return True
    except TimeoutError:
        fut.cancel()
        return False


async def _op_error(ctx: ApiContext, op_id: str) -> tuple[str | None, str | None]:
    row = await ctx.pool.fetchrow("SELECT state, error_code, error_message FROM operations WHERE id=$1", op_id)
    if row is None or row["state"] != "failed":
        return None, None
    return row["error_code"], row["error_message"]


@router.post("/suspend", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def suspend_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                          wait: bool = Query(True, description="Wait until suspended (bounded).")) -> SandboxInfo:
    """Suspend a running or paused sandbox to object storage: a full snapshot is taken and promoted, then
    the VM and the node's files are freed (state ``suspended``; it costs no node resources).

    Errors: 409 ``invalid_state`` unless running or paused; 409 ``suspend_failed`` (the promotion failed:
    the sandbox is ``paused`` and intact; ``details.operation_id``). 202 with ``operation_id`` when
    ``wait=false`` or the bound ran out.
    """
    t0 = time.perf_counter()
    op_id, snap_id = new_id("op"), new_id("snap")
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.SUSPEND, row["state"])
        parent = await conn.fetchval("SELECT id FROM snapshots WHERE sandbox_id=$1 AND state='ready'"
                                     " ORDER BY created_at DESC LIMIT 1", sandbox_id)
        await conn.execute(
            "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, parent_id, generation)"
            " VALUES ($1,$2,$3,$4,'full','creating',$5,$6)", snap_id, who.tenant_id, sandbox_id, row["node_id"],
            parent, row["generation"])
        await conn.execute("UPDATE sandboxes SET state='suspending', suspended_snapshot_id=$2, updated_at=now()"
                           " WHERE id=$1", sandbox_id, snap_id)
        await conn.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"
                           " ($1,$2,$3,'suspend','pending')", op_id, who.tenant_id, sandbox_id)
        await emit_sandbox_event(conn, sandbox_id, "suspending", state="suspending", tenant_id=who.tenant_id,
                                 node_id=row["node_id"], generation=row["generation"],
                                 data={"operation_id": op_id, "snapshot_id": snap_id})
        await audit(conn, who, "sandbox.suspend", sandbox_id)
    ctx.relay.kick()
    fault_point("suspend.recorded")
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(subjects.node_cmd(row["node_id"], "suspend"),
                                  SandboxOpCmd(operation_id=op_id, sandbox_id=sandbox_id,
                                               generation=row["generation"]), msg_id=op_id)
    finished = await _wait(fut, ctx.settings.suspend_timeout_s)
    LIFECYCLE_OPERATION_SECONDS.labels("api", "suspend", "ok" if finished else "pending").observe(
        time.perf_counter() - t0)
    if finished:
        code, message = await _op_error(ctx, op_id)
        if code is not None:
            LIFECYCLE_OPERATIONS.labels("api", "suspend", "failed").inc()
            raise SuspendFailed(f"could not suspend sandbox {sandbox_id}: {message}",
                                 details={"operation_id": op_id, "snapshot_id": snap_id})
    else:
        response.status_code = 202
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id)


async def resume_suspended(ctx: ApiContext, who: Principal, sandbox_id: str, *, wait: bool, fallback: bool,
                           ) -> tuple[SandboxInfo, bool]:
    """Wake a suspended sandbox on a node with room; returns (info, finished within the bound).

    Raises ``InvalidState`` (not suspended), ``SnapshotCorrupt`` (502; it stays suspended),
    ``NoCapacity`` (no node has room; it stays suspended), ``SandboxFailed`` (the restore failed)."""
    t0 = time.perf_counter()
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        if row["state"] != SandboxState.SUSPENDED:
            raise InvalidState(f"sandbox {sandbox_id} is {row['state']}, not suspended",
                               details={"state": row["state"]})
        tpl = await conn.fetchval("SELECT template FROM sandboxes WHERE id=$1", sandbox_id)
        await conn.execute("UPDATE sandboxes SET state='resuming', updated_at=now(),"
                           " lease_expires_at = now() + make_interval(secs => lease_s) WHERE id=$1", sandbox_id)
        await conn.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"
                           " ($1,$2,$3,'resume','pending')", op_id, who.tenant_id, sandbox_id)
        await emit_sandbox_event(conn, sandbox_id, "resuming", state="resuming", tenant_id=who.tenant_id,
                                 data={"operation_id": op_id, "fallback": fallback})
        await audit(conn, who, "sandbox.resume", sandbox_id)
    ctx.relay.kick()
    fault_point("resume.recorded")
    fut = ctx.waiter.expect(sandbox_id, {"resumed", "suspended", "failed"}) if wait else None
    await ctx.bus.publish_command(subjects.SCHEDULER_PLACE, PlaceSandbox(
        operation_id=op_id, sandbox_id=sandbox_id, tenant_id=who.tenant_id, template=tpl,
        resources=Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"]), wake=True, fallback=fallback),
        msg_id=op_id)
    finished = await _wait(fut, ctx.settings.suspend_timeout_s)
    LIFECYCLE_OPERATION_SECONDS.labels("api", "resume_from_s3", "ok" if finished else "pending").observe(
        time.perf_counter() - t0)
    info = sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id)
    if finished:
        code, message = await _op_error(ctx, op_id)
        details = {"operation_id": op_id}
        if code == "snapshot_corrupt":
            raise SnapshotCorrupt(f"cannot resume sandbox {sandbox_id}: {message}", details=details)
        if code == NoCapacity.code:
            raise NoCapacity(f"cannot resume sandbox {sandbox_id}: {message}",
                             details={**details, "retry_after_s": NoCapacity.DEFAULT_RETRY_AFTER_S})
        if info.state == SandboxState.FAILED:
            raise SandboxFailed(f"sandbox {sandbox_id} failed to resume: {info.failure_reason}", details=details)
        if code is not None:
            raise PodbayError(f"cannot resume sandbox {sandbox_id}: {message}", details={**details, "code": code})
    return info, finished


async def auto_resume(ctx: ApiContext, who: Principal, sandbox_id: str) -> None:
    """Resume a suspended or paused sandbox before a data-plane call that asked for it (``auto_resume``)."""
    row = await ctx.pool.fetchrow("SELECT state, node_id, generation FROM sandboxes WHERE id=$1 AND tenant_id=$2",
                                  sandbox_id, who.tenant_id)
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} does not exist", details={"sandbox_id": sandbox_id})
    if row["state"] == SandboxState.SUSPENDED:
        _, finished = await resume_suspended(ctx, who, sandbox_id, wait=True, fallback=False)
        if not finished:
            raise Unavailable(f"sandbox {sandbox_id} is still resuming; retry shortly", details={"retryable": True})
    elif row["state"] == SandboxState.PAUSED:
        from .sandboxes import resume_sandbox

        await resume_sandbox(sandbox_id, ctx, who, Response(), wait=True, fallback=False)


async def republish_unfinished(ctx: ApiContext) -> int:
    """At start-up: publish again the command of each suspend or resume that an API which died between its
    commit and its publish left without one (the same ``Nats-Msg-Id``, so a command that did go out is
    dropped as a duplicate or found done by its idempotent handler). Returns how many."""
    rows = await ctx.pool.fetch(
        "SELECT s.id, s.state, s.node_id, s.generation, s.tenant_id, s.template, s.memory_mib, s.vcpus, o.id AS op_id"
        " FROM sandboxes s JOIN LATERAL (SELECT id FROM operations WHERE sandbox_id = s.id AND kind IN"
        " ('suspend', 'resume') AND state IN ('pending', 'running') ORDER BY created_at DESC LIMIT 1) o ON true"
        " WHERE s.state = 'suspending' OR (s.state = 'resuming' AND s.node_id IS NULL)")
    for r in rows:
        if r["state"] == "suspending" and r["node_id"]:
            await ctx.bus.publish_command(subjects.node_cmd(r["node_id"], "suspend"), SandboxOpCmd(
                operation_id=r["op_id"], sandbox_id=r["id"], generation=r["generation"]), msg_id=r["op_id"])
        elif r["state"] == "resuming":
            await ctx.bus.publish_command(subjects.SCHEDULER_PLACE, PlaceSandbox(
                operation_id=r["op_id"], sandbox_id=r["id"], tenant_id=r["tenant_id"], template=r["template"],
                resources=Resources(memory_mib=r["memory_mib"], vcpus=r["vcpus"]), wake=True), msg_id=r["op_id"])
    return len(rows)
