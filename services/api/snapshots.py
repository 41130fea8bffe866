"""Snapshots, rollback and fork (docs/DESIGN.md §5).

- ``POST /v1/sandboxes/{id}/snapshots`` {"kind": "disk"|"full"} takes a snapshot on the sandbox's node;
  ``GET`` lists the ready ones (kind, time, size, parent). A snapshot is listed only once complete.
- ``POST /v1/sandboxes/{id}/restore`` {"snapshot_id"} rolls the sandbox back (memory and disk for a full
  snapshot; the disk and a fresh boot for a disk one), keeping its id and bumping its generation.
- ``POST /v1/sandboxes/{id}/fork`` {"count", "snapshot_id"?} starts children from a new full snapshot (or
  the named one); each child gets fresh randomness, clock, hostname and identity; the answer lists each
  child's outcome, and a child that fails does not fail the others.
Each call records an operation and waits (bounded) for the node's ``podbay.ops.<id>`` notice.
- ``GET /v1/sandboxes/{id}/snapshots/{a}/diff/{b}`` lists the files added, changed and removed from
  snapshot ``a`` to ``b``; the node holding them computes it (no operation, nothing changes).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from podbay.contracts import subjects
from podbay.contracts.api import (
    ForkChildResult,
    ForkRequest,
    ForkResult,
    RestoreRequest,
    SandboxInfo,
    SnapshotCreate,
    SnapshotDiff,
    SnapshotInfo,
    SnapshotList,
)
from podbay.contracts.messages import ForkChild, ForkCmd
from podbay.contracts.states import SandboxCommand, SandboxState, check_allowed
from podbay.errors import Conflict, InvalidRequest, InvalidState, Unavailable
from podbay.logs import bind_log_context
from podbay.naming import sandbox_hostname
from podbay.outbox import emit_sandbox_event, new_id

from . import snapshot_service
from .auth import Principal
from .context import ApiContext
from .dataplane import _node_url, _proxy
from .deps import ctx_dep, principal_dep
from .schedules.routes import copy_schedules
from .sandbox_lookup import GUEST_ENV_SQL, audit, await_operation, load_sandbox
from .snapshot_service import SNAPSHOT_COLS, latest_ready, ready_snapshot, snapshot_info
from .volumes import fork_volumes

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

@router.post("/snapshots", status_code=201, response_model=SnapshotInfo, responses={202: {"model": SnapshotInfo}})
async def create_snapshot(sandbox_id: str, body: SnapshotCreate, ctx: CtxDep, who: PrincipalDep, response: Response,
                          wait: bool = Query(True)) -> SnapshotInfo:
    """Take a disk or full snapshot now. 409 ``invalid_state`` unless running or paused."""
    info, finished = await snapshot_service.take(ctx, who, sandbox_id, body, wait=wait)
    if not finished:
        response.status_code = 202
    return info


@router.get("/snapshots", response_model=SnapshotList)
async def list_snapshots(sandbox_id: str, ctx: CtxDep, who: PrincipalDep) -> SnapshotList:
    """The sandbox's complete snapshots, newest first (kind, time, size, parent)."""
    await load_sandbox(ctx.pool, who.tenant_id, sandbox_id)
    rows = await ctx.pool.fetch(
        f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE sandbox_id=$1 AND state='ready' ORDER BY created_at DESC",
        sandbox_id)
    return SnapshotList(snapshots=[snapshot_info(r) for r in rows])


@router.post("/restore", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def restore_sandbox(sandbox_id: str, body: RestoreRequest, ctx: CtxDep, who: PrincipalDep,
                          response: Response, wait: bool = Query(True)) -> SandboxInfo:
    """Roll back to a snapshot, keeping the id; the generation goes up by one (older calls are fenced off).

    Allowed from ``running``, ``paused`` and ``failed`` (a dead VM comes back from a ready snapshot on its
    node). Errors: 404 ``not_found`` (sandbox or snapshot), 409 ``invalid_state``, 409 ``conflict`` (snapshot
    not ready; or a full snapshot of a sandbox with a read-write volume: services/api/volumes.py)."""
    info, finished = await snapshot_service.restore(ctx, who, sandbox_id, body, wait=wait)
    if not finished:
        response.status_code = 202
    return info


@router.post("/fork", response_model=ForkResult, responses={202: {"model": ForkResult}})
async def fork_sandbox(sandbox_id: str, body: ForkRequest, ctx: CtxDep, who: PrincipalDep, response: Response,
                       wait: bool = Query(True)) -> ForkResult:
    """Start ``count`` children (1..100) from a new full snapshot or ``snapshot_id`` (a full one)."""
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    children = [new_id("sbx") for _ in range(body.count)]
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.FORK, row["state"])
        take = body.snapshot_id is None
        if body.snapshot_id is not None:
            snap = await ready_snapshot(conn, sandbox_id, body.snapshot_id)
            if snap["kind"] != "full":
                raise InvalidRequest("fork needs a full snapshot (memory and disk)", details={"kind": snap["kind"]})
            snap_id = body.snapshot_id
        else:
            snap_id = new_id("snap")
            await conn.execute(
                "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, parent_id, generation)"
                " VALUES ($1,$2,$3,$4,'full','creating',$5,$6)", snap_id, who.tenant_id, sandbox_id, row["node_id"],
                await latest_ready(conn, sandbox_id), row["generation"])
        tpl = await conn.fetchval("SELECT template_digest FROM sandboxes WHERE id=$1", sandbox_id)
        for cid in children:
            await conn.execute(
                # A child inherits the parent's own egress policy; its credential placeholders are those in
                # scope for it now (scoped by its own id and template), never copied from the parent.
                "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, node_id,"
                " generation, memory_mib, vcpus, hostname, metadata, parent_sandbox_id, source_snapshot_id,"
                " egress_policy, guest_env)"
                " VALUES ($1,$2,$3,$4,'starting','running',$5,1,$6,$7,$8,$9,$10,$11,"
                " (SELECT egress_policy FROM sandboxes WHERE id=$10), "
                + GUEST_ENV_SQL.format(tenant="$2", sandbox="$1", template="$3") + ")",
                cid, who.tenant_id, row["template"], tpl, row["node_id"], row["memory_mib"], row["vcpus"],
                sandbox_hostname(cid), row["metadata"] or {}, sandbox_id, snap_id)
            await emit_sandbox_event(conn, cid, "created", state="starting", tenant_id=who.tenant_id,
                                     data={"parent": sandbox_id, "snapshot_id": snap_id, "operation_id": op_id})
        await fork_volumes(conn, who.tenant_id, sandbox_id, children, snap_id, body.volumes)
        if body.schedules:  # asked for: each child gets its own copies (own ids, own run history)
            await copy_schedules(conn, sandbox_id, children)
        await conn.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"
                           " ($1,$2,$3,'fork','pending')", op_id, who.tenant_id, sandbox_id)
        await audit(conn, who, "sandbox.fork", sandbox_id, detail={"children": children, "snapshot_id": snap_id})
    ctx.relay.kick()
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(subjects.node_cmd(row["node_id"], "fork"), ForkCmd(
        operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"], snapshot_id=snap_id,
        take_snapshot=take, children=[ForkChild(sandbox_id=c, hostname=sandbox_hostname(c)) for c in children]),
        msg_id=op_id)
    finished, _ = await await_operation(ctx, fut)
    if not finished:
        response.status_code = 202
    rows = {r["id"]: r for r in await ctx.pool.fetch(
        "SELECT id, state, failure_reason FROM sandboxes WHERE id = ANY($1::text[])", children)}
    return ForkResult(snapshot_id=snap_id, operation_id=op_id, children=[
        ForkChildResult(sandbox_id=c, state=rows[c]["state"], failure_reason=rows[c]["failure_reason"])
        for c in children])


@router.get("/snapshots/{snapshot_a}/diff/{snapshot_b}", response_model=SnapshotDiff)
async def diff_snapshots(sandbox_id: str, snapshot_a: str, snapshot_b: str, request: Request, ctx: CtxDep,
                         who: PrincipalDep) -> Response:
    """Files added, changed and removed from snapshot ``a`` to ``b`` (disk or full, both of this sandbox).

    Paths are as the guest sees them, sorted, at most 100,000 (``truncated`` then says so; the totals
    count everything). 404 ``not_found`` for an unknown sandbox or snapshot, 409 when a snapshot is not
    ready or the sandbox is deleted, 504 ``timeout`` when the node needs more than 120 s.
    """
    async with ctx.pool.acquire() as conn:
        row = await load_sandbox(conn, who.tenant_id, sandbox_id)
        if row["state"] == SandboxState.DELETED:
            raise InvalidState(f"sandbox {sandbox_id} is deleted", details={"state": row["state"]})
        for snap_id in (snapshot_a, snapshot_b):
            await ready_snapshot(conn, sandbox_id, snap_id)
        # Snapshot files stay on the node that took them: ask that node, not the sandbox's current one.
        nodes = await conn.fetch(
            "SELECT DISTINCT s.node_id, n.dataplane_url FROM snapshots s LEFT JOIN nodes n ON n.id = s.node_id"
            " WHERE s.id = ANY($1::text[])", [snapshot_a, snapshot_b])
    if len(nodes) != 1:
        raise Conflict("the two snapshots are on different nodes", details={"nodes": len(nodes)})
    if not nodes[0]["dataplane_url"]:
        raise Unavailable(f"the node holding the snapshots of {sandbox_id} is not known")
    suffix = f"/snapshots/{snapshot_a}/diff/{snapshot_b}"
    return await _proxy(ctx, request, _node_url(str(nodes[0]["dataplane_url"]), sandbox_id, suffix),
                        int(row["generation"]), method="GET")
