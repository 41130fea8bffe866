"""The template service (no FastAPI types): start a build on a node that holds its FROM template, fail a build
row its node no longer runs, and remove a template. ``POST``/``DELETE /v1/templates`` (services/api/routes/
templates.py) and E2B's template build and admin APIs (services/api/e2b/templates.py, e2b/template_admin.py) call
it, and the named queries of E2B's protocol over templates (its listing, builds and build logs). What a
build is, who owns a template and what removing one means: services/api/routes/templates.py's docstring and
services/api/services/template_access.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import asyncpg
import httpx
from pydantic import ValidationError

from podbay import build_state, template_state

from podbay.contracts.egress import EgressPolicy
from podbay.contracts.states import NodeState
from podbay.contracts.templates import BuildSpec, BuildState, NodeBuildRequest
from podbay.errors import Conflict, NotFound, Unavailable, Unprocessable
from podbay.grants import BUILD_ID_HEADER, GrantKind
from podbay.outbox import new_id

from ..core.auth import Principal
from ..core.context import ApiContext
from . import quotas, template_access
from .sandbox_lookup import audit

__all__ = ["BUILTIN", "STALE_BUILD_GRACE_S", "visible", "builds_of", "start_build", "fail_stale_build", "remove_template",
           "e2b_templates", "builds_page", "live_config", "build_outcome", "e2b_build", "append_e2b_build_log",
           "e2b_build_log"]

log = logging.getLogger("podbay.api.templates")

#: Templates built by the node agent from code (``podbay template build``), never through this API.
BUILTIN = ("base",)


# The templates tenant $1 may see: shared ones and its own (services/api/services/template_access.py).
# ``name`` is the key (tags are by key), ``alias`` the name shown; a name the caller has shadows a shared one.
_VISIBLE_SQL = ("SELECT name, alias, digest, memory_mib, vcpus, updated_at AS created_at,"
                " " + template_access.ALIAS_SQL.format(key="t.parent") + " AS parent, config, size_bytes"
                " FROM templates t WHERE deleted_at IS NULL AND " + template_access.VISIBLE_SQL.format(tenant="$1") +
                " AND NOT (t.owner_tenant IS NULL AND EXISTS (SELECT 1 FROM templates o WHERE o.alias = t.alias"
                " AND o.owner_tenant = $1 AND o.deleted_at IS NULL)) ORDER BY alias")




async def visible(conn: asyncpg.Connection, tenant_id: str) -> list[asyncpg.Record]:
    """The templates tenant ``tenant_id`` may create from (``name`` key, ``alias``, ``digest``, ``memory_mib``,
    ``vcpus``, ``created_at``, ``parent`` alias, ``config``, ``size_bytes``), by alias."""
    return list(await conn.fetch(_VISIBLE_SQL, tenant_id))


async def builds_of(pool: asyncpg.Pool, tenant_id: str, alias: str) -> list[asyncpg.Record]:
    """The tenant's newest 50 builds of template ``alias`` (``id``, ``name``, ``state``, ``parent``, ``digest``,
    ``error``, ``created_at``, ``finished_at``), newest first."""
    return list(await pool.fetch(
        "SELECT id, alias AS name, state, " + template_access.ALIAS_SQL.format(key="b.parent") + " AS parent,"
        " digest, error, created_at, finished_at FROM template_builds b"
        " WHERE alias=$1 AND tenant_id=$2 ORDER BY created_at DESC LIMIT 50", alias, tenant_id))


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
    ``name`` runs), ``Forbidden`` (``name`` is a shared template's and the caller is not the operator tenant),
    ``QuotaExceeded`` (the tenant's running builds). ``name`` and ``parent`` are names as the caller gave
    them; the build registers its template under :func:`~.template_access.build_owner` and the key
    :func:`~.template_access.build_key` gives, FROM the parent's key. Used by
    ``POST /v1/templates`` and E2B's template build (services/api/e2b/templates.py).
    """
    route = f"build template {name}"
    # FROM another tenant's template is FROM no template; FROM a name means the caller's own, else the shared.
    parent_row = await template_access.lookup(ctx.pool, ctx, who, parent, route=route)
    if parent_row is None:
        raise NotFound(f"FROM names template {parent!r}, which does not exist", details={"from": parent})
    alias, parent = name, parent_row["name"]  # from here on ``parent`` is the FROM template's key
    if spec.base.kind == "template":
        # The node resolves FROM among the templates it holds, by key.
        spec = spec.model_copy(update={"base": spec.base.model_copy(update={"ref": parent})})
    owner = await template_access.build_owner(ctx.pool, ctx, who)
    async with ctx.pool.acquire() as conn, conn.transaction():
        # Answered before a node is looked for; checked again with the build's row below.
        name = await template_access.build_key(conn, ctx, who, alias, owner, route=route)
        await quotas.check_builds(conn, ctx, who, route=route, target=alias)
    node = await ctx.pool.fetchrow(
        "SELECT n.id, n.dataplane_url FROM templates t JOIN node_templates nt ON nt.template = t.name"
        " AND nt.digest = t.digest JOIN nodes n ON n.id = nt.node_id"
        " WHERE t.name = $1 AND t.deleted_at IS NULL AND n.state = $2 ORDER BY n.seen_at DESC LIMIT 1", parent,
        NodeState.READY)
    if node is None:
        if await ctx.pool.fetchval("SELECT 1 FROM templates WHERE name=$1 AND deleted_at IS NULL", parent) is None:
            raise NotFound(f"FROM names template {parent_row['alias']!r}, which does not exist",
                           details={"from": parent_row["alias"]})
        raise Unavailable(f"no ready node holds template {parent_row['alias']!r}; retry shortly",
                          details={"retryable": True})
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
                    raise NotFound(f"FROM names template {parent_row['alias']!r}, which does not exist",
                                   details={"from": parent_row["alias"]})
                # The name's key (rows share-locked) and the tenant's running builds (the tenant locked).
                if await template_access.build_key(conn, ctx, who, alias, owner, route=route) != name:
                    raise Conflict(f"template {alias!r} changed while the build started; retry",
                                   details={"template": alias})
                await quotas.check_builds(conn, ctx, who, route=route, target=alias)
                # ``parent``: the FROM template's key, or the OCI reference as written.
                await build_state.insert_build(conn, build_id, name=name, alias=alias, tenant_id=who.tenant_id,
                                               node_id=node["id"], dockerfile=recipe, parent=spec.base.ref,
                                               egress_policy=policy, owner_tenant=owner)
                await audit(conn, who, "template.build", alias,
                            detail={"build_id": build_id, "from": parent_row["alias"] if spec.base.kind == "template"
                                    else spec.base.ref, **({"tag": tag} if tag else {})})
            break
        except asyncpg.UniqueViolationError as exc:
            if attempt == 0 and await fail_stale_build(
                    ctx.pool, ctx.nodes_http, ctx.node_headers(who.tenant_id, name, 0, GrantKind.BUILD_STATUS), name):
                continue  # the running row was left by a build that no longer runs anywhere
            raise Conflict(f"a build of template {alias!r} is already running",
                           details={"template": alias}) from exc
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
    if row["node_state"] == NodeState.READY:
        try:
            resp = await http.get(f"{row['dataplane_url']}/internal/v1/templates/building/{name}",
                                  headers=node_headers, timeout=10.0)
            resp.raise_for_status()
            if resp.json().get("running", True):
                return False
        except (httpx.HTTPError, ValueError):
            log.warning("could not ask node %s whether template %s is being built", row["dataplane_url"], name)
            return False
    failed = await build_state.fail_build(pool, row["id"],
                                          {"code": "interrupted", "message": "the build no longer ran on its node"})
    log.warning("failed build %s of template %s: it no longer ran on its node", row["id"], name)
    return failed


async def _finish(ctx: ApiContext, build_id: str, error: dict[str, Any]) -> None:
    await build_state.fail_build(ctx.pool, build_id, error)


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
        if name in BUILTIN and row["owner_tenant"] is None:
            raise Conflict(f"template {name!r} is built in and cannot be removed", details={"template": name})
        alias, name = name, row["name"]  # from here on ``name`` is the key
        users = await conn.fetchval("SELECT count(*) FROM sandboxes WHERE template=$1 AND state <> 'deleted'", name)
        pool = await conn.fetchval("SELECT 1 FROM warm_pools WHERE template=$1 AND max_size > 0", name)
        children = await conn.fetch("SELECT alias AS name FROM templates WHERE parent=$1 AND deleted_at IS NULL",
                                    name)
        building = [r["name"] for r in await conn.fetch(
            "SELECT alias AS name FROM template_builds WHERE parent=$1 AND state='running'", name)]
        if users or pool or children or building:
            why = ", ".join(filter(None, [f"{users} sandbox(es)" if users else "",
                                          "a warm pool (set its size to 0 first)" if pool else "",
                                          "templates built FROM it: " + ", ".join(r["name"] for r in children)
                                          if children else "",
                                          "builds FROM it that are running: " + ", ".join(building)
                                          if building else ""]))
            raise Conflict(f"template {alias!r} is in use by {why}",
                           details={"template": alias, "sandboxes": users, "pool": bool(pool),
                                    "children": [r["name"] for r in children], "building": building})
        await template_state.mark_deleted(conn, name)
        await conn.execute("DELETE FROM template_tags WHERE name=$1", name)  # a later build starts untagged
        await conn.execute("DELETE FROM node_templates WHERE template=$1", name)
        await audit(conn, who, "template.delete", alias, detail={"key": name})


# E2B's protocol over templates (services/api/e2b/templates.py, e2b/template_admin.py).

# Every template the caller may see (shared ones and its own: services/api/services/template_access.py) with the
# caller's use of it, by the names their owners gave (``alias``; ``t.name`` is the key, which sandboxes, builds
# and pools use); a shared template the caller has a name of its own for is not listed. $1 tenant, $2 one
# name (or NULL: all), $3 names after this one (or NULL), $4 at most this many.
_E2B_TEMPLATES_SQL = (
    "SELECT t.alias AS name, t.digest, t.vcpus, t.memory_mib, t.size_bytes, t.created_at, t.updated_at,"
    " (SELECT count(*) FROM sandboxes s WHERE s.template = t.name AND s.tenant_id = $1) AS spawns,"
    " (SELECT max(s.created_at) FROM sandboxes s WHERE s.template = t.name AND s.tenant_id = $1) AS last,"
    f" (SELECT count(*) FROM template_builds b WHERE b.name = t.name AND b.state = '{BuildState.SUCCEEDED}'"
    "  AND b.owner_tenant IS NOT DISTINCT FROM t.owner_tenant) AS builds,"
    " (SELECT b.id FROM template_builds b WHERE b.name = t.name AND b.digest = t.digest"
    f"  AND b.state = '{BuildState.SUCCEEDED}' ORDER BY b.finished_at DESC LIMIT 1) AS build_id"
    " FROM templates t WHERE t.deleted_at IS NULL AND ($2::text IS NULL OR t.alias = $2)"
    " AND " + template_access.VISIBLE_SQL.format(tenant="$1") +
    " AND NOT (t.owner_tenant IS NULL AND EXISTS (SELECT 1 FROM templates o WHERE o.alias = t.alias"
    " AND o.owner_tenant = $1 AND o.deleted_at IS NULL))"
    " AND ($3::text IS NULL OR t.alias > $3) ORDER BY t.alias LIMIT $4")


async def e2b_templates(pool: Any, tenant_id: str, name: str | None, after: str | None,
                        limit: int) -> list[asyncpg.Record]:
    """Up to ``limit`` of the templates the tenant sees, by name (the name the owner gave), after name
    ``after`` (None: from the first); ``name`` keeps the one of that name. Rows: ``name``, ``digest``,
    ``vcpus``, ``memory_mib``, ``size_bytes``, ``created_at``, ``updated_at``, ``spawns`` and ``last`` (the
    tenant's sandboxes of it: how many, the newest's creation), ``builds`` (its owner's succeeded builds),
    ``build_id`` (the build of its current digest, or None for a built-in template)."""
    return list(await pool.fetch(_E2B_TEMPLATES_SQL, tenant_id, name, after, limit))


async def builds_page(pool: Any, tenant_id: str, alias: str, offset: int, limit: int) -> list[asyncpg.Record]:
    """The tenant's builds of template ``alias`` (``id``, ``state``, ``digest``, ``created_at``,
    ``finished_at``), newest first, from the ``offset``-th, at most ``limit``."""
    return list(await pool.fetch(
        "SELECT b.id, b.state, b.digest, b.created_at, b.finished_at FROM template_builds b"
        " WHERE b.alias = $1 AND b.tenant_id = $2 ORDER BY b.created_at DESC, b.id OFFSET $3 LIMIT $4",
        alias, tenant_id, offset, limit))


async def live_config(pool: Any, name: str) -> asyncpg.Record | None:
    """The ``config`` (its image config, JSON or None) of the live template of key ``name``, as a row; None
    when there is no such template."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT config FROM templates WHERE name=$1 AND deleted_at IS NULL", name)
    return row


async def build_outcome(pool: Any, build_id: str) -> asyncpg.Record | None:
    """The podbay build's ``state``, ``error`` and ``finished_at``, or None when there is no such build."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT state, error, finished_at FROM template_builds WHERE id=$1", build_id)
    return row


async def e2b_build(pool: Any, tenant_id: str, template: str, build_id: str) -> asyncpg.Record | None:
    """The tenant's E2B build ``build_id`` of template ``template`` (its ``e2b_template_builds`` row), or None."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT * FROM e2b_template_builds WHERE id=$1 AND tenant_id=$2 AND template=$3",
        build_id, tenant_id, template)
    return row


async def append_e2b_build_log(pool: Any, build_id: str, entries: Sequence[tuple[str, str, str | None]]) -> None:
    """Append ``(level, message, step)`` entries to an E2B build's log."""
    await pool.executemany("INSERT INTO e2b_template_build_logs (build_id, level, message, step)"
                           " VALUES ($1, $2, $3, $4)", [(build_id, *e) for e in entries])


async def e2b_build_log(pool: Any, build_id: str, levels: Sequence[str], offset: int,
                        limit: int) -> list[asyncpg.Record]:
    """An E2B build's log entries (``at``, ``level``, ``message``, ``step``) of ``levels``, in order, from
    the ``offset``-th, at most ``limit``."""
    return list(await pool.fetch(
        "SELECT at, level, message, step FROM e2b_template_build_logs WHERE build_id=$1 AND level = ANY($2::text[])"
        " ORDER BY id OFFSET $3 LIMIT $4", build_id, list(levels), offset, limit))
