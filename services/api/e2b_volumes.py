"""E2B's volume API, mapped onto podbay's volumes (services/api/volume_service.py; docs/e2b.md "Volumes").

    POST   /e2b/volumes                 201 VolumeAndToken  {"name"}: a volume of the deployment's largest size
    GET    /e2b/volumes                 200 [Volume]        the caller's volumes, by name
    GET    /e2b/volumes/{volumeID}      200 VolumeAndToken  404 when the caller has no such volume
    DELETE /e2b/volumes/{volumeID}      204                 404; 409 while a sandbox (not deleted) has it attached
    *      /e2b/volumecontent/{...}     501                 E2B's volume content API is not served

``volumeID`` is podbay's volume id (``vol_...``, what create answers as ``volumeID``) or the volume's name.
E2B's create names no size, so a volume gets the deployment's largest (``volume_max_size_gib``); the file is
sparse and costs what is written. ``token`` authorises E2B's separate volume content API (reading and
writing files of a volume without a sandbox, ``E2B_VOLUME_API_URL``), which podbay does not serve: it is
empty, and every ``/e2b/volumecontent/...`` call answers 501 in E2B's shape. ``volumeMounts`` of a sandbox
create (``[{"name", "path"}]``) become podbay's read-write ``volumes`` through :func:`volume_mounts`.
Errors are E2B's ``{"code": <HTTP status>, "message"}``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from podbay.contracts.volumes import VolumeCreate, VolumeMount
from podbay.errors import InvalidRequest, NotFound

from . import volume_service
from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep
from .e2b_common import WhoDep, _Body, _E2bRoute, error_body

__all__ = ["router", "volume_mounts", "VolumeMountBody", "CONTENT_NOT_SERVED"]

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

CONTENT_NOT_SERVED = ("podbay does not serve E2B's volume content API (files of a volume without a sandbox);"
                      " mount the volume in a sandbox (volumeMounts) and use its filesystem instead")


class NewVolume(_Body):
    """E2B's ``NewVolume``."""

    name: str = Field(min_length=1, max_length=256)


class VolumeMountBody(_Body):
    """One entry of E2B's ``volumeMounts``: volume ``name`` at ``path`` in the guest."""

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1, max_length=4096)


def _invalid(exc: ValidationError, what: str) -> InvalidRequest:
    errors = exc.errors()
    where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
    return InvalidRequest(f"{what}{'.' + where if where else ''}: {errors[0]['msg'] if errors else 'invalid'}")


def volume_mounts(raw: list[VolumeMountBody] | None) -> list[VolumeMount] | None:
    """E2B's ``volumeMounts`` -> podbay's ``SandboxCreate.volumes`` (read-write, in order); None when there are
    none. Raises ``InvalidRequest`` for a name or path podbay's volumes do not accept (the path rules are
    checked again, with their own error, when the create attaches them)."""
    if not raw:
        return None
    out = []
    for i, m in enumerate(raw):
        try:
            out.append(VolumeMount(name=m.name, path=m.path, readonly=False))
        except ValidationError as exc:
            raise _invalid(exc, f"volumeMounts.{i}") from exc
    return out


def _volume_and_token(vol_id: str, name: str) -> dict[str, Any]:
    return {"volumeID": vol_id, "name": name, "token": ""}


async def _name_of(ctx: ApiContext, who: Principal, ref: str) -> str:
    """The name of the caller's volume whose id or name is ``ref``; ``NotFound`` otherwise."""
    name = await ctx.pool.fetchval(
        "SELECT name FROM volumes WHERE tenant_id=$1 AND state='available' AND (id=$2 OR name=$2)"
        " ORDER BY id=$2 DESC LIMIT 1", who.tenant_id, ref)
    if name is None:
        raise NotFound(f"volume {ref} was not found")
    return str(name)


@router.post("/volumes")
async def create(body: NewVolume, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Create a volume named ``name`` -> 201 ``VolumeAndToken``; 409 when the name is taken, 400 for a name
    podbay does not accept (lower-case letters, digits, ``.``, ``_``, ``-``; at most 63)."""
    try:
        req = VolumeCreate(name=body.name, size_bytes=ctx.settings.volume_max_size_gib << 30)
    except ValidationError as exc:
        raise _invalid(exc, "name") from exc
    info = await volume_service.create_volume(ctx, who, req)
    return JSONResponse(_volume_and_token(info.id, info.name), status_code=201)


@router.get("/volumes")
async def list_all(ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """The caller's volumes -> 200 ``[Volume]``."""
    listed = await volume_service.list_volumes(ctx, who)
    return JSONResponse([{"volumeID": v.id, "name": v.name} for v in listed.volumes])


@router.get("/volumes/{volume_id}")
async def get(volume_id: str, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """One volume by id or name -> 200 ``VolumeAndToken``; 404."""
    info = await volume_service.get_volume(ctx, who, await _name_of(ctx, who, volume_id))
    return JSONResponse(_volume_and_token(info.id, info.name))


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete(volume_id: str, ctx: CtxDep, who: WhoDep) -> Response:
    """Delete a volume and its data -> 204; 404; 409 while a sandbox that is not deleted has it attached."""
    await volume_service.delete_volume(ctx, who, await _name_of(ctx, who, volume_id))
    return Response(status_code=204)


@router.api_route("/volumecontent/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"])
async def content(path: str) -> JSONResponse:
    """E2B's volume content API -> 501 in E2B's shape (module docstring)."""
    return error_body(501, CONTENT_NOT_SERVED)
