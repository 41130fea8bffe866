"""Exec and file endpoints: authorised and state-checked here, then proxied to the sandbox's node.

The node agent's data plane (``/internal/v1/sandboxes/{id}/...``) speaks the same bodies as these routes,
so the API streams requests and responses through without re-encoding. Every call carries a fresh grant
(podbay.grants) for the caller's tenant, this sandbox, its generation and the kind of operation; the node
refuses anything else (403 ``grant_refused``), and a stale placement with 409 ``stale_generation``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

import aiohttp
import httpx
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from podbay.contracts import subjects
from podbay.contracts.api import ErrorBody, ExecRequest, ExecResult, FileInfo, FileList
from podbay.contracts.states import SandboxCommand, check_allowed
from podbay.contracts.messages import Event
from podbay.errors import NotFound, Unavailable
from podbay.grants import GrantKind
from podbay.lifecycle import renew_lease_sql
from podbay.outbox import new_id
from podbay.telemetry import HOP_SECONDS

from . import sandbox_service
from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep, principal_dep

__all__ = ["router", "proxy", "target", "lookup", "exec_body"]

log = logging.getLogger("podbay.api.dataplane")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


async def _auto_resume(sandbox_id: str, ctx: CtxDep, who: PrincipalDep,
                       auto_resume: bool = Query(False, description="Resume a suspended or paused sandbox first "
                                                 "(waits for it, bounded).")) -> None:
    if auto_resume:
        await sandbox_service.auto_resume(ctx, who, sandbox_id)


router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", dependencies=[Depends(_auto_resume)])

_PASS_HEADERS = ("content-type", "content-length", "content-disposition", "x-podbay-file-size")


_RENEW = ("WITH s AS (" + renew_lease_sql(where="tenant_id = $2 AND state = 'running'",
                                          returning="id, state, generation, node_id, guest_env") + ")")
_SELECT = " SELECT s.state, s.generation, s.guest_env, n.dataplane_url FROM s LEFT JOIN nodes n ON n.id = s.node_id"
_LOOKUP_SQL = _RENEW + _SELECT
#: As _LOOKUP_SQL, plus what podbay.audit.record writes (the audit row, and its event with the row id).
_LOOKUP_AUDIT_SQL = (
    _RENEW + ","
    " a AS (INSERT INTO audit_log (tenant_id, actor, action, target, sandbox_id, detail)"
    "       SELECT $2, $3, $4, s.id, s.id, $5::jsonb FROM s RETURNING id),"
    " e AS (INSERT INTO outbox (event_id, subject, payload)"
    "       SELECT $6, $7, jsonb_set($8::jsonb, '{data,audit_id}', to_jsonb(a.id)) FROM a)" + _SELECT)


async def _lookup(ctx: ApiContext, who: Principal, sandbox_id: str, command: SandboxCommand,
                  audit_action: str | None = None,
                  audit_detail: dict[str, Any] | None = None) -> tuple[str, int, dict[str, str]]:
    """(node data-plane URL, generation, credential placeholder env) of a running sandbox of the caller's
    tenant. With ``audit_action`` (e.g. ``sandbox.exec``) the call is audited when the sandbox runs."""
    t = time.perf_counter()
    # Every data-plane call renews the lease, in the same round trip as the lookup; a changing one (exec, file
    # writes) also appends its audit row and event there, so auditing costs no extra round trip.
    if audit_action is None:
        row = await ctx.pool.fetchrow(_LOOKUP_SQL, sandbox_id, who.tenant_id)
    else:
        event = Event(id=new_id("evt"), type=audit_action, sandbox_id=sandbox_id, tenant_id=who.tenant_id,
                      at=datetime.now(UTC), data={"audit_id": 0, "actor": who.key_id, "target": sandbox_id,
                                                  **(audit_detail or {})})
        row = await ctx.pool.fetchrow(_LOOKUP_AUDIT_SQL, sandbox_id, who.tenant_id, who.key_id, audit_action,
                                      audit_detail or {}, event.id, subjects.audit_event(who.tenant_id, audit_action),
                                      json.loads(event.model_dump_json()))
        if row is not None:
            ctx.relay.kick()
    if row is None:
        row = await ctx.pool.fetchrow(
            "SELECT s.state, s.generation, s.guest_env, n.dataplane_url FROM sandboxes s"
            " LEFT JOIN nodes n ON n.id = s.node_id WHERE s.id = $1 AND s.tenant_id = $2", sandbox_id, who.tenant_id)
    HOP_SECONDS.labels("api", "db").observe(time.perf_counter() - t)
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} does not exist", details={"sandbox_id": sandbox_id})
    check_allowed(command, row["state"])
    if not row["dataplane_url"]:
        raise Unavailable(f"sandbox {sandbox_id} has no node")
    return str(row["dataplane_url"]), int(row["generation"]), dict(row["guest_env"] or {})


async def _target(ctx: ApiContext, who: Principal, sandbox_id: str, command: SandboxCommand) -> tuple[str, int]:
    """(node data-plane URL, generation) of a running sandbox of the caller's tenant."""
    base, gen, _ = await _lookup(ctx, who, sandbox_id, command)
    return base, gen


def _exec_detail(body: ExecRequest) -> dict[str, Any]:
    """What the audit row keeps of an exec: the program, not its arguments or env (they may hold data)."""
    return {"program": (body.argv[0] if body.argv else "/bin/sh")[:256], "shell": body.shell is not None}


def _exec_body(body: ExecRequest, guest_env: dict[str, str]) -> dict[str, object]:
    """The node's exec body: the sandbox's credential placeholders (``PODBAY_CRED_*``, fixed at create) under
    the request's own env, which wins."""
    out = body.model_dump(exclude_none=True)
    if guest_env:
        out["env"] = {**guest_env, **body.env}
    return out


async def _proxy(ctx: ApiContext, request: Request, url: str, generation: int, *, method: str,
                 tenant: str, subject: str, kind: GrantKind,
                 params: dict[str, str] | httpx.QueryParams | None = None, json_body: object | None = None,
                 stream_body: bool = False, stream_response: bool = False,
                 extra_headers: dict[str, str] | None = None,
                 pass_headers: tuple[str, ...] = _PASS_HEADERS) -> Response:
    """One call to a node's data plane at ``url`` (built by the caller from parsed parts), with a grant for
    ``tenant``'s ``kind`` operation on ``subject`` (the sandbox id) at ``generation``; the node's status, body
    and ``pass_headers`` go back. Unavailable (retryable) when the node does not answer."""
    headers = {**(extra_headers or {}), **ctx.node_headers(tenant, subject, generation, kind)}
    if ctx.nodes_json is not None and not stream_body and not stream_response:
        return await _call_node(ctx.nodes_json, url, headers, method=method, params=params, json_body=json_body,
                                pass_headers=pass_headers)
    content: AsyncIterator[bytes] | None = None
    if stream_body:
        content = request.stream()
        if request.headers.get("content-length"):
            headers["content-length"] = request.headers["content-length"]
    t = time.perf_counter()
    try:
        req = ctx.nodes_http.build_request(method, url, params=params, json=json_body, content=content,
                                           headers=headers)
        resp = await ctx.nodes_http.send(req, stream=True)
    except httpx.HTTPError as exc:
        # The node's address is internal topology: log it, do not show it to tenants.
        log.warning("node data plane %s did not answer: %r", url, exc)
        raise Unavailable(f"the sandbox's node did not answer ({type(exc).__name__}); retry shortly",
                          details={"retryable": True}) from exc
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() in pass_headers}
    if not stream_response or resp.status_code >= 400:
        body = await resp.aread()
        await resp.aclose()
        HOP_SECONDS.labels("api", "node").observe(time.perf_counter() - t)
        return Response(body, status_code=resp.status_code, headers=out_headers)
    out_headers.pop("content-length", None)

    ndjson = (resp.headers.get("content-type") or "").startswith("application/x-ndjson")

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            # The node went away mid-answer (it crashed or restarted). The status line is sent, so the client
            # learns it from the body: an NDJSON stream (exec) ends with an ``error`` event, as when the node
            # itself reports a failure. A byte stream (a file) must not end as if complete: the error goes on,
            # and the server breaks the connection off, which the client sees as a short answer.
            log.warning("node data plane %s broke off its answer: %r", url, exc)
            if not ndjson:
                raise
            yield (json.dumps({"type": "error", "error": {
                "code": Unavailable.code,
                "message": f"the sandbox's node broke off the answer ({type(exc).__name__}); the command may "
                           "still be running in the guest"}}) + "\n").encode()
        finally:
            await resp.aclose()
            HOP_SECONDS.labels("api", "node").observe(time.perf_counter() - t)

    return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers,
                             media_type=resp.headers.get("content-type"))


async def _call_node(session: aiohttp.ClientSession, url: str, headers: dict[str, str], *, method: str,
                     params: dict[str, str] | httpx.QueryParams | None, json_body: object | None,
                     pass_headers: tuple[str, ...]) -> Response:
    """One call to a node answered in one piece (exec, file stat/list/mkdir/remove), through aiohttp; the
    node's status, body and ``pass_headers`` go back as they are. ``Unavailable`` (retryable) when the node
    does not answer."""
    data: bytes | None = None
    if json_body is not None:
        data = json.dumps(json_body, separators=(",", ":")).encode()
        headers = {**headers, "content-type": "application/json"}
    t = time.perf_counter()
    try:
        async with session.request(method, url, params=params, data=data, headers=headers) as resp:
            body = await resp.read()
            status = resp.status
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() in pass_headers}
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The node's address is internal topology: log it, do not show it to tenants.
        log.warning("node data plane %s did not answer: %r", url, exc)
        raise Unavailable(f"the sandbox's node did not answer ({type(exc).__name__}); retry shortly",
                          details={"retryable": True}) from exc
    HOP_SECONDS.labels("api", "node").observe(time.perf_counter() - t)
    return Response(body, status_code=status, headers=out_headers)


def _node_url(base: str, sandbox_id: str, suffix: str) -> str:
    return f"{base}/internal/v1/sandboxes/{sandbox_id}{suffix}"


@router.post("/exec", response_model=ExecResult)
async def exec_(sandbox_id: str, body: ExecRequest, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Run a command to completion; answers ``{stdout, stderr, exit_code, duration_ms, timed_out}``.

    Output is captured up to 16 MiB per stream; use ``/exec/stream`` for more. 409 ``invalid_state`` unless
    the sandbox is running.
    """
    base, gen, guest_env = await _lookup(ctx, who, sandbox_id, SandboxCommand.EXEC, "sandbox.exec", _exec_detail(body))
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/exec"), gen, method="POST",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.EXEC,
                        json_body=_exec_body(body, guest_env))


@router.post("/exec/stream", responses={200: {"content": {"application/x-ndjson": {}}}})
async def exec_stream(sandbox_id: str, body: ExecRequest, request: Request, ctx: CtxDep,
                      who: PrincipalDep) -> Response:
    """Run a command and stream ``ExecEvent`` lines (NDJSON) as output is produced; the last is ``exit``."""
    base, gen, guest_env = await _lookup(ctx, who, sandbox_id, SandboxCommand.EXEC, "sandbox.exec", _exec_detail(body))
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/exec/stream"), gen, method="POST",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.EXEC,
                        json_body=_exec_body(body, guest_env), stream_response=True)


PathQ = Annotated[str, Query(min_length=1, max_length=4096, description="Absolute path in the guest.")]


@router.get("/files", responses={200: {"content": {"application/octet-stream": {}}}})
async def read_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """The file's bytes, streamed. 404 ``not_found`` when it does not exist."""
    base, gen = await _target(ctx, who, sandbox_id, SandboxCommand.FILES)
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/files"), gen, method="GET",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                        params={"path": path}, stream_response=True)


@router.put("/files", response_model=FileInfo, responses={403: {
    "model": ErrorBody,
    "description": "`not_writable`: the guest refused the write (a read-only or pseudo file system such as "
                   "/proc or /sys, or no permission); `details.path` names the file."}})
async def write_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep,
                     mode: str = Query("0644", pattern=r"^0?[0-7]{3,4}$")) -> Response:
    """Write the raw request body to ``path`` (atomically: temp file then rename; missing parent directories
    are made); answers its ``FileInfo``. 403 ``not_writable`` when the guest refuses the write: ``/proc/version``
    and other files of ``/proc`` and ``/sys`` (no file can be made beside them), a read-only file system, or
    a file the sandbox's user may not write. 400 ``invalid_request`` for a directory or a device."""
    base, gen, _ = await _lookup(ctx, who, sandbox_id, SandboxCommand.FILES, "sandbox.files.write", {"path": path})
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/files"), gen, method="PUT",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                        params={"path": path, "mode": mode}, stream_body=True)


@router.delete("/files", status_code=204)
async def remove_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep,
                      recursive: bool = False) -> Response:
    """Remove a file, or a directory with ``recursive=true``."""
    base, gen, _ = await _lookup(ctx, who, sandbox_id, SandboxCommand.FILES, "sandbox.files.remove", {"path": path})
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/files"), gen, method="DELETE",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                        params={"path": path, "recursive": str(recursive).lower()})


@router.get("/files/stat", response_model=FileInfo)
async def stat_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """``FileInfo`` of ``path``; 404 ``not_found`` when missing."""
    base, gen = await _target(ctx, who, sandbox_id, SandboxCommand.FILES)
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/files/stat"), gen, method="GET",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                        params={"path": path})


@router.get("/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """The entries of directory ``path`` (one level)."""
    base, gen = await _target(ctx, who, sandbox_id, SandboxCommand.FILES)
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/files/list"), gen, method="GET",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                        params={"path": path})


@router.post("/files/mkdir", response_model=FileInfo)
async def mkdir(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep,
                parents: bool = True) -> Response:
    """Create directory ``path`` (and its parents unless ``parents=false``)."""
    base, gen, _ = await _lookup(ctx, who, sandbox_id, SandboxCommand.FILES, "sandbox.files.mkdir", {"path": path})
    return await _proxy(ctx, request, _node_url(base, sandbox_id, "/files/mkdir"), gen, method="POST",
                        tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                        params={"path": path, "parents": str(parents).lower()})


# Other routers (the E2B envd proxy) reach the node through the same two steps.
proxy = _proxy
target = _target
lookup = _lookup
# Schedule runs (schedules/run.py) send the same exec body.
exec_body = _exec_body
