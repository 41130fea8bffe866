"""Sandbox lifecycle endpoints: create, list, get, delete, and operations.

Each state change commits in one transaction with its outbox event (docs/DESIGN.md §4) and then puts a command
on JetStream. Calls wait for completion by default, bounded by ``create_timeout_s``; with ``?wait=false``
they answer 202 at once with ``operation_id`` for ``GET /v1/operations/{id}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, Query, Response

from podbay.audit import record
from podbay.contracts import subjects
from podbay.contracts.api import (
    ErrorBody,
    LeaseUpdate,
    OperationInfo,
    SandboxCreate,
    SandboxInfo,
    SandboxList,
)
from podbay.contracts.messages import DeleteSandboxCmd, PlaceSandbox, Resources, SandboxOpCmd
from podbay.contracts.states import OperationState, SandboxCommand, SandboxState, check_allowed
from podbay.errors import InvalidRequest, InvalidState, NoCapacity, NotFound, SandboxFailed
from podbay.logs import bind_log_context
from podbay.naming import sandbox_hostname
from podbay.outbox import emit_sandbox_event, new_id
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS

from .auth import Principal
from .context import ApiContext
from .credentials import GUEST_ENV_SQL
from .deps import ctx_dep, principal_dep
from .volumes import attach_volumes
from .warm import warm_create

__all__ = ["router", "sandbox_info", "load_sandbox", "audit", "await_operation"]

log = logging.getLogger("podbay.api")
router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

#: OpenAPI: the 503 a create answers when no node has room (or the service is unavailable).
NO_CAPACITY_RESPONSE: dict[str, Any] = {
    "model": ErrorBody,
    "description": "`no_capacity`: no node had room within the scheduler's retry window (the sandbox is `failed`); "
                   "or `unavailable`.",
    "headers": {"Retry-After": {"description": "With `no_capacity`: seconds to wait before trying again.",
                                "schema": {"type": "integer"}}},
}
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

_SANDBOX_COLS = (
    "id, tenant_id, template, state, desired_state, node_id, generation, memory_mib, vcpus, hostname, "
    "failure_reason, metadata, created_at, updated_at, lease_s, lease_expires_at, lease_action"
)


def sandbox_info(row: asyncpg.Record, operation_id: str | None = None) -> SandboxInfo:
    """The API shape of a ``sandboxes`` row."""
    return SandboxInfo(
        id=row["id"],
        template=row["template"],
        state=row["state"],
        desired_state=row["desired_state"],
        node_id=row["node_id"],
        generation=row["generation"],
        memory_mib=row["memory_mib"],
        vcpus=row["vcpus"],
        hostname=row["hostname"],
        failure_reason=row["failure_reason"],
        metadata=row["metadata"] or {},
        lease_s=row["lease_s"],
        lease_expires_at=row["lease_expires_at"],
        on_lease_expiry=row["lease_action"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        operation_id=operation_id,
    )


async def load_sandbox(conn: Any, tenant_id: str, sandbox_id: str, *, for_update: bool = False) -> asyncpg.Record:
    """The tenant's sandbox row, or ``NotFound`` (also for another tenant's sandbox, docs/DESIGN.md §6)."""
    sql = f"SELECT {_SANDBOX_COLS} FROM sandboxes WHERE id = $1 AND tenant_id = $2"
    row = await conn.fetchrow(sql + (" FOR UPDATE" if for_update else ""), sandbox_id, tenant_id)
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} does not exist", details={"sandbox_id": sandbox_id})
    return row


async def _finish(ctx: ApiContext, tenant_id: str, sandbox_id: str, op_id: str,
                  fut: asyncio.Future[dict[str, object]] | None, kind: str, t0: float) -> tuple[SandboxInfo, bool]:
    """Wait for the operation's outcome event (bounded); returns (info, finished)."""
    finished = False
    if fut is not None:
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=ctx.settings.create_timeout_s)
            finished = True
        except TimeoutError:
            fut.cancel()
    row = await load_sandbox(ctx.pool, tenant_id, sandbox_id)
    outcome = "ok" if finished and row["state"] != SandboxState.FAILED else ("timeout" if not finished else "failed")
    LIFECYCLE_OPERATION_SECONDS.labels("api", kind, outcome).observe(time.perf_counter() - t0)
    LIFECYCLE_OPERATIONS.labels("api", kind, outcome).inc()
    return sandbox_info(row, op_id), finished


@router.post("/sandboxes", status_code=201, response_model=SandboxInfo,
             responses={202: {"model": SandboxInfo}, 503: NO_CAPACITY_RESPONSE})
async def create_sandbox(body: SandboxCreate, ctx: CtxDep, who: PrincipalDep, response: Response,
                         wait: bool = Query(True, description="Wait until the sandbox runs (bounded).")) -> SandboxInfo:
    """Create a sandbox from a template: from a warm slot when the template's pool has one ready (a claim
    and a resume), else by restoring the template's snapshot on a node with room.

    Errors: 404 ``not_found`` (unknown template or volume), 400 ``invalid_request`` (resources the template's
    snapshot cannot restore with), 400 ``invalid_volume_path``, 409 ``volume_in_use`` (services/api/volumes.py),
    503 ``no_capacity`` with ``Retry-After`` (no node had room within the scheduler's
    retry window, ``PODBAY_PLACEMENT_RETRY_S``; the sandbox is ``failed``), 500 ``sandbox_failed`` (with the
    reason), 503 ``unavailable``. With ``?wait=false`` the same outcomes show on the operation
    (``error.code``) and the sandbox (``failed``, ``failure_reason``).
    """
    t0 = time.perf_counter()
    # A warm claim looks the template up in its own statement; the checks below answer when it cannot. A warm
    # slot was restored without volumes and its node may not hold them: a create with volumes restores.
    if wait and not body.volumes and (warm := await warm_create(ctx, who, body, t0)) is not None:
        return warm
    tpl = await ctx.pool.fetchrow("SELECT name, digest, memory_mib, vcpus FROM templates"
                                  " WHERE name = $1 AND deleted_at IS NULL", body.template)
    if tpl is None:
        raise NotFound(f"template {body.template!r} does not exist", details={"template": body.template})
    if body.memory_mib is not None and body.memory_mib != tpl["memory_mib"]:
        raise InvalidRequest(
            f"template {body.template!r} is snapshotted with {tpl['memory_mib']} MiB; memory_mib must match",
            details={"template_memory_mib": tpl["memory_mib"]},
        )
    if body.vcpus is not None and body.vcpus != tpl["vcpus"]:
        raise InvalidRequest(
            f"template {body.template!r} is snapshotted with {tpl['vcpus']} vCPUs; vcpus must match",
            details={"template_vcpus": tpl["vcpus"]},
        )
    sandbox_id = new_id("sbx")
    bind_log_context(sandbox_id=sandbox_id)
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    hostname = sandbox_hostname(sandbox_id)
    t_db = time.perf_counter()
    async with ctx.pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
            " hostname, metadata, lease_s, lease_action, lease_expires_at, egress_policy, guest_env)"
            " VALUES ($1,$2,$3,$4,'pending','running',$5,$6,$7,$8,$9,$10, now() + $9::integer * interval '1 second',"
            f" $11, {GUEST_ENV_SQL.format(tenant='$2', sandbox='$1', template='$3')})",
            sandbox_id, who.tenant_id, tpl["name"], tpl["digest"], tpl["memory_mib"], tpl["vcpus"], hostname,
            body.metadata, body.lease_s or ctx.settings.lease_s, body.on_lease_expiry or ctx.settings.lease_action,
            body.network.model_dump(mode="json") if body.network is not None else None,
        )
        await conn.execute(
            "INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES ($1,$2,$3,'create','pending')",
            op_id, who.tenant_id, sandbox_id,
        )
        await emit_sandbox_event(conn, sandbox_id, "created", state="pending", tenant_id=who.tenant_id,
                                 data={"template": tpl["name"], "operation_id": op_id})
        await attach_volumes(conn, who.tenant_id, sandbox_id, body.volumes or [])
        await audit(conn, who, "sandbox.create", sandbox_id,
                    detail={"template": tpl["name"], "network": body.network is not None,
                            **({"volumes": [v.model_dump() for v in body.volumes]} if body.volumes else {})})
    HOP_SECONDS.labels("api", "db").observe(time.perf_counter() - t_db)
    ctx.relay.kick()
    fut = ctx.waiter.expect(sandbox_id, {"started", "failed"}) if wait else None
    t_bus = time.perf_counter()
    await ctx.bus.publish_command(
        subjects.SCHEDULER_PLACE,
        PlaceSandbox(operation_id=op_id, sandbox_id=sandbox_id, tenant_id=who.tenant_id, template=tpl["name"],
                     resources=Resources(memory_mib=tpl["memory_mib"], vcpus=tpl["vcpus"])),
        msg_id=op_id,
    )
    HOP_SECONDS.labels("api", "bus").observe(time.perf_counter() - t_bus)
    info, finished = await _finish(ctx, who.tenant_id, sandbox_id, op_id, fut, "create", t0)
    if info.state == SandboxState.FAILED:
        details: dict[str, Any] = {"sandbox_id": sandbox_id, "operation_id": op_id}
        code = await ctx.pool.fetchval("SELECT error_code FROM operations WHERE id=$1", op_id)
        if code == NoCapacity.code:
            raise NoCapacity(f"no node has room for sandbox {sandbox_id}: {info.failure_reason}",
                             details={**details, "retry_after_s": NoCapacity.DEFAULT_RETRY_AFTER_S})
        raise SandboxFailed(f"sandbox {sandbox_id} failed to start: {info.failure_reason}", details=details)
    if not finished:
        response.status_code = 202
    return info


@router.get("/sandboxes", response_model=SandboxList)
async def list_sandboxes(ctx: CtxDep, who: PrincipalDep,
                         all: bool = Query(False, description="Include deleted sandboxes."),
                         limit: int = Query(100, ge=1, le=1000)) -> SandboxList:
    """The tenant's sandboxes, newest first (deleted ones only with ``all=true``)."""
    sql = f"SELECT {_SANDBOX_COLS} FROM sandboxes WHERE tenant_id = $1"
    if not all:
        sql += " AND state <> 'deleted'"
    rows = await ctx.pool.fetch(sql + " ORDER BY created_at DESC LIMIT $2", who.tenant_id, limit)
    return SandboxList(sandboxes=[sandbox_info(r) for r in rows])


@router.get("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep) -> SandboxInfo:
    """One sandbox. 404 ``not_found`` when it does not exist or belongs to another tenant."""
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def delete_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                         wait: bool = Query(True)) -> SandboxInfo:
    """Stop the sandbox's VM and remove its files; the row stays with state ``deleted``.

    Deleting a deleted sandbox answers 409 ``invalid_state``.
    """
    t0 = time.perf_counter()
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    node_cmd: DeleteSandboxCmd | None = None
    node_id: str | None = None
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.DELETE, row["state"])
        node_id = row["node_id"]
        if node_id is None:
            # Never placed: nothing runs anywhere, so the delete completes here.
            await conn.execute(
                "UPDATE sandboxes SET state='deleted', desired_state='deleted', deleted_at=now(), updated_at=now()"
                " WHERE id=$1", sandbox_id)
            await conn.execute(
                "INSERT INTO operations (id, tenant_id, sandbox_id, kind, state, finished_at)"
                " VALUES ($1,$2,$3,'delete','succeeded',now())", op_id, who.tenant_id, sandbox_id)
            await emit_sandbox_event(conn, sandbox_id, "deleted", state="deleted", tenant_id=who.tenant_id)
            # A suspended sandbox's promoted snapshots go too (their chunks at the next collection), except
            # pinned ones, which outlive it.
            await conn.execute("UPDATE snapshots SET state='deleted' WHERE sandbox_id=$1 AND state <> 'deleted'"
                               " AND NOT (pinned AND promotion = 'promoted')", sandbox_id)
        else:
            await conn.execute(
                "UPDATE sandboxes SET state='deleting', desired_state='deleted', updated_at=now() WHERE id=$1",
                sandbox_id)
            await conn.execute(
                "INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES ($1,$2,$3,'delete','pending')",
                op_id, who.tenant_id, sandbox_id)
            node_cmd = DeleteSandboxCmd(operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"])
        await audit(conn, who, "sandbox.delete", sandbox_id)
    ctx.relay.kick()
    fut = None
    if node_cmd is not None and node_id is not None:
        fut = ctx.waiter.expect(sandbox_id, {"deleted"}) if wait else None
        await ctx.bus.publish_command(subjects.node_cmd(node_id, "delete"), node_cmd, msg_id=op_id)
    info, finished = await _finish(ctx, who.tenant_id, sandbox_id, op_id, fut, "delete", t0)
    if node_cmd is not None and not finished:
        response.status_code = 202
    return info


async def await_operation(ctx: ApiContext, fut: asyncio.Future[dict[str, object]] | None,
                          ) -> tuple[bool, dict[str, object]]:
    """Wait (bounded by ``create_timeout_s``) for an operation notice; returns (finished, notice body)."""
    if fut is None:
        return False, {}
    try:
        return True, await asyncio.wait_for(fut, timeout=ctx.settings.create_timeout_s)
    except TimeoutError:
        return False, {}


async def _node_operation(ctx: ApiContext, who: Principal, sandbox_id: str, command: SandboxCommand,
                          response: Response, wait: bool) -> SandboxInfo:
    """Record an operation for ``command``, send it to the sandbox's node, and (bounded) wait for it."""
    t0 = time.perf_counter()
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(command, row["state"])
        await conn.execute(
            "INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES ($1,$2,$3,$4,'pending')",
            op_id, who.tenant_id, sandbox_id, command.value)
        await conn.execute("UPDATE sandboxes SET lease_expires_at = now() + make_interval(secs => lease_s)"
                           " WHERE id=$1", sandbox_id)
        await audit(conn, who, f"sandbox.{command.value}", sandbox_id)
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(
        subjects.node_cmd(row["node_id"], command.value),
        SandboxOpCmd(operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"]), msg_id=op_id)
    finished, outcome = await await_operation(ctx, fut)
    LIFECYCLE_OPERATION_SECONDS.labels("api", command.value, "ok" if finished else "pending").observe(
        time.perf_counter() - t0)
    if finished and outcome.get("state") == "failed":
        raise InvalidState(f"could not {command.value} sandbox {sandbox_id}: {outcome.get('error')}",
                           details={"operation_id": op_id})
    if not finished:
        response.status_code = 202
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id)


@router.post("/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def pause_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                        wait: bool = Query(True)) -> SandboxInfo:
    """Pause a running sandbox in memory (QMP ``stop``): its vCPUs stop, processes and files stay as they are.

    409 ``invalid_state`` unless it is running.
    """
    return await _node_operation(ctx, who, sandbox_id, SandboxCommand.PAUSE, response, wait)


@router.post("/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def resume_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                         wait: bool = Query(True),
                         fallback: bool = Query(False, description="Suspended only: when its snapshot is corrupt, "
                                                "restore the newest older intact one instead.")) -> SandboxInfo:
    """Resume a paused sandbox (QMP ``cont``) and correct its clock, or wake a suspended one on a node with
    room (services/api/suspend.py). 409 ``invalid_state`` unless paused or suspended; 502
    ``snapshot_corrupt`` when a suspended sandbox's snapshot fails its checksums (it stays suspended)."""
    state = await ctx.pool.fetchval("SELECT state FROM sandboxes WHERE id=$1 AND tenant_id=$2", sandbox_id,
                                    who.tenant_id)
    if state == SandboxState.SUSPENDED:
        from .suspend import resume_suspended

        info, finished = await resume_suspended(ctx, who, sandbox_id, wait=wait, fallback=fallback)
        if not finished:
            response.status_code = 202
        return info
    return await _node_operation(ctx, who, sandbox_id, SandboxCommand.RESUME, response, wait)


@router.post("/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
async def set_timeout(sandbox_id: str, body: LeaseUpdate, ctx: CtxDep, who: PrincipalDep) -> SandboxInfo:
    """Renew the sandbox's lease: it now runs out ``lease_s`` seconds from now (and every later call on the
    sandbox renews it again). When it runs out while the guest is idle, ``on_lease_expiry`` applies."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        if row["state"] in ("deleting", "deleted"):
            raise InvalidState(f"sandbox {sandbox_id} is {row['state']}", details={"state": row["state"]})
        await conn.execute(
            "UPDATE sandboxes SET lease_s=$2, lease_action=COALESCE($3, lease_action),"
            " lease_expires_at = now() + $2::integer * interval '1 second', updated_at=now() WHERE id=$1",
            sandbox_id, body.lease_s, body.on_lease_expiry)
        await audit(conn, who, "sandbox.timeout", sandbox_id)
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id))


@router.get("/operations/{operation_id}", response_model=OperationInfo)
async def get_operation(operation_id: str, ctx: CtxDep, who: PrincipalDep) -> OperationInfo:
    """A lifecycle operation's state and, when it failed, its error."""
    row = await ctx.pool.fetchrow(
        "SELECT id, kind, sandbox_id, state, error_code, error_message, created_at, finished_at, node_id,"
        " progress, data FROM operations WHERE id = $1 AND tenant_id = $2", operation_id, who.tenant_id)
    if row is None:
        raise NotFound(f"operation {operation_id} does not exist")
    err = {"code": row["error_code"], "message": row["error_message"] or ""} if row["error_code"] else None
    return OperationInfo(id=row["id"], kind=row["kind"], sandbox_id=row["sandbox_id"],
                         state=OperationState(row["state"]).value, error=err,
                         created_at=row["created_at"], finished_at=row["finished_at"], node_id=row["node_id"],
                         progress=row["progress"], data=row["data"])


async def audit(conn: Any, who: Principal, action: str, target: str | None, *,
                detail: dict[str, Any] | None = None, sandbox_id: str | None = None) -> None:
    """Append the audit row of a state-changing call (and its event, through the outbox) in ``conn``'s
    transaction: :func:`podbay.audit.record` with the caller's tenant and key. ``sandbox.*`` actions name the
    sandbox in ``sandbox_id`` too, so ``GET /v1/audit?sandbox_id=`` finds them."""
    if sandbox_id is None and action.startswith("sandbox."):
        sandbox_id = target
    await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action=action, target=target,
                 sandbox_id=sandbox_id, detail=detail)
