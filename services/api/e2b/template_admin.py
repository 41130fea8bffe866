"""E2B's template management under ``/e2b``: list, get and delete, over podbay's templates (the
``templates`` table; docs/e2b.md "Templates"). A tenant sees the shared templates and its own; another
tenant's is 404, and changing (delete, tags) a shared one is 403 unless the caller is the operator tenant
(services/api/services/template_access.py).

    GET    /templates                 200 [Template]            ?teamID (ignored: one namespace)
    GET    /v2/templates              200 [Template]            ?limit, nextToken (next page in x-next-token)
    GET    /templates/{templateID}    200 TemplateWithBuilds    ?limit, nextToken (over its builds)
    DELETE /templates/{templateID}    204                       served by e2b_snapshots.delete_snapshot,
                                                                which hands a template to :func:`delete_template`
    GET    /templates/{templateID}/tags   200 [TemplateTag]     ``Template.get_tags``: its one tag, ``default``
    POST   /templates/tags            201 AssignedTemplateTags  ``Template.assign_tags``: default/latest only
    DELETE /templates/tags            204                       ``Template.remove_tags``: 400 default/latest,
                                                                404 any other (it cannot exist)

Tags: podbay keeps one version per template name (a build replaces it), so a template has exactly E2B's
``default`` tag (``latest`` names the same version). Assigning ``default`` or ``latest`` to a template's
version succeeds and changes nothing; any other tag is refused with 400, as a build with one is
(``e2b_templates``); removing ``default``/``latest`` is 400 (the only version keeps its name). This router is
included after e2b_templates' (``GET /templates/aliases/tags`` is an alias check) and before e2b_snapshots'
(``DELETE /templates/tags`` must not be read as a template named ``tags``).

A ``Template`` is the template's current build: ``templateID``, ``names`` and ``aliases`` are its podbay
name; ``buildID`` names that build (a UUID made from its podbay build id, as E2B's are UUIDs); CPU and
memory are the template's; ``diskSizeMB`` its disk; ``spawnCount`` and ``lastSpawnedAt`` count the
caller's sandboxes of it; ``buildStatus`` is ``ready`` (podbay lists only templates that are built);
``envdVersion`` is the one podbay's envd speaks. ``builds`` of a ``TemplateWithBuilds`` are the caller's
podbay builds of that name (``template_builds``), newest first: ``running`` is ``building``,
``succeeded`` ``ready``, ``failed`` ``error``. The delete is podbay's (``templates.remove_template``): 404
unknown (or another tenant's), 403 shared, 409 built in or in use.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from podbay.contracts.templates import BuildState
from podbay.errors import InvalidRequest, NotFound

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep
from .common import ENVD_VERSION, WhoDep, _Body, _E2bRoute, _iso
from ..services import template_access
from ..services.templates import BUILTIN, builds_page, e2b_templates, remove_template

__all__ = ["router", "delete_template", "DEFAULT_TAGS"]

#: The tags of a podbay template's one version.
DEFAULT_TAGS = ("default", "latest")

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

# E2B's statuses of a build, by podbay's template_builds.state.
_BUILD_STATUS = {BuildState.RUNNING: "building", BuildState.SUCCEEDED: "ready", BuildState.FAILED: "error"}
_MIB = 1 << 20
def _uuid(ident: str) -> str:
    """A stable UUID for a podbay build id (or, for a built-in template, which has no build row, its digest):
    E2B's SDK parses the build ids of a template's builds as UUIDs."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"podbay:{ident}"))


def _template(row: Any) -> dict[str, Any]:
    """E2B's ``Template`` of a row of :func:`~podbay_api.services.templates.e2b_templates`."""
    return {"templateID": row["name"], "buildID": _uuid(row["build_id"] or row["digest"]), "cpuCount": row["vcpus"],
            "memoryMB": row["memory_mib"], "diskSizeMB": (row["size_bytes"] or 0) // _MIB, "public": False,
            "aliases": [row["name"]], "names": [row["name"]], "createdAt": _iso(row["created_at"]),
            "updatedAt": _iso(row["updated_at"]), "createdBy": None,
            "lastSpawnedAt": _iso(row["last"]) if row["last"] else None, "spawnCount": row["spawns"],
            # A built-in template was built by each node, not through a build row: it has one build.
            "buildCount": max(1, row["builds"]), "envdVersion": ENVD_VERSION, "buildStatus": "ready",
            "isDefault": row["name"] in BUILTIN}


async def _templates(ctx: ApiContext, who: Principal, name: str | None, after: str | None, limit: int) -> list[Any]:
    return await e2b_templates(ctx.pool, who.tenant_id, name, after, limit)


@router.get("/templates")
async def list_templates(ctx: CtxDep, who: WhoDep, team_id: str | None = Query(None, alias="teamID")
                         ) -> JSONResponse:
    """Every template sandboxes can start from -> 200 ``[Template]`` by name (``teamID`` is ignored:
    podbay's templates are one namespace)."""
    return JSONResponse([_template(r) for r in await _templates(ctx, who, None, None, 10_000)])


@router.get("/v2/templates")
async def list_templates_v2(ctx: CtxDep, who: WhoDep, team_id: str | None = Query(None, alias="teamID"),
                            limit: int = Query(100, ge=1, le=100),
                            next_token: str | None = Query(None, alias="nextToken")) -> JSONResponse:
    """A page of templates by name -> 200 ``[Template]``; the next page's token in ``x-next-token``."""
    rows = await _templates(ctx, who, None, next_token or None, limit + 1)
    headers = {"x-next-token": rows[limit - 1]["name"]} if len(rows) > limit else None
    return JSONResponse([_template(r) for r in rows[:limit]], headers=headers)


@router.get("/templates/{template_id}")
async def get_template(template_id: str, ctx: CtxDep, who: WhoDep, limit: int = Query(100, ge=1, le=100),
                       next_token: str | None = Query(None, alias="nextToken")) -> JSONResponse:
    """One template with the caller's builds of it, newest first -> 200 ``TemplateWithBuilds``; the next
    page of builds' token in ``x-next-token``; 404 when no such template."""
    name = template_id.partition(":")[0]
    rows = await _templates(ctx, who, name, None, 1)
    if not rows:
        raise NotFound(f"template {template_id!r} was not found")
    try:
        skip = int(next_token or 0)
    except ValueError as exc:
        raise InvalidRequest("nextToken was not issued by this server") from exc
    builds = await builds_page(ctx.pool, who.tenant_id, name, skip, limit + 1)
    tpl = rows[0]
    out = _template(tpl)
    out["builds"] = [
        {"buildID": _uuid(b["id"]), "status": _BUILD_STATUS.get(b["state"], "error"),
         "createdAt": _iso(b["created_at"]), "updatedAt": _iso(b["finished_at"] or b["created_at"]),
         **({"finishedAt": _iso(b["finished_at"])} if b["finished_at"] else {}),
         "cpuCount": tpl["vcpus"], "memoryMB": tpl["memory_mib"], "envdVersion": ENVD_VERSION}
        for b in builds[:limit]]
    headers = {"x-next-token": str(skip + limit)} if len(builds) > limit else None
    return JSONResponse(out, headers=headers)


async def delete_template(ctx: ApiContext, who: Principal, template_id: str) -> None:
    """``DELETE /templates/{id}`` for a template (not a snapshot): podbay's removal. Raises ``NotFound``,
    ``Conflict`` (built in, or in use)."""
    await remove_template(ctx, who, template_id.partition(":")[0], route="DELETE /e2b/templates/{templateID}")


class AssignTags(_Body):
    """E2B's ``AssignTemplateTagsRequest``."""

    target: str = Field(min_length=1, max_length=256, description="name[:tag] of the version to tag")
    tags: list[str] = Field(min_length=1, max_length=64)


class RemoveTags(_Body):
    """E2B's ``DeleteTemplateTagsRequest``."""

    name: str = Field(min_length=1, max_length=256)
    tags: list[str] = Field(min_length=1, max_length=64)


async def _one(ctx: ApiContext, who: Principal, ref: str, *, route: str, write: bool = False) -> Any:
    """The template ``ref`` (``name[:tag]``) names -> its row; ``NotFound`` for no such template (or another
    tenant's, audited), or a tag other than the version's own. ``write``: ``Forbidden`` for a shared template
    unless the caller is the operator tenant (services/api/services/template_access.py)."""
    name, _, tag = ref.partition(":")
    if await template_access.lookup(ctx.pool, ctx, who, name, route=route, write=write) is None:
        raise NotFound(f"template {ref!r} was not found")
    rows = await _templates(ctx, who, name, None, 1)
    if not rows or (tag and tag not in DEFAULT_TAGS):
        raise NotFound(f"template {ref!r} was not found")
    return rows[0]


@router.post("/templates/tags")
async def assign_tags(body: AssignTags, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Tag the version ``target`` names -> 201 ``{tags, buildID}``; 400 for a tag other than default/latest
    (podbay keeps one version per name), 404 no such template."""
    row = await _one(ctx, who, body.target, route="POST /e2b/templates/tags", write=True)
    other = [t for t in body.tags if t not in DEFAULT_TAGS]
    if other:
        raise InvalidRequest(f"tag {other[0]!r}: podbay keeps one version per template name (tags default and "
                             "latest only); build under another name instead")
    return JSONResponse({"tags": body.tags, "buildID": _uuid(row["build_id"] or row["digest"])}, status_code=201)


@router.delete("/templates/tags", status_code=204)
async def remove_tags(body: RemoveTags, ctx: CtxDep, who: WhoDep) -> Response:
    """Remove tags -> never 204: 400 for default/latest (a template's only version keeps them), 404 for any
    other tag (it cannot exist) or no such template."""
    await _one(ctx, who, body.name, route="DELETE /e2b/templates/tags", write=True)
    kept = [t for t in body.tags if t in DEFAULT_TAGS]
    if kept:
        raise InvalidRequest(f"tag {kept[0]!r} names the template's only version in podbay and cannot be "
                             "removed; delete the template instead")
    raise NotFound(f"template {body.name!r} has no tag {body.tags[0]!r} (podbay templates have default only)")


@router.get("/templates/{template_id}/tags")
async def get_tags(template_id: str, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """A template's tags -> 200 ``[TemplateTag]``: ``default`` on its one version; 404 no such template."""
    row = await _one(ctx, who, template_id, route="GET /e2b/templates/{templateID}/tags")
    return JSONResponse([{"tag": "default", "buildID": _uuid(row["build_id"] or row["digest"]),
                          "createdAt": _iso(row["updated_at"])}])
