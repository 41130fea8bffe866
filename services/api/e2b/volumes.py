"""E2B's volume API, mapped onto podbay's volumes (services/api/services/volume_service.py; docs/e2b.md "Volumes").

    POST   /e2b/volumes                 201 VolumeAndToken  {"name"}: a volume of the deployment's largest size
    GET    /e2b/volumes                 200 [Volume]        the caller's volumes, by name
    GET    /e2b/volumes/{volumeID}      200 VolumeAndToken  404 when the caller has no such volume
    DELETE /e2b/volumes/{volumeID}      204                 404; 409 while a sandbox (not deleted) has it attached
    GET|PATCH|DELETE /e2b/volumecontent/{volumeID}/path   E2B's volume content API: a volume's files
    GET|POST         /e2b/volumecontent/{volumeID}/dir    without a sandbox (``E2B_VOLUME_API_URL`` =
    GET|PUT          /e2b/volumecontent/{volumeID}/file   the API's ``/e2b``)

``volumeID`` is podbay's volume id (``vol_...``, what create answers as ``volumeID``) or the volume's name.
E2B's create names no size, so a volume gets the deployment's largest (``volume_max_size_gib``); the file is
sparse and costs what is written. ``volumeMounts`` of a sandbox create (``[{"name", "path"}]``) become
podbay's read-write ``volumes`` through :func:`volume_mounts`. Errors are E2B's ``{"code": <HTTP status>,
"message"}``.

The volume content API (E2B's spec/openapi-volumecontent.yml) is authorised by the volume's ``token`` (what
create and get answer), sent as ``Authorization: Bearer <token>``, not by an API key: an HMAC of the volume
id under the deployment's internal token (:func:`volume_content_token`), so it opens that one volume of its
tenant and is checked before anything is looked up (401 otherwise). The volume id must be spelled plainly
(``podbay.envdpath.SANDBOX_ID``, no encoding; 404 otherwise). The call goes to the node that holds the
volume (an unbound volume is bound to a ready node first, as a sandbox's first attach would), with a
``volume`` grant (podbay.grants); the node mounts the volume's filesystem for the call and resolves every path
inside it (services/nodeagent/storage/volume_content.py). Unlike E2B's, a podbay volume is an ext4 filesystem that one
VM at a time mounts: while a sandbox that is not deleted has it attached, the content API answers 409 (use
that sandbox's files).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from podbay.contracts.volumes import VolumeCreate, VolumeMount
from podbay.envdpath import SANDBOX_ID
from podbay.errors import InvalidRequest, NotFound, PodbayError
from podbay.grants import GrantKind

from .. import nodes_client
from ..services import volume_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep
from .common import WhoDep, _Body, _E2bRoute, error_body

__all__ = ["router", "volume_mounts", "VolumeMountBody", "volume_content_token", "CONTENT_ROUTES"]

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

#: The volume content API's routes and their methods (E2B's spec/openapi-volumecontent.yml).
CONTENT_ROUTES: dict[str, tuple[str, ...]] = {"path": ("GET", "PATCH", "DELETE"), "dir": ("GET", "POST"),
                                              "file": ("GET", "PUT")}
# The query parameters the node reads; anything else stays here.
_CONTENT_PARAMS = ("path", "depth", "uid", "gid", "mode", "force")


def volume_content_token(internal_token: str, volume_id: str) -> str:
    """The bearer token of one volume's content API: hex HMAC-SHA256 of the volume id (ids are unique across
    tenants, so it opens that tenant's one volume) under the deployment's internal token."""
    return hmac.new(internal_token.encode(), f"e2b-volume-content:{volume_id}".encode(), hashlib.sha256).hexdigest()


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


def _volume_and_token(ctx: ApiContext, vol_id: str, name: str) -> dict[str, Any]:
    return {"volumeID": vol_id, "name": name, "token": volume_content_token(ctx.settings.internal_token, vol_id)}


async def _name_of(ctx: ApiContext, who: Principal, ref: str) -> str:
    """The name of the caller's volume whose id or name is ``ref``; ``NotFound`` otherwise."""
    name = await volume_service.name_of(ctx.pool, who.tenant_id, ref)
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
    return JSONResponse(_volume_and_token(ctx, info.id, info.name), status_code=201)


@router.get("/volumes")
async def list_all(ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """The caller's volumes -> 200 ``[Volume]``."""
    listed = await volume_service.list_volumes(ctx, who)
    return JSONResponse([{"volumeID": v.id, "name": v.name} for v in listed.volumes])


@router.get("/volumes/{volume_id}")
async def get(volume_id: str, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """One volume by id or name -> 200 ``VolumeAndToken``; 404."""
    info = await volume_service.get_volume(ctx, who, await _name_of(ctx, who, volume_id))
    return JSONResponse(_volume_and_token(ctx, info.id, info.name))


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete(volume_id: str, ctx: CtxDep, who: WhoDep) -> Response:
    """Delete a volume and its data -> 204; 404; 409 while a sandbox that is not deleted has it attached."""
    await volume_service.delete_volume(ctx, who, await _name_of(ctx, who, volume_id))
    return Response(status_code=204)


def _e2b_error(resp: Response) -> Response:
    """A node's podbay error answer (``{"error": {"code", "message"}}``) in E2B's shape."""
    try:
        message = json.loads(bytes(resp.body))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = "the volume's node failed"
    return error_body(resp.status_code, str(message))


@router.api_route("/volumecontent/{volume_id}/{op}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def content(volume_id: str, op: str, request: Request, ctx: CtxDep) -> Response:
    """E2B's volume content API for one volume, proxied to its node (module docstring)."""
    raw: bytes = request.scope.get("raw_path") or request.scope["path"].encode()
    methods = CONTENT_ROUTES.get(op)
    if methods is None or not SANDBOX_ID.fullmatch(volume_id) or raw != f"/e2b/volumecontent/{volume_id}/{op}".encode():
        return error_body(404, "no such volume content route")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = volume_content_token(ctx.settings.internal_token, volume_id)
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        return error_body(401, "missing or invalid volume token (Authorization: Bearer <the volume's token>)")
    if request.method not in methods:  # after the token: nothing about a volume to a caller who cannot open it
        return error_body(405, f"{request.method} is not allowed on /volumecontent/{{volumeID}}/{op}")
    try:
        tenant, base = await volume_service.content_node(ctx.pool, volume_id)
        url = str(httpx.URL(base).copy_with(path=f"/internal/v1/volumes/{volume_id}/content/{op}"))
        params = httpx.QueryParams([(k, v) for k, v in request.query_params.multi_items() if k in _CONTENT_PARAMS])
        upload = request.method in ("PUT", "PATCH")
        headers = {"content-type": "application/json" if request.method == "PATCH" else "application/octet-stream"} \
            if upload else {}
        resp = await nodes_client.proxy(ctx, request, url, 0, method=request.method, tenant=tenant, subject=volume_id,
                                     kind=GrantKind.VOLUME, params=params, stream_body=upload,
                                     stream_response=op == "file" and request.method == "GET",
                                     extra_headers=headers, pass_headers=("content-type", "content-length"))
    except PodbayError as exc:
        return error_body(exc.http_status, exc.message)
    return _e2b_error(resp) if resp.status_code >= 400 else resp
