"""E2B's sandbox REST API, mounted at ``/e2b``: the unmodified ``e2b`` SDK works against podbay with
``E2B_API_URL=<api>/e2b`` (docs/e2b.md).

Paths, JSON fields and status codes follow the endpoints the pinned SDK calls (v1 and v2):

    POST /sandboxes, /v2/sandboxes                 201 Sandbox          create (waits until it runs)
    GET  /sandboxes, /v2/sandboxes                 200 [ListedSandbox]  list; v2: state, metadata, limit, nextToken
    GET  /sandboxes/{id}                           200 SandboxDetail
    DELETE /sandboxes/{id}                         204                  kill
    POST /sandboxes/{id}/timeout                   204                  {"timeout": s}: lease from now
    POST /sandboxes/{id}/refreshes                 204                  {"duration": s}: lease from now
    POST /sandboxes/{id}/pause                     204                  409 when already paused
    POST /sandboxes/{id}/resume                    201 Sandbox          (deprecated by E2B) resume a paused one
    POST /sandboxes/{id}/connect, /v2/.../connect  200 running, 201 resumed; Sandbox  {"memory": false}: reboot
    GET  /sandboxes/{id}/metrics                   200 [SandboxMetric]  one sample taken now

``envVars`` of a create are kept in ``e2b_sandboxes`` and become the default environment of every command
started through envd (the envd proxy passes them to the node). ``X-API-KEY`` carries a podbay API key. Errors
are E2B's ``{"code": <HTTP status>, "message"}``. Each sandbox's envd access token is an HMAC of its id with
the internal token, so no token is stored and the envd proxy (``e2b_envd.py``) recomputes it. The routes stay
out of podbay's OpenAPI document: they are E2B's contract, not podbay's.
"""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError

from podbay.contracts.api import RestoreRequest, SandboxCreate, SnapshotCreate
from podbay.contracts.states import SandboxCommand, SandboxState
from podbay.errors import Conflict, InvalidRequest, InvalidState, NotFound, Unavailable
from podbay.grants import GrantKind
from podbay.naming import e2b_sandbox_id

from .. import nodes_client
from ..services import sandbox_lookup, sandbox_service, snapshot_service, template_access
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep
from .common import CLIENT_ID, decode_cursor, encode_cursor, E2B_STATES, ENVD_VERSION, WhoDep, _Body, _E2bRoute, _exact_lease, _iso, _row, _sandbox, envd_access_token, error_body
from .network import check_placeholders, egress_policy, iam_tokens, network_info, store_network
from .snapshots import create_from_snapshot, resolve_snapshot
from .volumes import VolumeMountBody, volume_mounts
from ..services.ports import e2b_traffic

__all__ = ["router", "fallback_router", "envd_access_token", "ENVD_VERSION", "error_body", "E2B_STATES", "parse_metrics"]

# How many metrics samples of a sandbox are kept (one is taken per metrics call, at most one per second).
METRICS_KEEP = 360


router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
# Included after every other /e2b router (app.py): an unknown path answers E2B's 404 body, so the SDK raises
# its NotFoundException rather than failing to read podbay's error shape.
fallback_router = APIRouter(prefix="/e2b", include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]


class NewSandbox(_Body):
    """E2B's ``NewSandbox`` / ``NewSandboxV2`` (``secure`` is accepted and ignored: podbay always secures envd
    with the access token; ``mcp``, E2B's {server name: settings}, is the SDK's to pass to the ``mcp-gateway``
    command of the template of that name (templates/mcp-gateway), not the API's, so any JSON object is accepted;
    ``iam.tokens`` are workload identity tokens the gateway mints, e2b_network.iam_tokens)."""

    template_id: str = Field(alias="templateID", min_length=1, max_length=128)
    timeout: int | None = Field(None, ge=0, le=30 * 86400, description="Seconds until the lease runs out.")
    auto_pause: bool = Field(False, alias="autoPause")
    # false: the pause at the timeout drops memory (SDK ``on_timeout={"action": "pause", "mode": "filesystem"}``).
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: dict[str, Any] | None = Field(None, alias="autoResume", description="{\"enabled\": bool}")
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars", max_length=256)
    # network.allowPublicTraffic (false: ports need trafficAccessToken) and maskRequestHost go to the port
    # edge; allowOut/denyOut/rules and allow_internet_access become the egress policy (e2b_network.py, which
    # refuses what podbay does not do).
    network: dict[str, Any] | None = None
    allow_internet_access: bool | None = None
    # [{"name", "path"}]: podbay volumes mounted read-write (e2b/volumes.py); the sandbox goes to their node.
    volume_mounts: list[VolumeMountBody] | None = Field(None, alias="volumeMounts", max_length=16)
    # E2B's API takes an object or null here; the SDK itself starts the gateway in the sandbox with it.
    mcp: Any = None
    # {"tokens": {name: {"audience", "tokenType"}}}: checked by e2b_network.iam_tokens, read by the gateway.
    iam: Any = None


def _empty(value: Any) -> bool:
    """None, or a list or mapping holding nothing but empty values (``{}``, ``{"tokens": {}}``)."""
    if value is None:
        return True
    if isinstance(value, dict):
        return all(_empty(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return False


def _refuse_unsupported(body: NewSandbox) -> None:
    """400 for create fields podbay cannot honour (E2B's error shape, through the route class): an ``mcp`` that
    is not a JSON object (E2B's type: an object or null); ``autoResume`` with a filesystem-only auto-pause, which E2B refuses too (traffic
    cannot cold-boot a sandbox)."""
    if body.mcp is not None and not isinstance(body.mcp, dict):
        raise InvalidRequest("mcp must be a JSON object: {MCP server name: its settings}")
    if body.auto_pause and body.auto_pause_memory is False and body.auto_resume and body.auto_resume.get("enabled"):
        raise InvalidRequest("autoResume cannot be combined with autoPauseMemory: false (a filesystem-only "
                             "auto-pause is resumed by connect only)")


class TimeoutBody(_Body):
    timeout: int = Field(ge=0, le=30 * 86400)


class RefreshBody(_Body):
    duration: int | None = Field(None, ge=0, le=3600)


class ConnectBody(_Body):
    timeout: int | None = Field(None, ge=0, le=30 * 86400)
    # connect(on_resume="reboot"): false boots a paused sandbox afresh from its disk instead of its memory.
    memory: bool | None = None


def _lease(timeout: int | None, ctx: ApiContext) -> int:
    """The lease podbay's own create accepts (its floor is 10 s); ``_exact_lease`` then sets a shorter one."""
    return max(10, timeout) if timeout is not None else ctx.settings.lease_s


def _listed(row: Any) -> dict[str, Any]:
    return {"templateID": row["template"], "alias": row["template"], "sandboxID": e2b_sandbox_id(row["id"]),
            "clientID": CLIENT_ID,
            "startedAt": _iso(row["created_at"]), "endAt": _iso(row["lease_expires_at"]),
            "cpuCount": row["vcpus"], "memoryMB": row["memory_mib"], "diskSizeMB": 0,
            "state": E2B_STATES[row["state"]], "envdVersion": ENVD_VERSION, "metadata": row["metadata"] or {}}


#: E2B's template names that its SDKs ask for and that mean, on E2B's API, a podbay template of another name:
#: E2B's desktop SDK creates ``desktop`` and drives it as E2B's desktop (XFCE, started by the SDK), while
#: podbay's own ``desktop`` is another layout (templates/desktop/Dockerfile); the E2B one is ``e2b-desktop``
#: (templates/e2b-desktop/Dockerfile, docs/computer-use.md "E2B's desktop SDK").
E2B_TEMPLATE_NAMES = {"desktop": "e2b-desktop"}


async def e2b_template_name(ctx: ApiContext, who: Principal, name: str) -> str:
    """The podbay template name that E2B's ``templateID`` ``name`` means to ``who``: the caller's own template
    of that name if it has one (its own build comes first, as everywhere), else the name in
    :data:`E2B_TEMPLATE_NAMES` when ``who`` sees a template of it, else ``name`` itself."""
    alt = E2B_TEMPLATE_NAMES.get(name)
    if alt is None:
        return name
    own = await template_access.resolve(ctx.pool, who, name)
    if own is not None and own["owner_tenant"] is not None:
        return name
    return alt if await template_access.resolve(ctx.pool, who, alt) is not None else name


async def _create(body: NewSandbox, ctx: ApiContext, who: Principal) -> JSONResponse:
    _refuse_unsupported(body)
    tokens = iam_tokens(body.iam)  # checked before anything is looked up, as the other refusals
    if await resolve_snapshot(ctx, who, body.template_id):  # Sandbox.create(snapshot id or name)
        return await create_from_snapshot(body.template_id, body.timeout, ctx, who)
    policy = egress_policy(body.allow_internet_access, body.network)
    check_placeholders(policy, tokens)
    template = await e2b_template_name(ctx, who, body.template_id)
    try:
        req = SandboxCreate(template=template, metadata=body.metadata or {},
                            lease_s=_lease(body.timeout, ctx), on_lease_expiry="pause" if body.auto_pause else "delete",
                            network=policy, volumes=volume_mounts(body.volume_mounts))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"{where}: {first.get('msg', 'invalid')}") from exc
    info, _ = await sandbox_service.create(ctx, who, req, wait=True)
    auto_resume = bool(body.auto_pause and body.auto_resume and body.auto_resume.get("enabled"))
    # Read by the node when the lease runs out: a disk snapshot first, then the pause, and the next connect
    # boots afresh from it (services/nodeagent/storage/snapshots.py filesystem_pause_point).
    fs_pause = body.auto_pause and body.auto_pause_memory is False
    if body.env_vars or auto_resume or fs_pause:
        await sandbox_lookup.insert_e2b_settings(ctx.pool, info.id, env_vars=body.env_vars or {},
                                                 auto_resume=auto_resume, auto_pause_filesystem=fs_pause)
    if body.network or tokens:  # kept for get_info, and the tokens for the gateway (e2b_network.py)
        network = dict(body.network or {})
        if body.allow_internet_access is False:
            network["denyOut"] = [*(network.get("denyOut") or []), "0.0.0.0/0"]
        await store_network(ctx.pool, info.id, network, tokens)
    if body.timeout is not None and body.timeout < 10:
        await _exact_lease(ctx, who, info.id, body.timeout)
    out = _sandbox(ctx, info.id, info.template)
    out.update(await e2b_traffic(ctx, info.id, body.network))  # services/api/services/ports.py
    return JSONResponse(out, status_code=201)


@router.post("/sandboxes")
async def create_v1(body: NewSandbox, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Create a sandbox from ``templateID`` and wait until it runs -> 201 ``Sandbox``."""
    return await _create(body, ctx, who)


@router.post("/v2/sandboxes")
async def create_v2(body: NewSandbox, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Create a sandbox (v2 body) -> 201 ``Sandbox``."""
    return await _create(body, ctx, who)


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """E2B's metadata query: url-encoded ``k=v&k2=v2``."""
    return dict(urllib.parse.parse_qsl(raw, keep_blank_values=True)) if raw else {}


class ListFilter(BaseModel):
    """What a listing asks for beyond the caller: E2B states, metadata subset, template (id or alias: the
    same in podbay), started at or after, order by start time."""

    states: list[str]
    metadata: dict[str, str] = {}
    template: str | None = None
    started_after: datetime | None = None
    ascending: bool = False


def _started_after(raw: str | None) -> datetime | None:
    """``startedAfter`` (RFC 3339; a naive time is UTC) -> aware datetime; ``InvalidRequest`` when unparsable."""
    if not raw:
        return None
    try:
        ts = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError as exc:
        raise InvalidRequest("startedAfter must be an RFC 3339 date-time") from exc
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


async def _list(ctx: ApiContext, who: Principal, flt: ListFilter, limit: int,
                cursor: tuple[datetime, str] | None) -> tuple[list[dict[str, Any]], str | None]:
    podbay_states = [s for s, e in E2B_STATES.items() if e in flt.states]
    # ``template``: the name the tenant gave (templates.alias); sandboxes.template is the template's key.
    rows = await sandbox_lookup.e2b_page(ctx.pool, who.tenant_id, podbay_states, metadata=flt.metadata,
                                         template=flt.template, started_after=flt.started_after,
                                         ascending=flt.ascending, limit=limit + 1, cursor=cursor)
    token = None
    if len(rows) > limit:
        last = rows[limit - 1]
        token = encode_cursor(last["created_at"], last["id"])
        rows = rows[:limit]
    return [_listed(r) for r in rows], token


@router.get("/sandboxes")
async def list_v1(ctx: CtxDep, who: WhoDep, metadata: str | None = Query(None)) -> JSONResponse:
    """Running sandboxes of the caller (v1: no pagination) -> 200 ``[ListedSandbox]``."""
    items, _ = await _list(ctx, who, ListFilter(states=["running"], metadata=_metadata_filter(metadata)), 1000, None)
    return JSONResponse(items)


@router.get("/v2/sandboxes")
async def list_v2(ctx: CtxDep, who: WhoDep, metadata: str | None = Query(None), state: str | None = Query(None),
                  limit: int = Query(100, ge=1, le=1000), next_token: str | None = Query(None, alias="nextToken"),
                  order: str | None = Query(None), started_after: str | None = Query(None, alias="startedAfter"),
                  template: str | None = Query(None)) -> JSONResponse:
    """Sandboxes by state (``running,paused`` by default), ``template``, start time (``startedAfter``),
    ordered by start time (``order``: ``desc``, the default, or ``asc``), ``limit`` per page; the next page's
    token is in the ``x-next-token`` header."""
    states = [s for s in (state or "running,paused").split(",") if s]
    if not states or any(s not in ("running", "paused") for s in states):
        raise InvalidRequest("state must list running and/or paused")
    if order not in (None, "asc", "desc"):
        raise InvalidRequest("order must be asc or desc")
    flt = ListFilter(states=states, metadata=_metadata_filter(metadata), template=template or None,
                     started_after=_started_after(started_after), ascending=order == "asc")
    items, token = await _list(ctx, who, flt, limit, decode_cursor(next_token))
    return JSONResponse(items, headers={"x-next-token": token} if token else None)


@router.get("/sandboxes/{sandbox_id}")
async def get_info(sandbox_id: str, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """One sandbox -> 200 ``SandboxDetail``; 404 unless running or paused."""
    row = await _row(ctx, who, sandbox_id)
    detail = _listed(row)
    detail["envdAccessToken"] = envd_access_token(ctx.settings.internal_token, sandbox_id)
    if ctx.settings.e2b_domain:
        detail["domain"] = ctx.settings.e2b_domain
    network = network_info(await sandbox_lookup.e2b_network(ctx.pool, sandbox_id))
    if network is not None:
        detail["network"] = network
    return JSONResponse(detail)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, ctx: CtxDep, who: WhoDep) -> Response:
    """Delete the sandbox -> 204; 404 when it does not exist (or is already gone)."""
    await _row(ctx, who, sandbox_id)
    await sandbox_service.delete(ctx, who, sandbox_id, wait=True)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, ctx: CtxDep, who: WhoDep) -> Response:
    """The sandbox's lease now runs out ``timeout`` seconds from now (shorter or longer) -> 204."""
    await _row(ctx, who, sandbox_id)
    await _exact_lease(ctx, who, sandbox_id, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: RefreshBody | None = None) -> Response:
    """Keep the sandbox alive ``duration`` seconds more (default: its lease length) -> 204."""
    row = await _row(ctx, who, sandbox_id)
    await _exact_lease(ctx, who, sandbox_id, body.duration if body and body.duration else int(row["lease_s"] or 0))
    return Response(status_code=204)


class PauseBody(_Body):
    memory: bool | None = Field(None, description="false: filesystem-only (the next connect boots afresh).")


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: PauseBody | None = None) -> Response:
    """Pause a running sandbox (memory and processes kept) -> 204; 409 when it is already paused. With
    ``memory: false`` (E2B's filesystem-only pause) a disk snapshot is taken first and the next connect boots
    the sandbox afresh from it (a podbay restore): files kept, processes and memory not."""
    row = await _row(ctx, who, sandbox_id)
    if E2B_STATES[row["state"]] == "paused":
        raise InvalidState(f"sandbox {sandbox_id} is already paused", details={"state": row["state"]})
    cold: str | None = None
    if body is not None and body.memory is False:
        snap, _ = await snapshot_service.take(ctx, who, sandbox_id, SnapshotCreate(kind="disk"), wait=True)
        if snap.state != "ready":
            raise Unavailable(f"the filesystem snapshot of {sandbox_id} is {snap.state}: {snap.error or 'not ready'}")
        cold = snap.id
    await sandbox_service.pause(ctx, who, sandbox_id, wait=True)
    await sandbox_lookup.set_cold_resume(ctx.pool, sandbox_id, cold)
    return Response(status_code=204)


async def _wake(ctx: ApiContext, who: Principal, sandbox_id: str, *, reboot: bool = False) -> None:
    """Resume a paused sandbox: from memory, or, after a filesystem-only pause, a fresh boot from its disk
    snapshot (when that snapshot is gone, from memory after all). With ``reboot`` (E2B's
    ``on_resume="reboot"``) a sandbox paused with its memory boots afresh too, from a disk snapshot taken
    now (a suspended one, whose disk is in object storage only, resumes from memory). That snapshot is taken
    from the running guest, resumed for it, so that the freeze writes its page cache back: a paused guest's
    last writes may be in its memory only."""
    cold = await sandbox_lookup.cold_resume_snapshot(ctx.pool, sandbox_id)
    if reboot and cold is None and await sandbox_lookup.sandbox_state(ctx.pool, sandbox_id) == SandboxState.PAUSED:
        await sandbox_service.resume(ctx, who, sandbox_id, wait=True)
        snap, _ = await snapshot_service.take(ctx, who, sandbox_id, SnapshotCreate(kind="disk"), wait=True)
        if snap.state != "ready":
            raise Unavailable(f"the disk snapshot of {sandbox_id} to reboot from is {snap.state}: "
                              f"{snap.error or 'not ready'}")
        cold = snap.id
    if cold is not None:
        await sandbox_lookup.clear_cold_resume(ctx.pool, sandbox_id)
        try:
            await snapshot_service.restore(ctx, who, sandbox_id, RestoreRequest(snapshot_id=cold), wait=True)
            return
        except (NotFound, InvalidState, Conflict):
            pass  # reclaimed by retention, or a state restore refuses: resume its memory instead
    state = await sandbox_lookup.sandbox_state(ctx.pool, sandbox_id)
    if state is not None and state != SandboxState.RUNNING:
        await sandbox_service.resume(ctx, who, sandbox_id, wait=True)


async def _connect(sandbox_id: str, body: ConnectBody | None, ctx: ApiContext, who: Principal) -> JSONResponse:
    """Resume a paused (or suspended) sandbox, from its memory unless ``memory`` is false (a fresh boot from
    its disk; nothing changes for a running one); ``timeout`` sets a resumed sandbox's lease and only
    extends a running one's, as E2B's connect does."""
    body = body or ConnectBody()
    row = await _row(ctx, who, sandbox_id)
    status = 200
    if E2B_STATES[row["state"]] == "paused":
        await _wake(ctx, who, sandbox_id, reboot=body.memory is False)
        status = 201
    if body.timeout is not None:
        await _exact_lease(ctx, who, sandbox_id, body.timeout, only_extend=status == 200)
    return JSONResponse(_sandbox(ctx, sandbox_id, row.get("template_alias") or row["template"]), status_code=status)


@router.post("/sandboxes/{sandbox_id}/connect")
async def connect_v1(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: ConnectBody | None = None) -> JSONResponse:
    """Connect to a sandbox, resuming it when paused -> 200 (was running) or 201 (resumed) ``Sandbox``."""
    return await _connect(sandbox_id, body, ctx, who)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_v2(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: ConnectBody | None = None) -> JSONResponse:
    """As ``/sandboxes/{id}/connect``."""
    return await _connect(sandbox_id, body, ctx, who)


@router.post("/sandboxes/{sandbox_id}/resume")
async def resume(sandbox_id: str, ctx: CtxDep, who: WhoDep, body: ConnectBody | None = None) -> JSONResponse:
    """Resume a paused sandbox -> 201 ``Sandbox``; 409 when it is not paused."""
    row = await _row(ctx, who, sandbox_id)
    if E2B_STATES[row["state"]] != "paused":
        raise InvalidState(f"sandbox {sandbox_id} is not paused", details={"state": row["state"]})
    return await _connect(sandbox_id, body, ctx, who)


# One sample of the guest's own counters: CPU over 0.2 s from /proc/stat, memory from /proc/meminfo, the root
# filesystem from df. Output: "cpus busy total memtotal_kib memavail_kib cached_kib disk_used disk_total".
_METRICS_SCRIPT = (
    "read -r _ a b c d e f g h _ < /proc/stat; sleep 0.2; read -r _ A B C D E F G H _ < /proc/stat; "
    "busy=$(( (A+B+C+F+G+H) - (a+b+c+f+g+h) )); total=$(( busy + (D+E) - (d+e) )); "
    "mt=$(awk '/^MemTotal:/{print $2}' /proc/meminfo); ma=$(awk '/^MemAvailable:/{print $2}' /proc/meminfo); "
    "ca=$(awk '/^Cached:/{print $2}' /proc/meminfo); set -- $(df -B1 --output=used,size / | tail -1); "
    "echo $(nproc) $busy $total $mt $ma $ca $1 $2"
)


def parse_metrics(line: str, now: datetime) -> dict[str, Any]:
    """A ``SandboxMetric`` from the metrics script's output line (bytes, percent of all vCPUs)."""
    cpus, busy, total, mem_total, mem_avail, cached, disk_used, disk_total = (int(x) for x in line.split())
    return {"timestamp": _iso(now), "timestampUnix": int(now.timestamp()), "cpuCount": cpus,
            "cpuUsedPct": round(100.0 * busy / total, 2) if total > 0 else 0.0,
            "memUsed": (mem_total - mem_avail) * 1024, "memTotal": mem_total * 1024, "memCache": cached * 1024,
            "diskUsed": disk_used, "diskTotal": disk_total}


async def _sample(ctx: ApiContext, who: Principal, sandbox_id: str) -> dict[str, Any]:
    """One metrics sample taken now in the guest (``Unavailable`` when the node or guest does not answer)."""
    base, gen = await nodes_client.target(ctx, who, sandbox_id, SandboxCommand.EXEC)
    try:
        resp = await ctx.nodes_http.post(
            f"{base}/internal/v1/sandboxes/{sandbox_id}/exec",
            json={"shell": _METRICS_SCRIPT, "timeout_s": 10},
            headers=ctx.node_headers(who.tenant_id, sandbox_id, gen, GrantKind.EXEC))
    except httpx.HTTPError as exc:
        raise Unavailable("the sandbox's node did not answer; retry shortly") from exc
    result = resp.json() if resp.status_code == 200 else {}
    try:
        return parse_metrics(str(result.get("stdout", "")), datetime.now(UTC))
    except ValueError as exc:
        raise Unavailable("the guest did not report its metrics") from exc


def _unix(raw: int | None) -> datetime | None:
    return datetime.fromtimestamp(raw, UTC) if raw is not None else None


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, ctx: CtxDep, who: WhoDep, start: int | None = Query(None, ge=0),
                  end: int | None = Query(None, ge=0)) -> JSONResponse:
    """The sandbox's metrics samples from ``start`` to ``end`` (unix seconds, both inclusive; default: all
    kept), oldest first -> 200 ``[SandboxMetric]``. A running sandbox is sampled now (CPU over 0.2 s) unless
    it was sampled within the last second; the newest ``METRICS_KEEP`` samples are kept. A paused sandbox
    answers the samples kept so far."""
    row = await _row(ctx, who, sandbox_id)
    if row["state"] == SandboxState.RUNNING and not await sandbox_lookup.sampled_within_a_second(ctx.pool, sandbox_id):
        sample = await _sample(ctx, who, sandbox_id)
        # The newest METRICS_KEEP - 1 kept before this one, so METRICS_KEEP with it.
        await sandbox_lookup.add_metrics_sample(
            ctx.pool, sandbox_id, datetime.fromisoformat(sample["timestamp"].replace("Z", "+00:00")), sample,
            keep=METRICS_KEEP - 2)
    return JSONResponse(await sandbox_lookup.metrics_samples(ctx.pool, sandbox_id, _unix(start), _unix(end)))


@fallback_router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def unknown(path: str) -> JSONResponse:
    """Any other ``/e2b`` path -> 404 in E2B's shape."""
    return error_body(404, f"/{path} was not found: podbay does not serve this E2B route")
