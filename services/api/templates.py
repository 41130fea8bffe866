"""Templates (docs/DESIGN.md §8): ``POST /v1/templates`` builds one from a Dockerfile and a context tarball,
``GET /v1/templates`` lists them, ``DELETE /v1/templates/{name}`` removes one nothing uses.

A build is checked here first (name, Dockerfile subset, context size and COPY sources, FROM template, a
second build of the name), then handed to a node that holds the FROM template (the node's
``/internal/v1/templates/build``, services/nodeagent/build/http.py); its NDJSON stream of
:class:`~podbay.contracts.templates.BuildEvent` is relayed as it comes. The ``template_builds`` row is
written here (``running``; its partial unique index refuses a second running build of a name) and finished
by the node. It carries the build's egress policy (the request's ``egress``, else the FROM template's), under
which the gateway lets the builder VM's RUN steps reach the network, as for a sandbox.

Every template has an owner (services/api/template_access.py): the tenant that built it sees and changes
it; templates the operator tenant builds (and ``base``) are shared, read-only for the others. Names are
global: another owner's name is taken (409 ``template_name_taken``) until it is removed. Removing one is a
soft delete (``deleted_at``): its row stays for the sandboxes that referenced it, its tags go, new creates
are refused, and a later build of the name (by any tenant) brings it back as a new version. Versions and tags: podbay.template_versions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
import httpx
from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import Response, StreamingResponse

from pydantic import ValidationError

from podbay.buildcontext import MAX_CONTEXT_BYTES, ContextTooLarge, check_context
from podbay.contracts.egress import EgressPolicy
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
    BuildSpec,
    ImageConfig,
    NodeBuildRequest,
    TemplateDetail,
    TemplateDetailList,
    split_template_ref,
)
from podbay.dockerfile import parse_dockerfile
from podbay.errors import Conflict, Forbidden, NotFound, Unavailable, Unprocessable
from podbay.grants import BUILD_ID_HEADER, GrantKind
from podbay.outbox import new_id
from podbay.template_versions import remove_tag, tags_by_template

from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep, principal_dep
from . import quotas, template_access
from .sandbox_lookup import audit
from .template_access import VISIBLE_SQL

__all__ = ["router", "BUILTIN", "start_build", "remove_template"]

log = logging.getLogger("podbay.api.templates")

router = APIRouter(prefix="/v1", tags=["templates"])
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

#: Templates built by the node agent from code (``podbay template build``), never through this API.
BUILTIN = ("base",)

# The templates tenant $1 may see: shared ones and its own (services/api/template_access.py).
_LIST_SQL = ("SELECT name, digest, memory_mib, vcpus, updated_at AS created_at, parent, config, size_bytes"
             " FROM templates t WHERE deleted_at IS NULL AND " + VISIBLE_SQL.format(tenant="$1") + " ORDER BY name")


def _detail(row: Any, tags: dict[str, list[Any]]) -> TemplateDetail:
    cfg = row["config"]
    return TemplateDetail(name=row["name"], digest=row["digest"], memory_mib=row["memory_mib"], vcpus=row["vcpus"],
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
        rows = await conn.fetch(_LIST_SQL, who.tenant_id)
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
    of ``name`` use it). ``name:tag`` (``web:v2``) builds ``web`` and also tags the build ``v2``: creates of
    ``web:v2`` use it after later rebuilds, and nodes keep it while the tag exists (a tag that named another
    build is moved). Errors before the stream starts: 422 ``validation_error``
    (a name outside ``[a-z0-9-]`` or a tag outside ``[a-z0-9][a-z0-9._-]*``, bad build args), 422 ``invalid_dockerfile`` (names the line and
    instruction), 413 ``context_too_large``, 400 ``invalid_context`` / ``missing_copy_source``, 404
    ``not_found`` (FROM names no template the caller may see), 409 ``conflict`` (a build of the name runs,
    or the name is built in), 409 ``template_name_taken`` (another tenant owns the name), 403 ``forbidden``
    (the name is a shared template and the caller is not the operator tenant), 403 ``quota_exceeded`` (the
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
    if spec.base.kind == "oci" and spec.base.ref.startswith("docker://") and await ctx.pool.fetchval(
            "SELECT name FROM tenants WHERE id=$1", who.tenant_id) != ctx.settings.operator_tenant:
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


async def start_build(ctx: ApiContext, who: Principal, name: str, spec: BuildSpec, data: bytes, recipe: str, *,
                      parent: str, egress: str | None, tag: str | None = None) -> tuple[str, httpx.Response]:
    """Start building template ``name`` from a checked ``spec`` and its context tarball ``data`` (already
    through :func:`~podbay.buildcontext.check_context`) on a ready node that holds template ``parent``, and
    return the build id and the node's open NDJSON stream of :class:`~podbay.contracts.templates.BuildEvent`
    (the caller reads and closes it). ``recipe``: the text kept in ``template_builds.dockerfile``;
    ``egress``: JSON EgressPolicy of the RUN steps (None: the parent's); ``tag``: also tag the build so when
    the node registers it (podbay.template_versions). When the node refuses the build,
    the returned response is its error (status >= 400, body read) and the build row is failed.

    Raises ``NotFound`` (no template ``parent`` the caller may see), ``Unavailable`` (no ready node holds it,
    or the node did not answer), ``Unprocessable`` (``egress`` is not a policy), ``Conflict`` (a build of
    ``name`` runs), ``Forbidden`` (``name`` is a shared template and the caller is not the operator tenant),
    ``TemplateNameTaken`` (409: another tenant owns ``name``), ``QuotaExceeded`` (the tenant's running builds).
    The build registers its template under :func:`~.template_access.build_owner`. Used by
    ``POST /v1/templates`` and E2B's template build (services/api/e2b_templates.py).
    """
    route = f"build template {name}"
    # FROM another tenant's template is FROM no template.
    if await template_access.lookup(ctx.pool, ctx, who, parent, route=route) is None:
        raise NotFound(f"FROM names template {parent!r}, which does not exist", details={"from": parent})
    owner = await template_access.build_owner(ctx.pool, ctx, who)
    async with ctx.pool.acquire() as conn, conn.transaction():
        # Answered before a node is looked for; checked again with the build's row below.
        await template_access.check_build_name(conn, ctx, who, name, owner, route=route)
        await quotas.check_builds(conn, ctx, who, route=route, target=name)
    node = await ctx.pool.fetchrow(
        "SELECT n.id, n.dataplane_url FROM templates t JOIN node_templates nt ON nt.template = t.name"
        " AND nt.digest = t.digest JOIN nodes n ON n.id = nt.node_id"
        " WHERE t.name = $1 AND t.deleted_at IS NULL AND n.state = 'ready' ORDER BY n.seen_at DESC LIMIT 1", parent)
    if node is None:
        if await ctx.pool.fetchval("SELECT 1 FROM templates WHERE name=$1 AND deleted_at IS NULL", parent) is None:
            raise NotFound(f"FROM names template {parent!r}, which does not exist", details={"from": parent})
        raise Unavailable(f"no ready node holds template {parent!r}; retry shortly", details={"retryable": True})
    if egress is not None:
        try:
            policy: Any = EgressPolicy.model_validate_json(egress).model_dump(mode="json")
        except ValidationError as exc:
            raise Unprocessable(f"egress is not an egress policy: {exc.errors()[:3]}") from exc
    else:
        policy = await ctx.pool.fetchval("SELECT egress_policy FROM templates WHERE name=$1", parent)
        if isinstance(policy, str):
            policy = json.loads(policy)
    build_id = new_id("bld")
    for attempt in range(2):
        try:
            async with ctx.pool.acquire() as conn, conn.transaction():
                # The parent's row, shared-locked with the build's row written: a removal of the parent
                # (which locks it for update and refuses while a build FROM it runs) either comes first and
                # this finds no parent, or comes after and finds this build running.
                if await conn.fetchval("SELECT 1 FROM templates WHERE name=$1 AND deleted_at IS NULL FOR SHARE",
                                       parent) is None:
                    raise NotFound(f"FROM names template {parent!r}, which does not exist", details={"from": parent})
                # The name's owner (its row share-locked) and the tenant's running builds (the tenant locked).
                await template_access.check_build_name(conn, ctx, who, name, owner, route=route)
                await quotas.check_builds(conn, ctx, who, route=route, target=name)
                await conn.execute("INSERT INTO template_builds (id, name, tenant_id, node_id, dockerfile, parent,"
                                   " egress_policy, owner_tenant) VALUES ($1,$2,$3,$4,$5,$6,$7::jsonb,$8)", build_id,
                                   name, who.tenant_id, node["id"], recipe, spec.base.ref, policy, owner)
                await audit(conn, who, "template.build", name, detail={"build_id": build_id, "from": spec.base.ref,
                                                                       **({"tag": tag} if tag else {})})
            break
        except asyncpg.UniqueViolationError as exc:
            if attempt == 0 and await fail_stale_build(
                    ctx.pool, ctx.nodes_http, ctx.node_headers(who.tenant_id, name, 0, GrantKind.BUILD_STATUS), name):
                continue  # the running row was left by a build that no longer runs anywhere
            raise Conflict(f"a build of template {name!r} is already running",
                           details={"template": name}) from exc
    params = NodeBuildRequest(build_id=build_id, name=name, spec=spec, tag=tag).model_dump_json()
    try:
        req = ctx.nodes_http.build_request(
            "POST", f"{node['dataplane_url']}/internal/v1/templates/build",
            # A grant for this one build; the node checks the body's build id against it.
            headers={**ctx.node_headers(who.tenant_id, build_id, 0, GrantKind.BUILD), BUILD_ID_HEADER: build_id},
            data={"params": params}, files={"context": ("context.tar", data, "application/x-tar")},
            timeout=httpx.Timeout(None, connect=10.0))
        resp = await ctx.nodes_http.send(req, stream=True)
    except httpx.HTTPError as exc:
        await _finish(ctx, build_id, {"code": "unavailable", "message": f"node did not answer: {exc!r}"})
        raise Unavailable("the build's node did not answer; retry shortly", details={"retryable": True}) from exc
    if resp.status_code >= 400:
        body = await resp.aread()
        await resp.aclose()
        try:
            err = json.loads(body).get("error", {})
        except ValueError:
            err = {"code": "build_failed", "message": body[:500].decode(errors="replace")}
        await _finish(ctx, build_id, err)
        return build_id, httpx.Response(resp.status_code, content=body, headers={"content-type": "application/json"})
    return build_id, resp


STALE_BUILD_GRACE_S = 30.0
"""A ``running`` build row younger than this is taken as live without asking its node: the API writes the row
before the node has claimed the name."""


async def fail_stale_build(pool: asyncpg.Pool, http: httpx.AsyncClient, node_headers: dict[str, str],
                           name: str) -> bool:
    """Fail the ``running`` build row of template ``name`` when no build of it runs any more: its node is not
    ``ready`` (gone, drained, lost), or its node agent answers that it builds no template of that name
    (``GET /internal/v1/templates/building/{name}``). Rows younger than :data:`STALE_BUILD_GRACE_S`, and rows
    whose ready node does not answer, are left alone. Returns whether a row was failed (error ``interrupted``).
    ``node_headers``: the ``build_status`` grant for ``name`` (``ApiContext.node_headers``)."""
    row = await pool.fetchrow(
        "SELECT b.id, n.state AS node_state, n.dataplane_url FROM template_builds b LEFT JOIN nodes n"
        " ON n.id = b.node_id WHERE b.name=$1 AND b.state='running'"
        " AND b.created_at < now() - make_interval(secs => $2)", name, STALE_BUILD_GRACE_S)
    if row is None:
        return False
    if row["node_state"] == "ready":
        try:
            resp = await http.get(f"{row['dataplane_url']}/internal/v1/templates/building/{name}",
                                  headers=node_headers, timeout=10.0)
            resp.raise_for_status()
            if resp.json().get("running", True):
                return False
        except (httpx.HTTPError, ValueError):
            log.warning("could not ask node %s whether template %s is being built", row["dataplane_url"], name)
            return False
    status = await pool.execute(
        "UPDATE template_builds SET state='failed', error=$2::jsonb, finished_at=now() WHERE id=$1"
        " AND state='running'", row["id"],
        {"code": "interrupted", "message": "the build no longer ran on its node"})
    log.warning("failed build %s of template %s: it no longer ran on its node", row["id"], name)
    return bool(status == "UPDATE 1")


async def _finish(ctx: ApiContext, build_id: str, error: dict[str, Any]) -> None:
    await ctx.pool.execute("UPDATE template_builds SET state='failed', error=$2::jsonb, finished_at=now()"
                           " WHERE id=$1 AND state='running'", build_id, error)


@router.get("/templates/{name}/builds", response_model=BuildList)
async def list_builds(name: str, ctx: CtxDep, who: PrincipalDep) -> BuildList:
    """The caller's builds of template ``name``, newest first (at most 50): how a build whose stream was cut
    ended. 404 ``not_found`` when there is no such template and the caller has no build of that name (a first
    build that is still running has a build row before the template has its own, so it is listed)."""
    rows = await ctx.pool.fetch(
        "SELECT id, name, state, parent, digest, error, created_at, finished_at FROM template_builds"
        " WHERE name=$1 AND tenant_id=$2 ORDER BY created_at DESC LIMIT 50", name, who.tenant_id)
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
        if await template_access.lookup(conn, ctx, who, base, route="DELETE /v1/templates/{name}", write=True,
                                        lock="FOR UPDATE") is None:
            raise NotFound(f"template {base!r} does not exist", details={"template": base})
        digest = await remove_tag(conn, base, tag)
        await audit(conn, who, "template.untag", base, detail={"tag": tag, "digest": digest})
    return Response(status_code=204)


async def remove_template(ctx: ApiContext, who: Principal, name: str, *,
                          route: str = "DELETE /v1/templates/{name}") -> None:
    """Soft-delete template ``name`` (``deleted_at``; audited): the one removal behind ``DELETE
    /v1/templates/{name}`` and E2B's ``DELETE /templates/{id}`` (``route`` names it in refusals' audit rows).
    Raises ``NotFound`` (also another tenant's template), ``Forbidden`` (a shared template, unless the caller
    is the operator tenant), ``Conflict`` (built in, or in use by sandboxes not deleted, a warm pool, templates built FROM it, or running builds FROM it)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await template_access.lookup(conn, ctx, who, name, route=route, write=True, lock="FOR UPDATE")
        if row is None:
            raise NotFound(f"template {name!r} does not exist", details={"template": name})
        if name in BUILTIN:
            raise Conflict(f"template {name!r} is built in and cannot be removed", details={"template": name})
        users = await conn.fetchval("SELECT count(*) FROM sandboxes WHERE template=$1 AND state <> 'deleted'", name)
        pool = await conn.fetchval("SELECT 1 FROM warm_pools WHERE template=$1 AND max_size > 0", name)
        children = await conn.fetch("SELECT name FROM templates WHERE parent=$1 AND deleted_at IS NULL", name)
        building = [r["name"] for r in await conn.fetch(
            "SELECT name FROM template_builds WHERE parent=$1 AND state='running'", name)]
        if users or pool or children or building:
            why = ", ".join(filter(None, [f"{users} sandbox(es)" if users else "",
                                          "a warm pool (set its size to 0 first)" if pool else "",
                                          "templates built FROM it: " + ", ".join(r["name"] for r in children)
                                          if children else "",
                                          "builds FROM it that are running: " + ", ".join(building)
                                          if building else ""]))
            raise Conflict(f"template {name!r} is in use by {why}",
                           details={"template": name, "sandboxes": users, "pool": bool(pool),
                                    "children": [r["name"] for r in children], "building": building})
        await conn.execute("UPDATE templates SET deleted_at=now(), updated_at=now() WHERE name=$1", name)
        await conn.execute("DELETE FROM template_tags WHERE name=$1", name)  # a later build starts untagged
        await conn.execute("DELETE FROM node_templates WHERE template=$1", name)
        await audit(conn, who, "template.delete", name)

