"""Volume endpoints (``/v1/volumes``): thin routes over volume_service.py, which says what a volume is, how
it is attached, restored and deleted, and which errors each call raises.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from podbay.contracts.volumes import VolumeCreate, VolumeInfo, VolumeList, VolumeRestore, VolumeSnapshotList

from ..services import volume_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep

__all__ = ["router"]

router = APIRouter(prefix="/v1")
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.post("/volumes", status_code=201, response_model=VolumeInfo)
async def create_volume(body: VolumeCreate, ctx: CtxDep, who: PrincipalDep) -> VolumeInfo:
    """Create a named volume of ``size_bytes`` (its file is made on the node of its first sandbox).
    Errors: 400 ``volume_too_large``, 409 ``conflict`` (the tenant has a volume of that name)."""
    return await volume_service.create_volume(ctx, who, body)


@router.get("/volumes", response_model=VolumeList)
async def list_volumes(ctx: CtxDep, who: PrincipalDep) -> VolumeList:
    """The tenant's volumes, by name, with their attachments."""
    return await volume_service.list_volumes(ctx, who)


@router.get("/volumes/{name}", response_model=VolumeInfo)
async def get_volume(name: str, ctx: CtxDep, who: PrincipalDep) -> VolumeInfo:
    """One volume by name. Errors: 404 ``not_found`` (also another tenant's)."""
    return await volume_service.get_volume(ctx, who, name)


@router.get("/volumes/{name}/snapshots", response_model=VolumeSnapshotList)
async def list_volume_snapshots(name: str, ctx: CtxDep, who: PrincipalDep) -> VolumeSnapshotList:
    """The volume's own snapshots, newest first, the current one marked. Errors: 404 ``not_found``."""
    return await volume_service.list_volume_snapshots(ctx, who, name)


@router.post("/volumes/{name}/restore", response_model=VolumeInfo)
async def restore_volume(name: str, body: VolumeRestore, ctx: CtxDep, who: PrincipalDep) -> VolumeInfo:
    """Put the volume back to its snapshot ``body.snapshot_id`` (rebuilt at its next attach).
    Errors: 404 ``not_found``, 409 ``volume_in_use`` while a sandbox holds it, 409 ``invalid_state`` for a
    snapshot that is not promoted."""
    return await volume_service.restore_volume(ctx, who, name, body)


@router.delete("/volumes/{name}", status_code=204)
async def delete_volume(name: str, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Delete a volume and its data. Errors: 404 ``not_found``, 409 ``volume_in_use`` while a sandbox that is
    not deleted has it attached (``details.sandbox_ids``)."""
    await volume_service.delete_volume(ctx, who, name)
    return Response(status_code=204)
