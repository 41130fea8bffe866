"""The E2B SDK's in-sandbox traffic (envd API) through the API, to the sandbox's node.

One endpoint serves every sandbox. The SDK reaches it in one of two ways:

* ``E2B_SANDBOX_URL`` pointing at the API: every envd request carries ``E2b-Sandbox-Id``;
* wildcard DNS ``*.PODBAY_E2B_DOMAIN`` pointing at the API: the host is ``{port}-{sandboxID}.{domain}``.

The path is never forwarded as the client wrote it: ``podbay.envdpath.parse_envd_path`` reads the raw path
(``scope["raw_path"]``) once and answers 400 (E2B's error shape) for any percent sign, backslash, empty or
dot segment, control or non-ASCII byte, or a path that is not one of the envd routes the node serves; the
sandbox id must match ``podbay.envdpath.SANDBOX_ID``. The node URL is built from the looked-up node, that id
and the allow-listed route's own constant, the query passed as parsed parameters; the node call carries an
``envd`` grant (podbay.grants) for this sandbox alone.

``EnvdRouting`` (ASGI middleware) rewrites such a request to ``/e2b/envd/{sandbox_id}/<route>``, which this
router authorises with ``X-Access-Token`` (the sandbox's envd access token, ``e2b.envd_access_token``),
checks that the sandbox runs (renewing its lease, like every data-plane call; ``GET /health`` is answered
here and renews nothing, and a sandbox created with ``autoResume`` is resumed first), adds the sandbox's default
command environment (``x-podbay-e2b-env``, from the create call's ``envVars``) and streams through to the
node's ``/internal/e2b/{sandbox_id}/<path>`` with ``dataplane.proxy``. Only envd's port (49983) exists:
another port answers 502 "port is not open". A sandbox that is gone or paused answers 502 "... was not
found", which the SDK reports as a sandbox that is not running.

``GET``/``POST /files`` without the token may carry instead the signature of E2B's ``download_url`` /
``upload_url`` (``signature``, optional ``signature_expiration``: ``file_signature``); a wrong or expired
one answers 401.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.contracts.states import SandboxCommand
from podbay.envdpath import EnvdPathRefused, check_sandbox_id, parse_envd_path
from podbay.errors import InvalidState, NotFound, PodbayError
from podbay.grants import GrantKind

from . import dataplane
from .auth import Principal
from .context import ApiContext
from .e2b_common import envd_access_token, error_body
from .sandbox_service import auto_resume

__all__ = ["router", "EnvdRouting", "file_signature", "check_file_signature", "ENVD_PORT", "PREFIX", "ENV_HEADER", "parse_host",
           "envd_route"]

ENVD_PORT = 49983
PREFIX = "/e2b/envd"
# The sandbox's default command environment (E2B's envVars) for the node: base64 of a JSON object.
ENV_HEADER = "x-podbay-e2b-env"
_HOST = re.compile(r"^(?P<port>\d{1,5})-(?P<sandbox>[A-Za-z0-9_]{1,64})\.(?P<domain>[A-Za-z0-9.-]+?)(:\d+)?$")
# Request headers the envd API reads; everything else (API keys, cookies, hop-by-hop headers) stays here.
_FORWARD = ("content-type", "content-encoding", "connect-protocol-version", "connect-timeout-ms",
            "connect-content-encoding", "connect-accept-encoding", "authorization", "keepalive-ping-interval",
            "user-agent")
_RETURN = ("content-type", "content-length", "content-encoding", "content-disposition", "connect-content-encoding",
           "connect-accept-encoding", "grpc-status", "grpc-message")

router = APIRouter(prefix=PREFIX, include_in_schema=False)


def file_signature(path: str, operation: str, user: str, access_token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL: ``v1_`` + unpadded base64 of SHA-256 over
    ``path:operation:user:token[:expiration]`` (``user`` empty for the default user)."""
    raw = f"{path}:{operation}:{user}:{access_token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def check_file_signature(query: dict[str, str], operation: str, access_token: str, now: float) -> str | None:
    """None when ``query`` (``path``, ``username``, ``signature``, ``signature_expiration``) carries a valid,
    unexpired signature for ``operation`` (``read`` or ``write``); otherwise why it is refused."""
    raw_exp = query.get("signature_expiration")
    try:
        expiration = int(raw_exp) if raw_exp else None
    except ValueError:
        return "signature_expiration must be a unix time in seconds"
    want = file_signature(query.get("path", ""), operation, query.get("username", ""), access_token, expiration)
    if not hmac.compare_digest(query.get("signature", "").encode(), want.encode()):
        return "invalid signature for this file URL"
    if expiration is not None and expiration < now:
        return "this file URL's signature has expired"
    return None


def parse_host(host: str, domain: str | None) -> tuple[int, str] | None:
    """``(port, sandbox_id)`` of a ``{port}-{sandboxID}.{domain}`` host, None for any other host (or when
    no domain is configured)."""
    if not domain:
        return None
    m = _HOST.match(host)
    if m is None or m.group("domain").lower() != domain.lower().rstrip("."):
        return None
    return int(m.group("port")), m.group("sandbox")


class EnvdRouting:
    """ASGI middleware: a request with ``E2b-Sandbox-Id``, or for ``{port}-{id}.{domain}``, goes to this
    router (path rewritten); every other request passes through unchanged."""

    def __init__(self, app: ASGIApp, domain: str | None) -> None:
        self.app = app
        self.domain = domain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            sandbox_id = headers.get("e2b-sandbox-id")
            port = ENVD_PORT
            by_host = parse_host(headers.get("host", ""), self.domain)
            if by_host is not None:
                port, host_sandbox = by_host
                sandbox_id = sandbox_id or host_sandbox
            if sandbox_id and not scope["path"].startswith(("/e2b/", "/v1/")):
                if port != ENVD_PORT:
                    await error_body(502, f"The sandbox {sandbox_id} is running but port {port} is not open")(
                        scope, receive, send)
                    return
                try:
                    check_sandbox_id(sandbox_id)
                    route = parse_envd_path(scope.get("raw_path") or scope["path"].encode("utf-8"))
                except EnvdPathRefused as exc:
                    await error_body(400, exc.message)(scope, receive, send)
                    return
                path = f"{PREFIX}/{sandbox_id}{route}"
                scope = dict(scope, path=path, raw_path=path.encode())
        await self.app(scope, receive, send)


def envd_route(scope: Scope, sandbox_id: str) -> str:
    """The allow-listed envd route of a request for ``/e2b/envd/{sandbox_id}/<route>``, read from the raw
    path (its ``sandbox_id`` segment must be the routed one, byte for byte); EnvdPathRefused (400) otherwise."""
    check_sandbox_id(sandbox_id)
    raw: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    head = f"{PREFIX}/{sandbox_id}/".encode()
    if not raw.startswith(head):
        raise EnvdPathRefused("the sandbox id in the path is not spelled plainly")
    return parse_envd_path(raw[len(head) - 1:])


async def _envd(sandbox_id: str, request: Request) -> Response:
    try:
        route = envd_route(request.scope, sandbox_id)
    except EnvdPathRefused as exc:
        return error_body(400, exc.message)
    ctx: ApiContext = request.app.state.ctx
    token = request.headers.get("x-access-token", "")
    expected = envd_access_token(ctx.settings.internal_token, sandbox_id)
    if not hmac.compare_digest(token.encode(), expected.encode()):
        signed = request.query_params.get("signature")
        if route != "/files" or request.method not in ("GET", "POST") or signed is None:
            return error_body(401, "missing or invalid X-Access-Token for this sandbox")
        refused = check_file_signature(dict(request.query_params), "read" if request.method == "GET" else "write",
                                       expected, time.time())
        if refused:
            return error_body(401, refused)
    row = await ctx.pool.fetchrow(
        "SELECT s.tenant_id, s.state, e.env_vars, COALESCE(e.auto_resume, false) AS auto_resume FROM sandboxes s"
        " LEFT JOIN e2b_sandboxes e ON e.sandbox_id = s.id WHERE s.id = $1", sandbox_id)
    if row is None:
        return error_body(502, f"The sandbox {sandbox_id} was not found")
    tenant = row["tenant_id"]
    if route == "/health" and request.method == "GET":
        # A health probe is not activity: answered here, it leaves the lease alone (E2B renews a sandbox's
        # timeout only when asked to).
        if row["state"] == "running":
            return Response(status_code=204)
        return error_body(502, f"The sandbox {sandbox_id} was not found: it is {row['state']}")
    who = Principal(tenant_id=tenant, key_id="envd-token")
    try:
        if row["auto_resume"] and row["state"] in ("paused", "suspended"):
            # Created with autoResume: envd traffic wakes the paused sandbox (without it, only connect does).
            await auto_resume(ctx, who, sandbox_id)
        base, gen, guest_env = await dataplane.lookup(ctx, who, sandbox_id, SandboxCommand.EXEC)
    except (NotFound, InvalidState) as exc:
        return error_body(502, f"The sandbox {sandbox_id} was not found: {exc.message}")
    except PodbayError as exc:
        return error_body(exc.http_status, exc.message)
    # X-Metadata-<key>: E2B's file metadata of an upload.
    headers: dict[str, Any] = {k: v for k, v in request.headers.items()
                               if k.lower() in _FORWARD or k.lower().startswith("x-metadata-")}
    # The node must not compress for us unless the client asked (bytes are relayed as they are).
    headers["accept-encoding"] = request.headers.get("accept-encoding", "identity")
    # The credential placeholders (PODBAY_CRED_*) under the create's envVars, which win.
    env = {**guest_env, **(row["env_vars"] or {})}
    if env:
        headers[ENV_HEADER] = base64.b64encode(json.dumps(env).encode()).decode()
    # From parts: the node's address, the checked id and the allow-list's route; the query as parameters.
    url = str(httpx.URL(base).copy_with(path=f"/internal/e2b/{sandbox_id}{route}"))
    try:
        return await dataplane.proxy(ctx, request, url, gen, method=request.method, stream_body=True,
                                     stream_response=True, extra_headers=headers, pass_headers=_RETURN,
                                     params=httpx.QueryParams(request.url.query),
                                     tenant=tenant, subject=sandbox_id, kind=GrantKind.ENVD)
    except PodbayError as exc:
        return error_body(502 if exc.retryable else exc.http_status, exc.message)


@router.api_route("/{sandbox_id}/{path:path}", methods=["GET", "POST"])
async def envd(sandbox_id: str, path: str, request: Request) -> Response:
    """Any envd request (Connect RPC, ``/files``, ``/health``) for ``sandbox_id``, streamed both ways; ``path``
    is matched again on the raw path (:func:`envd_route`)."""
    return await _envd(sandbox_id, request)

