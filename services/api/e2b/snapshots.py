"""E2B's snapshots and fork, mapped onto podbay's own (services/api/routes/snapshots.py; docs/e2b.md "Snapshots and
fork"). No second snapshot system: an E2B snapshot *is* a podbay snapshot of the source sandbox, and its id
(``snap_...``) is the ``snapshotID`` E2B's SDK hands back and later passes as the template of a create.

    POST   /e2b/sandboxes/{id}/snapshots   201 SnapshotInfo      {"name"?, "memory"?}: full (default) or disk
    GET    /e2b/snapshots                  200 [SnapshotInfo]    ?sandboxID, name, limit, nextToken (x-next-token)
    DELETE /e2b/templates/{snapshot_id}    204                   404 when no such snapshot of the caller
                                                                 (a template's id: e2b_template_admin)
    POST   /e2b/sandboxes/{id}/fork        201 [ForkResult]      {"timeout"?, "count"?}: one entry per child
    POST   /e2b/v2/sandboxes {"templateID": "snap_..."}          a sandbox started from that full snapshot

``create_snapshot(name=...)`` also names the snapshot (table ``e2b_snapshot_names``; a later snapshot with
the same name takes the name over): its ``snapshotID`` is then the name, which create and delete accept.
A snapshot outlives its source sandbox, as E2B's do: it is pinned (``snapshots.pinned``: no retention, no
removal with its sandbox) and promoted to object storage before the call answers. A create from it is a
podbay fork while the source runs or is paused, and otherwise a wake of a new sandbox from the promoted
snapshot (the machinery of a resume from object storage, ``sandbox_service.resume_suspended``), on any node with room.
A filesystem-only snapshot (``memory: false``) is a podbay disk snapshot; a create from it is always such
a wake, whose node boots the new sandbox afresh on the snapshot's disk (E2B's cold boot: files kept, no
processes or memory), whether its source still runs or not.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from podbay.contracts.events import EventType
from podbay.contracts import subjects
from podbay.contracts.api import ForkRequest, SnapshotCreate
from podbay.contracts.messages import PromoteCmd
from podbay.errors import Conflict, InvalidRequest, NotFound, PodbayError
from podbay.contracts.states import PromotionState, SandboxState
from podbay import lifecycle
from podbay.lifecycle import SandboxEvent, copy_lease_action, expire_lease
from podbay.outbox import new_id
from podbay.naming import sandbox_id_from_e2b
from podbay import snapshot_state

from . import template_admin as e2b_template_admin
from ..services import sandbox_lookup, sandbox_service, snapshot_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep
from .common import WhoDep, _Body, _E2bRoute, _exact_lease, _row, _sandbox, decode_cursor, encode_cursor, error_body
from ..services.quotas import QuotaExceeded
from ..services.sandbox_lookup import GUEST_ENV_SQL

__all__ = ["router", "is_snapshot_id", "resolve_snapshot", "create_from_snapshot", "FORK_DEFAULT_TIMEOUT_S"]

# E2B's default lifetime of a fork child (SandboxForkRequest.timeout).
FORK_DEFAULT_TIMEOUT_S = 15
MAX_FORK_COUNT = 20  # E2B's SDK refuses more
PROMOTION_POLL_S = 0.25

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]


def is_snapshot_id(template_id: str) -> bool:
    """Whether a create's ``templateID`` names a podbay snapshot (``snap_...``, optionally with E2B's
    ``:default`` tag) rather than a template."""
    return template_id.split(":", 1)[0].startswith("snap_")


class SnapshotBody(_Body):
    name: str | None = Field(None, max_length=128)
    memory: bool | None = None


class ForkBody(_Body):
    timeout: int | None = Field(None, ge=0, le=30 * 86400)
    count: int | None = Field(None, ge=1, le=MAX_FORK_COUNT)


def _snapshot_info(snapshot_id: str, name: str | None = None) -> dict[str, Any]:
    return {"snapshotID": name or snapshot_id, "names": [name or snapshot_id]}


async def resolve_snapshot(ctx: ApiContext, who: Principal, template_id: str) -> str | None:
    """The podbay snapshot a create's ``templateID`` names: a snapshot id (``snap_...``, optionally with
    E2B's ``:default`` tag) or a snapshot name of the caller's; None for anything else (a template)."""
    ref = template_id.split(":", 1)[0]
    if is_snapshot_id(ref):
        return ref
    return await snapshot_service.snapshot_of_name(ctx.pool, who.tenant_id, ref)


async def _copy_e2b_row(ctx: ApiContext, parent: str, children: list[str]) -> None:
    """Children keep the parent's E2B create settings (default environment, auto-resume, what a timeout
    does, the network configuration and workload identity tokens its rules name: a child's tokens name the
    child)."""
    await copy_lease_action(ctx.pool, parent, children)
    await sandbox_lookup.copy_e2b_settings(ctx.pool, parent, children)


async def _fork(ctx: ApiContext, who: Principal, row: Any, count: int, timeout: int,
                snapshot_id: str | None = None) -> list[dict[str, Any]]:
    """Start ``count`` children of ``row``'s sandbox (from a new full snapshot, or ``snapshot_id``) -> E2B's
    per-child results: ``{"sandbox": Sandbox}`` or ``{"error": {"code", "message"}}``."""
    res, _ = await snapshot_service.fork(ctx, who, row["id"], ForkRequest(count=count, snapshot_id=snapshot_id),
                                         wait=True)
    ids = [c.sandbox_id for c in res.children]
    await _copy_e2b_row(ctx, row["id"], ids)
    out: list[dict[str, Any]] = []
    for child in res.children:
        if child.state != "running":
            reason = child.failure_reason or f"the fork is {child.state}"
            out.append({"error": {"code": 500, "message": f"fork {child.sandbox_id} did not start: {reason}"}})
            continue
        await _exact_lease(ctx, who, child.sandbox_id, timeout)
        out.append({"sandbox": _sandbox(ctx, child.sandbox_id, row.get("template_alias") or row["template"])})
    return out


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: ForkBody | None = None) -> JSONResponse:
    """Fork a running or paused sandbox ``count`` times (default 1) from one new full snapshot -> 201, one
    entry per child; 404 when the sandbox is gone (killed)."""
    row = await _row(ctx, who, sandbox_id)
    body = body or ForkBody()
    results = await _fork(ctx, who, row, body.count or 1,
                          body.timeout if body.timeout is not None else FORK_DEFAULT_TIMEOUT_S)
    return JSONResponse(results, status_code=201)


async def _snapshot_row(ctx: ApiContext, who: Principal, snapshot_id: str) -> Any:
    resolved = await resolve_snapshot(ctx, who, snapshot_id)
    row = await snapshot_service.usable_snapshot(ctx.pool, who.tenant_id, resolved) if resolved else None
    if row is None:
        raise NotFound(f"snapshot {snapshot_id} was not found")
    return row


async def create_from_snapshot(template_id: str, timeout: int | None, ctx: ApiContext, who: Principal,
                               ) -> JSONResponse:
    """``Sandbox.create(snapshot_id or name)``: one child of the snapshot's source sandbox, from that snapshot
    -> 201 ``Sandbox``; 404 unknown (or its source is gone). A full snapshot of a running or paused source
    is forked; otherwise, and for every disk (filesystem-only) snapshot, a new sandbox is woken from the
    snapshot in object storage (a disk snapshot not stored there yet is pinned and stored first; 500 when
    that fails)."""
    snap = await _snapshot_row(ctx, who, template_id)
    lease = timeout if timeout is not None else ctx.settings.lease_s
    if snap["kind"] == "disk" and snap["promotion"] != PromotionState.PROMOTED:
        error = await _pin_and_promote(ctx, snap["id"], snap["sandbox_id"])
        if error is not None:
            return error_body(500, f"cannot start a sandbox from snapshot {snap['id']}: {error}")
    if snap["kind"] == "disk" or snap["source_state"] not in (SandboxState.RUNNING, SandboxState.PAUSED):
        return await _wake_from_stored(ctx, who, snap, lease)
    row = await _row(ctx, who, snap["sandbox_id"])
    [result] = await _fork(ctx, who, row, 1, lease, snap["id"])
    if "error" in result:
        return error_body(500, result["error"]["message"])
    return JSONResponse(result["sandbox"], status_code=201)


async def _wake_from_stored(ctx: ApiContext, who: Principal, snap: Any, lease: int) -> JSONResponse:
    """A new sandbox from a promoted snapshot: a full one whose source is not running (killed, or
    suspended), or a disk one (the node then boots the sandbox afresh on its disk). Its row is inserted
    ``suspended`` at that snapshot (the source's template, size, metadata and egress policy; its own
    hostname and credential placeholders) and resumed from object storage like any suspended sandbox, so
    the node's after-restore hygiene gives it its own identity -> 201 ``Sandbox``; 500 (and the row
    deleted) when the wake fails or does not finish within the resume bound."""
    src = snap["sandbox_id"]
    cid = new_id("sbx")
    async with ctx.pool.acquire() as conn, conn.transaction():
        # The name the tenant gave the template (sandboxes.template is its key).
        template = await sandbox_lookup.template_name_of(conn, src)
        assert template is not None  # src is the source of a usable snapshot: its row is there (rows stay)
        await lifecycle.insert(
            conn, SandboxState.SUSPENDED,
            {"id": cid, "tenant_id": who.tenant_id, "parent_sandbox_id": src, "source_snapshot_id": snap["id"]},
            exprs={"template": "p.template", "template_digest": "p.template_digest", "generation": "1",
                   "memory_mib": "p.memory_mib", "vcpus": "p.vcpus", "metadata": "p.metadata",
                   "suspended_snapshot_id": "{source_snapshot_id}", "egress_policy": "p.egress_policy",
                   "guest_env": GUEST_ENV_SQL.format(tenant="{tenant_id}", sandbox="{id}", template="p.template")},
            select_from="sandboxes p WHERE p.id = {parent_sandbox_id}",
            event=SandboxEvent(EventType.CREATED, tenant_id=who.tenant_id, data={"parent": src, "snapshot_id": snap["id"]}))
    ctx.relay.kick()
    await _copy_e2b_row(ctx, src, [cid])
    try:
        info, finished = await sandbox_service.resume_suspended(ctx, who, cid, wait=True, fallback=False)
        error = None if finished and info.state == "running" else f"the sandbox is still {info.state}"
    except QuotaExceeded:
        # Over a quota (services/api/services/quotas.py): the caller's to fix, so its own 403, not a 500. The row
        # never left ``suspended``, so it is deleted as it is.
        await sandbox_service.delete(ctx, who, cid, wait=False)
        raise
    except PodbayError as exc:
        error = exc.message
    if error is not None:
        try:
            await sandbox_service.delete(ctx, who, cid, wait=False)
        except PodbayError:  # in a state a delete is refused in (still resuming): its lease, ending now, does it
            await expire_lease(ctx.pool, cid, "delete")
        return error_body(500, f"cannot start a sandbox from snapshot {snap['id']}: {error}")
    await _exact_lease(ctx, who, cid, lease)
    return JSONResponse(_sandbox(ctx, cid, template), status_code=201)


async def _pin_and_promote(ctx: ApiContext, snapshot_id: str, sandbox_id: str) -> str | None:
    """Pin ``snapshot_id`` and have the snapshotter of its node promote it to object storage, waiting until
    it is (bounded by ``suspend_timeout_s``) -> None, or why not (the pin is then taken back: the snapshot
    serves while its source lives, as podbay's own snapshots do)."""
    node_id = await snapshot_state.pin(ctx.pool, snapshot_id)
    await ctx.bus.publish_command(subjects.snapshotter_promote(node_id),
                                  PromoteCmd(snapshot_id=snapshot_id, sandbox_id=sandbox_id, reason="request"),
                                  msg_id=f"promote.{snapshot_id}")
    deadline = time.monotonic() + ctx.settings.suspend_timeout_s
    error = f"it was not stored in object storage within {ctx.settings.suspend_timeout_s:.0f} s"
    while time.monotonic() < deadline:
        r = await snapshot_service.promotion_of(ctx.pool, snapshot_id)
        assert r is not None  # pinned above: its row is there
        if r["promotion"] == PromotionState.PROMOTED:
            return None
        if r["promotion"] == PromotionState.FAILED:
            error = f"storing it in object storage failed: {r['promotion_error']}"
            break
        await asyncio.sleep(PROMOTION_POLL_S)
    await snapshot_state.unpin(ctx.pool, snapshot_id)
    return error


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def create_snapshot(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: SnapshotBody | None = None
                          ) -> JSONResponse:
    """Snapshot a running or paused sandbox: full (memory and disk; the guest is paused meanwhile) unless
    ``memory`` is false (disk only) -> 201 ``SnapshotInfo``; with ``name`` the snapshot takes that name
    (from an earlier snapshot that had it) and its ``snapshotID`` is the name."""
    await _row(ctx, who, sandbox_id)
    kind = "disk" if body is not None and body.memory is False else "full"
    info, _ = await snapshot_service.take(ctx, who, sandbox_id, SnapshotCreate(kind=kind), wait=True)
    if info.state != "ready":
        return error_body(500, f"snapshot {info.id} of {sandbox_id} is {info.state}: {info.error or 'not ready'}")
    error = await _pin_and_promote(ctx, info.id, sandbox_id)
    if error is not None:
        return error_body(500, f"snapshot {info.id} of {sandbox_id} would not outlive the sandbox: {error}")
    name = body.name.split(":", 1)[0] if body is not None and body.name else None
    if name:
        if is_snapshot_id(name):
            raise InvalidRequest("a snapshot name must not start with snap_ (podbay's snapshot ids do)")
        await snapshot_service.name_snapshot(ctx.pool, who.tenant_id, name, info.id)
    return JSONResponse(_snapshot_info(info.id, name), status_code=201)


@router.get("/snapshots")
async def list_snapshots(ctx: CtxDep, who: WhoDep, sandbox_id: str | None = Query(None, alias="sandboxID"),
                         name: str | None = Query(None, max_length=256),
                         limit: int = Query(100, ge=1, le=1000),
                         next_token: str | None = Query(None, alias="nextToken")) -> JSONResponse:
    """The caller's usable snapshots (pinned ones, also of killed sandboxes; others of sandboxes that run or
    are paused), newest first, ``limit`` per page (next page's token in ``x-next-token``). ``sandboxID``
    keeps those of one source sandbox; ``name`` (E2B's ``Sandbox.list_snapshots(name=...)``: a snapshot
    name or id, optionally with E2B's ``project/`` prefix and ``:tag``) keeps the snapshot it names."""
    cursor = decode_cursor(next_token)
    # E2B's names are ``[slug/]name[:tag]``; podbay keeps one name per snapshot, without slug or tag.
    wanted = name.split(":", 1)[0].rsplit("/", 1)[-1] if name else None
    # sandboxID in either spelling (podbay.naming.e2b_sandbox_id).
    rows = await snapshot_service.usable_page(
        ctx.pool, who.tenant_id, sandbox_id=sandbox_id and (sandbox_id_from_e2b(sandbox_id) or sandbox_id),
        name=wanted, limit=limit + 1, cursor=cursor)
    token = None
    if len(rows) > limit:
        last = rows[limit - 1]
        token = encode_cursor(last["created_at"], last["id"])
        rows = rows[:limit]
    return JSONResponse([_snapshot_info(r["id"], r["name"]) for r in rows], headers={"x-next-token": token} if token else None)


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(template_id: str, ctx: CtxDep, who: WhoDep) -> Response:
    """Delete a snapshot -> 204: it is no longer listed nor usable (its local files go with its source
    sandbox's retention or deletion, its chunks in object storage at the snapshotter's next collection);
    404 when the caller has no such snapshot. An id that names no snapshot (neither ``snap_...`` nor a
    snapshot name of the caller's) is a template: ``e2b_template_admin.delete_template`` removes it."""
    if await resolve_snapshot(ctx, who, template_id) is None:
        await e2b_template_admin.delete_template(ctx, who, template_id)
        return Response(status_code=204)
    snap = await _snapshot_row(ctx, who, template_id)
    if await snapshot_service.starting_from(ctx.pool, snap["id"]):
        raise Conflict(f"snapshot {snap['id']} is being used to start a sandbox; retry shortly")
    await snapshot_service.delete_named(ctx.pool, snap["id"])
    return Response(status_code=204)
