"""Templates (docs/DESIGN.md §8): ``POST /v1/templates`` builds one from a Dockerfile and a context tarball,
``GET /v1/templates`` lists them, ``DELETE /v1/templates/{name}`` removes one nothing uses.

A build is checked here first (name, Dockerfile subset, context size and COPY sources, FROM template, a
second build of the name), then handed to a node that holds the FROM template (the node's
``/internal/v1/templates/build``, services/nodeagent/build/http.py); its NDJSON stream of
:class:`~podbay.contracts.templates.BuildEvent` is relayed as it comes. The ``template_builds`` row is
written here (``running``; its partial unique index refuses a second running build of a name) and finished
by the node. It carries the build's egress policy (the request's ``egress``, else the FROM template's), under
which the gateway lets the builder VM's RUN steps reach the network, as for a sandbox.

Every template has an owner (services/api/services/template_access.py): the tenant that built it sees and changes
it; templates the operator tenant builds (and ``base``) are shared, read-only for the others. Names are
per tenant: the name a tenant gives (``templates.alias``) means its own template, else the shared one of
that name; the node, warm pools and ``sandboxes.template`` use the template's internal key
(``templates.name``). Removing one is a soft delete (``deleted_at``): its row stays for the sandboxes that
referenced it, its tags go, new creates are refused, and a later build of the name by its owner brings it
back as a new version (the same key). Versions and tags: podbay.template_versions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import Response, StreamingResponse


from podbay.buildcontext import MAX_CONTEXT_BYTES, ContextTooLarge, check_context
from podbay.contracts.templates import (
    DISK_MIB_MAX,
    DISK_MIB_MIN,
    MEMORY_MIB_MAX,
    MEMORY_MIB_MIN,
    VCPUS_MAX,
    VCPUS_MIN,
    BuildInfo,
    BuildList,
    BuildResources,
    ImageConfig,
    TemplateDetail,
    TemplateDetailList,
    split_template_ref,
)
from podbay.dockerfile import parse_dockerfile
from podbay.errors import Conflict, Forbidden, NotFound, Unprocessable
from podbay.template_versions import remove_tag, tags_by_template

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import template_access
from ..services.sandbox_lookup import audit
from ..services import templates
from ..services.nodes import is_operator_tenant
from ..services.templates import BUILTIN, remove_template, start_build

__all__ = ["router"]

log = logging.getLogger("podbay.api.templates")

router = APIRouter(prefix="/v1", tags=["templates"])
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

def _detail(row: Any, tags: dict[str, list[Any]]) -> TemplateDetail:
    cfg = row["config"]
    return TemplateDetail(name=row["alias"], digest=row["digest"], memory_mib=row["memory_mib"], vcpus=row["vcpus"],
                          created_at=row["created_at"], parent=row["parent"],
                          config=ImageConfig.model_validate_json(cfg) if isinstance(cfg, str)
                          else (ImageConfig.model_validate(cfg) if cfg is not None else None),
                          size_bytes=row["size_bytes"], tags=tags.get(row["name"], []))


@router.get("/templates", response_model=TemplateDetailList)
async def list_templates(ctx: CtxDep, who: PrincipalDep) -> TemplateDetailList:
    """Templates the caller's sandboxes can be created from (the shared ones and the caller's own): name,
    current build (digest), resources, and for built ones their parent, config (the defaults of exec), disk
    size and tags (the builds ``name:tag`` names)."""
    async with ctx.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        rows = await templates.visible(conn, who.tenant_id)
        tags = await tags_by_template(conn)
    return TemplateDetailList(templates=[_detail(r, tags) for r in rows])


async def _read_limited(upload: UploadFile | None, limit: int) -> bytes:
    if upload is None:
        return b""
    buf = bytearray()
    while chunk := await upload.read(1 << 20):
        buf += chunk
        if len(buf) > limit:
            raise ContextTooLarge(f"the build context is over the limit of {limit} bytes",
                                  details={"limit_bytes": limit})
    return bytes(buf)


@router.post("/templates", response_class=StreamingResponse, responses={
    200: {"content": {"application/x-ndjson": {}},
          "description": "BuildEvent lines (step, log, then done or failed)"}})
async def build_template(
    ctx: CtxDep,
    who: PrincipalDep,
    name: Annotated[str, Form(description="The template's name, [a-z0-9-]; name:tag also tags the build "
                              "(tag [a-z0-9][a-z0-9._-]*, at most 64).")],
    dockerfile: Annotated[str, Form(description="The Dockerfile's text.")],
    build_args: Annotated[str, Form(description="JSON object of --build-arg values.")] = "{}",
    context: Annotated[UploadFile | None, File(description="The build context: a tar archive (gzip allowed).")] = None,
    ready_cmd: Annotated[str | None, Form(description="Shell command: the start command is ready when it exits 0.")]
    = None,
    ready_port: Annotated[int | None, Form(ge=1, le=65535, description="TCP port on 127.0.0.1 that answers when "
                                           "the start command is ready.")] = None,
    egress: Annotated[str | None, Form(description="JSON EgressPolicy for the RUN steps' network (default: the "
                                       "FROM template's policy; none: no egress).")] = None,
    memory_mib: Annotated[int | None, Form(ge=MEMORY_MIB_MIN, le=MEMORY_MIB_MAX, description="Guest RAM of the "
                                           "template's sandboxes, MiB (default: the FROM template's).")] = None,
    vcpus: Annotated[int | None, Form(ge=VCPUS_MIN, le=VCPUS_MAX, description="Guest vCPUs of the template's "
                                      "sandboxes (default: the FROM template's).")] = None,
    disk_mib: Annotated[int | None, Form(ge=DISK_MIB_MIN, le=DISK_MIB_MAX, description="Root disk size, MiB: at "
                                         "least the FROM template's (default: the FROM template's).")] = None,
) -> Response:
    """Build template ``name`` and stream its log; the build becomes the template's current one (new creates
    of ``name`` use it). Names are per tenant: another tenant's template of the same name is another
    template, and is neither touched nor shown. ``name:tag`` (``web:v2``) builds ``web`` and also tags the build ``v2``: creates of
    ``web:v2`` use it after later rebuilds, and nodes keep it while the tag exists (a tag that named another
    build is moved). Errors before the stream starts: 422 ``validation_error``
    (a name outside ``[a-z0-9-]`` or a tag outside ``[a-z0-9][a-z0-9._-]*``, bad build args), 422 ``invalid_dockerfile`` (names the line and
    instruction), 413 ``context_too_large``, 400 ``invalid_context`` / ``missing_copy_source``, 404
    ``not_found`` (FROM names no template the caller may see), 409 ``conflict`` (a build of the name runs,
    or the name is built in), 403 ``forbidden``
    (the name is a shared template's, ``details.reason`` ``shared_name``, and the caller is not the operator
    tenant), 403 ``quota_exceeded`` (the
    tenant's running builds), 503 (no node holds the FROM template), 422 ``validation_error`` for ``memory_mib``, ``vcpus`` or
    ``disk_mib`` out of bounds, or a ``disk_mib`` below the FROM template's disk. Resources other than the
    FROM template's cost one boot of its disk (seconds under TCG) before the steps, cached like a layer. A
    failed step, or a start command (CMD/ENTRYPOINT) that exits
    or does not get ready (``ready_cmd`` exits 0, ``ready_port`` answers; within 120 s), ends the stream with
    a ``failed`` event (step, exit code, output tail) and registers nothing. With a start command the
    template is snapshotted with it running, so every sandbox of it starts with the process up.
    """
    try:
        name, tag = split_template_ref(name)
    except ValueError as exc:
        raise Unprocessable(str(exc), details={"name": name}) from exc
    if name in BUILTIN:
        raise Conflict(f"template {name!r} is built in; build another name FROM it", details={"template": name})
    try:
        args = json.loads(build_args)
        if not isinstance(args, dict) or not all(isinstance(v, str) for v in args.values()):
            raise ValueError("not an object of strings")
    except ValueError as exc:
        raise Unprocessable(f"build_args must be a JSON object of strings: {exc}") from exc
    spec = parse_dockerfile(dockerfile, args)
    if spec.base.kind == "oci" and spec.base.ref.startswith("docker://") and not await is_operator_tenant(
            ctx.pool, ctx.settings, who.tenant_id):
        # skopeo pulls on the node, from the node's own network: no tenant's egress policy applies there.
        raise Forbidden("FROM docker://: registry pulls are for the operator's tenant only (they leave from the "
                        "node, outside every egress policy); put the image in the build context instead "
                        "(skopeo copy or docker save to a file) and build FROM oci-archive:FILE or "
                        "docker-archive:FILE", details={"from": spec.base.ref, "reason": "registry_pull"})
    if ready_cmd is not None or ready_port is not None:
        if spec.config.start_cmd is None:
            raise Unprocessable("a readiness check (ready_cmd, ready_port) needs a start command (CMD or ENTRYPOINT)")
        spec = spec.model_copy(update={"config": spec.config.model_copy(
            update={"ready_cmd": ready_cmd, "ready_port": ready_port})})
    spec = spec.model_copy(update={"resources": BuildResources(memory_mib=memory_mib, vcpus=vcpus,
                                                               disk_mib=disk_mib)})
    data = await _read_limited(context, MAX_CONTEXT_BYTES)
    check_context(spec, data)
    # An OCI image travels in the context and becomes a template on the building node, which needs only
    # base (every node has it) to build it.
    parent = spec.base.ref if spec.base.kind == "template" else "base"
    build_id, resp = await start_build(ctx, who, name, spec, data, dockerfile, parent=parent, egress=egress,
                                       tag=tag)
    if resp.status_code >= 400:
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    return StreamingResponse(relay(), media_type="application/x-ndjson", headers={"x-podbay-build-id": build_id})


@router.get("/templates/{name}/builds", response_model=BuildList)
async def list_builds(name: str, ctx: CtxDep, who: PrincipalDep) -> BuildList:
    """The caller's builds of template ``name``, newest first (at most 50): how a build whose stream was cut
    ended. 404 ``not_found`` when there is no such template and the caller has no build of that name (a first
    build that is still running has a build row before the template has its own, so it is listed)."""
    rows = await templates.builds_of(ctx.pool, who.tenant_id, name)
    if not rows and await template_access.lookup(ctx.pool, ctx, who, name,
                                                 route="GET /v1/templates/{name}/builds") is None:
        raise NotFound(f"template {name!r} does not exist", details={"template": name})
    return BuildList(builds=[BuildInfo(**dict(r)) for r in rows])


@router.delete("/templates/{name}", status_code=204)
async def delete_template(name: str, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Remove a built template (with its tags), or with ``name:tag`` only that tag (its build is reclaimed
    once nothing else references it). 404 ``not_found`` (also another tenant's template),
    ``template_tag_not_found``; 403 ``forbidden`` (a shared template, unless the caller is the operator
    tenant); 422 ``validation_error``
    (a bad name or tag); 409 ``conflict`` when it is built in, or sandboxes (not deleted) or a warm pool use
    it, or another template's current build or a running build is FROM it; for a tag, when sandboxes use its
    build."""
    try:
        base, tag = split_template_ref(name)
    except ValueError as exc:
        raise Unprocessable(str(exc), details={"name": name}) from exc
    if tag is None:
        await remove_template(ctx, who, base)
        return Response(status_code=204)
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await template_access.lookup(conn, ctx, who, base, route="DELETE /v1/templates/{name}", write=True,
                                           lock="FOR UPDATE")
        if row is None:
            raise NotFound(f"template {base!r} does not exist", details={"template": base})
        digest = await remove_tag(conn, row["name"], tag, shown=base)
        await audit(conn, who, "template.untag", base, detail={"tag": tag, "digest": digest})
    return Response(status_code=204)
