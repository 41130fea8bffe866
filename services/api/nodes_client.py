"""The API's one client for talking to nodes: where a sandbox runs (:func:`lookup`, :func:`target`: its node's
data-plane URL and generation, with the lease renewal and audit row the call earns) and the call itself
(:func:`proxy`, :func:`call_node`), each with a fresh grant (podbay.grants) from ``ApiContext.node_headers``.
Used by the exec and file routes, computer use, ports, snapshot diffs, E2B's envd and volume content proxies,
the console terminal and schedule runs.

The node agent's data plane (``/internal/v1/sandboxes/{id}/...``) speaks the same bodies as the API's routes,
so requests and responses stream through without re-encoding. The node refuses a call whose grant is not for
the caller's tenant, this subject, its generation and the kind of operation (403 ``grant_refused``), and a
stale placement with 409 ``stale_generation``. The HTTP clients themselves are ``ApiContext.nodes_http``
(streams) and ``ApiContext.nodes_json`` (calls answered in one piece), made in app.py's lifespan.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from podbay.contracts import subjects
from podbay.contracts.api import ExecRequest
from podbay.contracts.states import SandboxCommand, check_allowed
from podbay.contracts.messages import Event
from podbay.errors import NotFound, Unavailable
from podbay.grants import GrantKind
from podbay.lifecycle import renew_lease_sql
from podbay.renewals import due_sql
from podbay.outbox import new_id
from podbay.telemetry import HOP_SECONDS

from .core.auth import Principal
from .core.context import ApiContext

__all__ = ["PASS_HEADERS", "call_node", "exec_body", "lookup", "node_url", "proxy", "target"]

log = logging.getLogger("podbay.api.dataplane")  # the name logs have always carried

PASS_HEADERS = ("content-type", "content-length", "content-disposition", "x-podbay-file-size")


# A read: the lease renewal this call earns is noted in memory and written in a batch (podbay.renewals), unless
# the lease ends soon (``due``), when the caller renews it at once.
_RENEW = ("WITH s AS (SELECT id, state, generation, node_id, guest_env, " + due_sql() + " AS due FROM sandboxes"
          " WHERE id = $1 AND tenant_id = $2 AND state = 'running')")
_SELECT = (" SELECT s.state, s.generation, s.guest_env, s.due, n.dataplane_url FROM s"
           " LEFT JOIN nodes n ON n.id = s.node_id")
_RENEW_NOW = renew_lease_sql(where="state = 'running'")
LOOKUP_SQL = _RENEW + _SELECT
#: As LOOKUP_SQL, plus what podbay.audit.record writes (the audit row, and its event with the row id).
LOOKUP_AUDIT_SQL = (
    _RENEW + ","
    " a AS (INSERT INTO audit_log (tenant_id, actor, action, target, sandbox_id, detail)"
    "       SELECT $2, $3, $4, s.id, s.id, $5::jsonb FROM s RETURNING id),"
    " e AS (INSERT INTO outbox (event_id, subject, payload)"
    "       SELECT $6, $7, jsonb_set($8::jsonb, '{data,audit_id}', to_jsonb(a.id)) FROM a)" + _SELECT)


async def lookup(ctx: ApiContext, who: Principal, sandbox_id: str, command: SandboxCommand,
                  audit_action: str | None = None,
                  audit_detail: dict[str, Any] | None = None) -> tuple[str, int, dict[str, str]]:
    """(node data-plane URL, generation, credential placeholder env) of a running sandbox of the caller's
    tenant. With ``audit_action`` (e.g. ``sandbox.exec``) the call is audited when the sandbox runs."""
    t = time.perf_counter()
    # Every data-plane call renews the lease (batched: podbay.renewals); a changing one (exec, file writes) also
    # appends its audit row and event in the lookup's round trip, so auditing costs no extra round trip.
    if audit_action is None:
        row = await ctx.pool.fetchrow(LOOKUP_SQL, sandbox_id, who.tenant_id)
    else:
        event = Event(id=new_id("evt"), type=audit_action, sandbox_id=sandbox_id, tenant_id=who.tenant_id,
                      at=datetime.now(UTC), data={"audit_id": 0, "actor": who.key_id, "target": sandbox_id,
                                                  **(audit_detail or {})})
        row = await ctx.pool.fetchrow(LOOKUP_AUDIT_SQL, sandbox_id, who.tenant_id, who.key_id, audit_action,
                                      audit_detail or {}, event.id, subjects.audit_event(who.tenant_id, audit_action),
                                      json.loads(event.model_dump_json()))
        if row is not None:
            ctx.relay.kick()
    if row is not None:
        if row["due"] or ctx.renewals is None:
            await ctx.pool.execute(_RENEW_NOW, sandbox_id)
        else:
            ctx.renewals.note(sandbox_id)
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


async def target(ctx: ApiContext, who: Principal, sandbox_id: str, command: SandboxCommand) -> tuple[str, int]:
    """(node data-plane URL, generation) of a running sandbox of the caller's tenant."""
    base, gen, _ = await lookup(ctx, who, sandbox_id, command)
    return base, gen


def exec_body(body: ExecRequest, guest_env: dict[str, str]) -> dict[str, object]:
    """The node's exec body: the sandbox's credential placeholders (``PODBAY_CRED_*``, fixed at create) under
    the request's own env, which wins."""
    out = body.model_dump(exclude_none=True)
    if guest_env:
        out["env"] = {**guest_env, **body.env}
    return out


async def proxy(ctx: ApiContext, request: Request, url: str, generation: int, *, method: str,
                 tenant: str, subject: str, kind: GrantKind,
                 params: dict[str, str] | httpx.QueryParams | None = None, json_body: object | None = None,
                 stream_body: bool = False, stream_response: bool = False,
                 extra_headers: dict[str, str] | None = None,
                 pass_headers: tuple[str, ...] = PASS_HEADERS) -> Response:
    """One call to a node's data plane at ``url`` (built by the caller from parsed parts), with a grant for
    ``tenant``'s ``kind`` operation on ``subject`` (the sandbox id) at ``generation``; the node's status, body
    and ``pass_headers`` go back. Unavailable (retryable) when the node does not answer."""
    headers = {**(extra_headers or {}), **ctx.node_headers(tenant, subject, generation, kind)}
    if ctx.nodes_json is not None and not stream_body and not stream_response:
        return await call_node(ctx.nodes_json, url, headers, method=method, params=params, json_body=json_body,
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


async def call_node(session: aiohttp.ClientSession, url: str, headers: dict[str, str], *, method: str,
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


def node_url(base: str, sandbox_id: str, suffix: str) -> str:
    """``<base>/internal/v1/sandboxes/<sandbox_id><suffix>``: a sandbox's path on its node's data plane."""
    return f"{base}/internal/v1/sandboxes/{sandbox_id}{suffix}"
