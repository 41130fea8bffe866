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

from podbay.contracts.api import (
    ForkRequest,
    ForkResult,
    RestoreRequest,
    SandboxInfo,
    SnapshotCreate,
    SnapshotDiff,
    SnapshotInfo,
    SnapshotList,
)
from podbay.contracts.states import SandboxState
from podbay.errors import Conflict, InvalidState, Unavailable
from podbay.grants import GrantKind

from ..services import snapshot_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..nodes_client import node_url, proxy
from ..core.deps import ctx_dep, principal_dep
from ..services.sandbox_lookup import load_sandbox
from ..services.snapshot_service import ready_snapshot, snapshot_info

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
    rows = await snapshot_service.ready_snapshots(ctx.pool, sandbox_id)
    return SnapshotList(snapshots=[snapshot_info(r) for r in rows])


@router.post("/restore", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def restore_sandbox(sandbox_id: str, body: RestoreRequest, ctx: CtxDep, who: PrincipalDep,
                          response: Response, wait: bool = Query(True)) -> SandboxInfo:
    """Roll back to a snapshot, keeping the id; the generation goes up by one (older calls are fenced off).

    Allowed from ``running``, ``paused`` and ``failed`` (a dead VM comes back from a ready snapshot on its
    node). Errors: 404 ``not_found`` (sandbox or snapshot), 409 ``invalid_state``, 409 ``conflict`` (snapshot
    not ready; or a full snapshot of a sandbox with a read-write volume: services/api/volume_service.py)."""
    info, finished = await snapshot_service.restore(ctx, who, sandbox_id, body, wait=wait)
    if not finished:
        response.status_code = 202
    return info


@router.post("/fork", response_model=ForkResult, responses={202: {"model": ForkResult}})
async def fork_sandbox(sandbox_id: str, body: ForkRequest, ctx: CtxDep, who: PrincipalDep, response: Response,
                       wait: bool = Query(True)) -> ForkResult:
    """Start ``count`` children (1..100) from a new full snapshot or ``snapshot_id`` (a full one)."""
    result, finished = await snapshot_service.fork(ctx, who, sandbox_id, body, wait=wait)
    if not finished:
        response.status_code = 202
    return result


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
        nodes = await snapshot_service.snapshot_nodes(conn, [snapshot_a, snapshot_b])
    if len(nodes) != 1:
        raise Conflict("the two snapshots are on different nodes", details={"nodes": len(nodes)})
    if not nodes[0]["dataplane_url"]:
        raise Unavailable(f"the node holding the snapshots of {sandbox_id} is not known")
    suffix = f"/snapshots/{snapshot_a}/diff/{snapshot_b}"
    return await proxy(ctx, request, node_url(str(nodes[0]["dataplane_url"]), sandbox_id, suffix),
                       int(row["generation"]), method="GET", tenant=who.tenant_id, subject=sandbox_id,
                       kind=GrantKind.DIFF)
