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
node's ``/internal/e2b/{sandbox_id}/<path>`` with ``nodes_client.proxy``. Only envd's port (49983) exists:
another port answers 502 "port is not open". A sandbox that is gone or paused answers 502 "... was not
found", which the SDK reports as a sandbox that is not running.

``GET``/``POST /files`` without the token may carry instead the signature of E2B's ``download_url`` /
``upload_url`` (``signature``, optional ``signature_expiration``: ``file_signature``), checked as envd checks
it (E2B infra, packages/envd/internal/api/auth.go), with envd's 401 messages: a token sent but wrong
("access token present in header but does not match": a wrong token is never overruled by a signature), no
signature ("missing signature query parameter"), a wrong one ("invalid signature": it binds the sandbox's
token, the path and user exactly as written in the query, and the operation, ``read`` for GET and ``write``
for POST) or an expired one ("signature is already expired"). Such a URL needs no API key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from typing import Any
from urllib.parse import unquote_to_bytes

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.contracts.states import SandboxCommand
from podbay.edge_tls import domain_host
from podbay.envdpath import EnvdPathRefused, check_sandbox_id, parse_envd_path
from podbay.errors import InvalidState, NotFound, PodbayError
from podbay.grants import GrantKind
from podbay.naming import e2b_sandbox_id, sandbox_id_from_e2b

from .. import nodes_client
from ..core.auth import Principal
from ..core.context import ApiContext
from ..e2b.common import envd_access_token, error_body
from ..services.sandbox_lookup import e2b_envd_row
from ..services.sandbox_service import auto_resume

__all__ = ["router", "EnvdRouting", "file_signature", "check_file_signature", "ENVD_PORT", "PREFIX", "ENV_HEADER", "parse_host",
           "envd_route", "HostRefused", "canonical_rest_path"]

ENVD_PORT = 49983
PREFIX = "/e2b/envd"
# The sandbox's default command environment (E2B's envVars) for the node: base64 of a JSON object.
ENV_HEADER = "x-podbay-e2b-env"
# The first label of a port's host: the port, then the sandbox id in either spelling (podbay.naming).
_LABEL = re.compile(r"(?P<port>[1-9]\d{0,4})-(?P<sandbox>.+)")
# A REST path segment after ``sandboxes/`` in E2B's spelling, taken back to the stored id (EnvdRouting).
_SANDBOXES = b"sandboxes"
# Request headers the envd API reads; everything else (API keys, cookies, hop-by-hop headers) stays here.
_FORWARD = ("content-type", "content-encoding", "connect-protocol-version", "connect-timeout-ms",
            "connect-content-encoding", "connect-accept-encoding", "authorization", "keepalive-ping-interval",
            "user-agent")
_RETURN = ("content-type", "content-length", "content-encoding", "content-disposition", "connect-content-encoding",
           "connect-accept-encoding", "grpc-status", "grpc-message")

# The query parameters a file URL's signature covers (or carries).
_SIGNED_PARAMS = ("path", "username", "signature", "signature_expiration")

router = APIRouter(prefix=PREFIX, include_in_schema=False)


def file_signature(path: str, operation: str, user: str, access_token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL: ``v1_`` + unpadded base64 of SHA-256 over
    ``path:operation:user:token[:expiration]`` (``user`` empty for the default user)."""
    raw = f"{path}:{operation}:{user}:{access_token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def check_file_signature(query: dict[str, str], operation: str, access_token: str, now: float) -> str | None:
    """None when ``query`` (``path``, ``username``, ``signature``, ``signature_expiration``) carries a valid,
    unexpired signature for ``operation`` (``read`` or ``write``); otherwise why it is refused, in envd's
    words (missing, invalid, expired: checked in that order, as envd does)."""
    if "signature" not in query:
        return "missing signature query parameter"
    raw_exp = query.get("signature_expiration")
    try:
        expiration = int(raw_exp) if raw_exp else None
    except ValueError:
        return "invalid signature"
    want = file_signature(query.get("path", ""), operation, query.get("username", ""), access_token, expiration)
    if not hmac.compare_digest(query["signature"].encode(), want.encode()):
        return "invalid signature"
    if expiration is not None and expiration < now:
        return "signature is already expired"
    return None


class HostRefused(EnvdPathRefused):
    """400: a host under the E2B domain that names a port but no sandbox id in a valid spelling."""


def parse_host(host: str, domain: str | None) -> tuple[int, str] | None:
    """``(port, sandbox_id)`` of a ``{port}-{sandboxID}.{domain}[.][:port]`` host, the id as stored (``sbx_...``,
    from either spelling: ``podbay.naming.sandbox_id_from_e2b``); None for a host that is not under ``domain``
    or is one label of it that names no port (``api.{domain}``), or when no domain is configured. A domain that
    carries a port (the dev stack's ``e2b.localhost:8443``, its TLS edge) is compared by its name, as the port
    edge does (services/api/edge/ports_access.py).

    :class:`HostRefused` for a host under ``domain`` whose labels before it are not exactly one
    ``{port}-{id}`` label (more labels, a port outside 1..65535, an id in upper case, percent-encoded or of
    another shape): such a name reaches no sandbox and no other route either."""
    if not domain:
        return None
    want = domain_host(domain).rstrip(".")
    name = host.rpartition(":")[0] if host.rpartition(":")[2].isdigit() else host
    name = name.rstrip(".")
    if not name.lower().endswith("." + want):
        return None
    head = name[:-len(want) - 1]  # the labels before the domain, as the client spelled them
    m = _LABEL.fullmatch(head)
    if m is None and "." not in head and not head[:1].isdigit():
        return None  # a name of the API's own (api.{domain})
    sandbox = sandbox_id_from_e2b(m.group("sandbox")) if m is not None else None
    if m is None or sandbox is None or int(m.group("port")) > 65535:
        raise HostRefused(f"the host names no sandbox port: {{port}}-{{sandboxID}}.{want} expected")
    return int(m.group("port")), sandbox


def canonical_rest_path(raw: bytes) -> bytes | None:
    """The raw path of an E2B REST request (``/e2b/...``) with each sandbox id after a ``sandboxes/`` segment
    in the stored spelling (``sbx-3f2a...`` -> ``sbx_3f2a...``), the rest byte for byte; None when such a
    segment holds a percent sign (an encoded id is never taken: it would be a second spelling of it), unless it
    encodes a NUL byte: that segment is left as it is, for the API's refusal of bad text (400)."""
    parts = raw.split(b"/")
    for i in range(1, len(parts)):
        if parts[i - 1] != _SANDBOXES:
            continue
        if b"%" in parts[i]:
            if b"\x00" in unquote_to_bytes(parts[i]):
                continue  # a NUL byte is bad text, refused as such (400) wherever it stands, not a spelling
            return None
        stored = sandbox_id_from_e2b(parts[i].decode("latin-1"))
        if stored is not None:
            parts[i] = stored.encode()
    return b"/".join(parts)


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
            try:
                by_host = parse_host(headers.get("host", ""), self.domain)
            except HostRefused as exc:
                await error_body(400, exc.message)(scope, receive, send)
                return
            if by_host is not None:
                port, host_sandbox = by_host
                sandbox_id = sandbox_id or host_sandbox
            if scope["path"].startswith("/e2b/") and not scope["path"].startswith(PREFIX + "/"):
                # E2B's REST API takes the id in either spelling (podbay.naming.e2b_sandbox_id).
                raw = scope.get("raw_path") or scope["path"].encode("utf-8")
                fixed = canonical_rest_path(raw)
                if fixed is None:
                    await error_body(404, "sandbox not found: its id is percent-encoded")(scope, receive, send)
                    return
                if fixed != raw:
                    scope = dict(scope, path=fixed.decode("latin-1"), raw_path=fixed)
            elif sandbox_id and not scope["path"].startswith(("/e2b/", "/v1/")):
                if port != ENVD_PORT:
                    await error_body(502, f"The sandbox {e2b_sandbox_id(sandbox_id)} is running but port {port} "
                                          "is not open")(scope, receive, send)
                    return
                stored = sandbox_id_from_e2b(sandbox_id)
                try:
                    if stored is None:
                        raise EnvdPathRefused("malformed sandbox id")
                    route = parse_envd_path(scope.get("raw_path") or scope["path"].encode("utf-8"))
                except EnvdPathRefused as exc:
                    await error_body(400, exc.message)(scope, receive, send)
                    return
                path = f"{PREFIX}/{stored}{route}"
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
    file_url = route == "/files" and request.method in ("GET", "POST")
    if token:
        if not hmac.compare_digest(token.encode(), expected.encode()):
            return error_body(401, "access token present in header but does not match" if file_url
                              else "missing or invalid X-Access-Token for this sandbox")
    elif not file_url:
        return error_body(401, "missing or invalid X-Access-Token for this sandbox")
    else:
        # A repeated parameter could be read one way here and another way by the node: none is signed.
        repeated = any(len(request.query_params.getlist(k)) > 1 for k in _SIGNED_PARAMS)
        refused = "invalid signature" if repeated else check_file_signature(
            dict(request.query_params), "read" if request.method == "GET" else "write", expected, time.time())
        if refused:
            return error_body(401, refused)
    row = await e2b_envd_row(ctx.pool, sandbox_id)
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
        base, gen, guest_env = await nodes_client.lookup(ctx, who, sandbox_id, SandboxCommand.EXEC)
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
        return await nodes_client.proxy(ctx, request, url, gen, method=request.method, stream_body=True,
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

