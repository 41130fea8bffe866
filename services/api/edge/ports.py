"""The API's port edge: a guest port's HTTP and WebSocket traffic, authorised here and streamed to its node.

ASGI middleware ahead of the routes (docs/ARCHITECTURE.md "Ports"). A request whose address names a port
(:mod:`.ports_access`: host form, path form, E2B's host or headers) goes through these steps; every other
request passes to the app untouched:

1. ``?podbay_token=`` on a GET: a good token is exchanged for an HttpOnly cookie and a redirect to the same
   address without it (so a link opens in a browser); a bad one is 403.
2. The sandbox's row, its node and the port's setting, in one query
   (``services/api/services/ports.py``: ``edge_row``). No such sandbox: 404.
3. Access (:mod:`.ports_access`): a public port passes its rate limit, shared by every API replica through
   PostgreSQL (:class:`podbay.ratelimit.SharedRateLimiter`; 429 past it); a private one needs the
   traffic token, the cookie, or an API key of the sandbox's tenant (401 without a credential, 403 with a
   wrong one). Credentials are removed before the request goes on: the guest never sees them.
4. State: a paused or suspended sandbox is resumed through the same path as ``?auto_resume=true`` data-plane
   calls (services/api/services/sandbox_service.py), bounded by its timeouts, when ``ports_wake`` is on (through E2B's hosts:
   when the sandbox was created with E2B's ``autoResume``, as E2B does); otherwise, and for
   states that cannot serve, 409 ``invalid_state``. The lease is renewed as by any data-plane call (at most
   every :data:`LEASE_RENEW_EVERY_S` per sandbox and process).
5. The request goes to the node's ``/internal/ports/{id}/{port}`` (services/nodeagent/net/ports.py) with a
   ``traffic`` grant for this sandbox (podbay.grants: tenant, sandbox, generation; single use), and the
   guest path in ``x-podbay-port-path`` (through E2B's hosts, for a sandbox created with E2B's
   ``network.maskRequestHost``, the ``Host`` the guest sees in ``x-podbay-port-host``), streamed both ways
   (:mod:`podbay.asgiproxy`); the node's own errors (``port_not_open``: nothing listens) are rendered here as
   JSON or HTML by ``Accept``.

The node is looked up per request, so a sandbox that moves (drain, wake elsewhere) stays at the same address.
"""

from __future__ import annotations

import html
import json
import logging
import time
import urllib.parse
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.asgiproxy import ERROR_HEADER, HOP_BY_HOP, deny, relay_response, relay_websocket, request_body
from podbay.config import Settings
from podbay.errors import PodbayError, Unauthorized
from podbay.grants import GrantKind
from podbay.lifecycle import renew_lease
from podbay.naming import e2b_sandbox_id, sandbox_id_from_e2b
from podbay.ratelimit import SharedRateLimiter

from . import ports_access as pa
from ..core.auth import Principal, authenticate
from ..console.session import COOKIE as CONSOLE_COOKIE
from ..core.context import ApiContext
from .envd import HostRefused
from .envd import parse_host as parse_e2b_host
from ..services.ports import edge_row
from ..services.sandbox_service import auto_resume

__all__ = ["PortsEdge", "LEASE_RENEW_EVERY_S", "E2B_ENVD_PORT"]

log = logging.getLogger("podbay.api.ports")

LEASE_RENEW_EVERY_S = 5.0
#: E2B's envd port: its host-form requests belong to the envd proxy (services/api/edge/envd.py), not here.
E2B_ENVD_PORT = 49983
_WAKE_STATES = ("paused", "suspended")
_CREDENTIAL_HEADERS = frozenset({pa.TOKEN_HEADER, pa.E2B_TOKEN_HEADER})
#: The code interpreter's port (templates/code-interpreter/server.py): its requests carry the sandbox's
#: create-time environment (E2B's ``envs``, kept in ``e2b_sandboxes.env_vars``) in :data:`SANDBOX_ENV_HEADER`
#: as a JSON object, which the server sets in each kernel before its first execution (E2B's server reads it
#: from envd's ``/envs``). A client's own header of that name is dropped.
CODE_INTERPRETER_PORT = 49999
SANDBOX_ENV_HEADER = "x-podbay-sandbox-env"
#: Cookies of podbay's own that never reach a guest: the port's token and the console's session.
_PODBAY_COOKIES = (pa.COOKIE + "=", CONSOLE_COOKIE + "=")
#: Sent with a path-form answer to a browser that holds a console session. The path form shares the API's
#: origin, and a script of a guest page on that origin could read the console's CSRF token
#: (``GET /console/session``) and act as the person; the ``sandbox`` directive without ``allow-same-origin``
#: gives the page an opaque origin instead (CSP Level 3, "sandbox"), so the session is out of its reach.
PATH_FORM_CSP = ("sandbox allow-scripts allow-forms allow-popups allow-popups-to-escape-sandbox allow-modals "
                 "allow-downloads")


def guest_cookie_header(value: str) -> str:
    """``Cookie`` header ``value`` without podbay's own cookies (the port token, the console session): what the
    guest may see; empty when nothing is left."""
    return "; ".join(c for c in (p.strip() for p in value.split(";")) if c and not c.startswith(_PODBAY_COOKIES))


def isolating_send(send: Send, mode: str, headers: dict[str, str]) -> Send:
    """``send`` for the guest's answer: for the path form asked by a browser holding a console session, the
    answer carries ``Content-Security-Policy: sandbox ...`` (:data:`PATH_FORM_CSP`); otherwise ``send``
    itself. Host forms are origins of their own and need nothing."""
    if mode != "path" or _cookie(headers.get("cookie", ""), CONSOLE_COOKIE) is None:
        return send

    async def wrapped(message: Any) -> None:
        if message.get("type") == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", [])
                    if k.lower() != b"content-security-policy"]
            message = {**message, "headers": [*kept, (b"content-security-policy", PATH_FORM_CSP.encode())]}
        await send(message)
    return wrapped


class _Route:
    """What a request addresses: sandbox, port, guest path (raw, with query), and how it was addressed."""

    __slots__ = ("sandbox_id", "port", "path", "mode", "prefix")

    def __init__(self, sandbox_id: str, port: int, path: str, mode: str, prefix: str = "") -> None:
        self.sandbox_id, self.port, self.path, self.mode, self.prefix = sandbox_id, port, path, mode, prefix


class _Stop(Exception):
    """An answer of the edge itself: status, code, message (and extra headers)."""

    def __init__(self, status: int, code: str, message: str, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or []


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _query_without_token(query: str) -> tuple[str, str | None]:
    """``(query without podbay_token, the token)``, keeping the other parameters as they were spelled."""
    if pa.TOKEN_QUERY not in query:
        return query, None
    token = None
    kept = []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == pa.TOKEN_QUERY:
            token = urllib.parse.unquote_plus(value)
        elif part:
            kept.append(part)
    return "&".join(kept), token


class PortsEdge:
    """ASGI middleware serving guest ports (see the module docstring); ``scope["app"].state.ctx`` is the
    API's :class:`~services.api.context.ApiContext`."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self._limiter: SharedRateLimiter | None = None
        self._renewed: dict[str, float] = {}
        self._nodes: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        """The edge's own client to the nodes: guest traffic (long downloads, many connections) never takes
        the connections that exec, files and lifecycle calls use (``ApiContext.nodes_http``). Made on first
        use, in the serving loop; it lives as long as the process."""
        if self._nodes is None:
            self._nodes = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                                           limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        return self._nodes

    # ------------------------------------------------------------------ matching

    def _match(self, scope: Scope, headers: dict[str, str]) -> _Route | None:
        raw = scope.get("raw_path") or scope["path"].encode()
        host = headers.get("host", "")
        by_host = pa.parse_host(host, self.settings.ports_domain)
        if by_host is not None:
            return _Route(by_host[1], by_host[0], raw.decode("latin-1"), "podbay")
        try:
            # E2B's host, its id in either spelling (podbay.naming.e2b_sandbox_id); a refused one is answered
            # by EnvdRouting, inside.
            e2b = parse_e2b_host(host, self.settings.e2b_domain)
        except HostRefused:
            return None
        header_id = sandbox_id_from_e2b(headers.get("e2b-sandbox-id", ""))
        if e2b is None and header_id is not None and headers.get("e2b-sandbox-port", "").isdigit():
            e2b = (int(headers["e2b-sandbox-port"]), header_id)
        if e2b is not None and e2b[0] != E2B_ENVD_PORT:
            return _Route(e2b[1], e2b[0], raw.decode("latin-1"), "e2b")
        if scope["path"].startswith(pa.PATH_PREFIX):
            by_path = pa.parse_path(raw.decode("latin-1"))
            if by_path is not None:
                port, sid, rest = by_path
                label = f"{port}-{pa.host_label(sid)}"
                return _Route(sid, port, rest, "path", prefix=f"{pa.PATH_PREFIX}{label}")
        return None

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        route = self._match(scope, headers)
        if route is None:
            await self.app(scope, receive, send)
            return
        ctx: ApiContext = scope["app"].state.ctx
        labels = ("-", "-")  # until the sandbox is known: strangers' ports must not become metric series
        access = "private"
        status = 500
        try:
            if route.mode == "path" and not route.path:
                raise _Stop(308, "redirect", "add a slash", [(b"location", (route.prefix + "/").encode())])
            query, query_token = _query_without_token(scope.get("query_string", b"").decode("latin-1"))
            if query_token is not None and scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
                raise self._exchange(route, query, query_token,
                                     secure=headers.get("x-forwarded-proto", scope.get("scheme", "")) == "https")
            row = await edge_row(ctx.pool, route.sandbox_id, route.port)
            if row is None:
                raise _Stop(404, "not_found", f"sandbox {route.sandbox_id} does not exist")
            labels = (route.mode, str(route.port))  # never the sandbox id (ports_access: metric labels)
            access, key_used = await self._authorise(ctx, route, row, headers, query_token)
            row = await self._ready(ctx, route, row)
            fwd = self._forward_headers(scope, headers, route, key_used)
            target = dict(scope, headers=fwd, query_string=query.encode("latin-1"))
            guest_path = route.path.partition("?")[0] + (f"?{query}" if query else "")
            # A grant for this one sandbox's port traffic (podbay.grants); the guest path travels in a header,
            # never in the node URL, which is built from the looked-up id and the parsed port alone.
            extra = {**ctx.node_headers(str(row["tenant_id"]), route.sandbox_id, int(row["generation"]),
                                        GrantKind.TRAFFIC), "x-podbay-port-path": guest_path}
            if route.mode == "e2b" and row["mask_request_host"]:  # E2B's network.maskRequestHost
                extra["x-podbay-port-host"] = row["mask_request_host"].replace("${PORT}", str(route.port))
            if route.port == CODE_INTERPRETER_PORT and row["env_vars"]:
                extra[SANDBOX_ENV_HEADER] = json.dumps(row["env_vars"])  # ensure_ascii (the default) keeps a header value ASCII, one line
            url = f"{row['dataplane_url']}/internal/ports/{route.sandbox_id}/{route.port}"
            PortsGauge.inc(labels)
            try:
                if scope["type"] == "http":
                    status = await self._http(ctx, target, receive, isolating_send(send, route.mode, headers),
                                              url, extra, labels)
                else:
                    status = await self._ws(target, receive, send, url, extra, labels)
            finally:
                PortsGauge.dec(labels)
        except _Stop as stop:
            status = stop.status
            if route.mode == "e2b" and stop.code == "port_not_open":  # E2B's own answer for a closed port
                ctype, page = pa.e2b_closed_port(e2b_sandbox_id(route.sandbox_id), route.port,
                                                 headers.get("user-agent", ""))
                await deny(scope, receive, send, 502, [(b"content-type", ctype),
                                                       (b"content-length", str(len(page)).encode())], page)
            else:
                await self._answer(scope, receive, send, headers, stop)
        except PodbayError as exc:
            status = exc.http_status
            await self._answer(scope, receive, send, headers, _Stop(exc.http_status, exc.code, exc.message))
        finally:
            pa.PORT_REQUESTS.labels(*labels, access, f"{status // 100}xx").inc()
            if access == "public":
                log.info("public port %s of %s: %s %s -> %d", route.port, route.sandbox_id,
                         scope.get("method", "WS"), route.path.partition("?")[0][:200], status)

    # ------------------------------------------------------------------ steps

    def _exchange(self, route: _Route, query: str, token: str, *, secure: bool) -> _Stop:
        """The answer to ``?podbay_token=``: a cookie (``Secure`` when the client came over HTTPS, as a TLS
        terminator's ``X-Forwarded-Proto`` says) and a redirect without it, or 403."""
        if not pa.token_ok(token, pa.traffic_token(self.settings.internal_token, route.sandbox_id)):
            return _Stop(403, "forbidden", f"that token does not open sandbox {route.sandbox_id}")
        path = route.path.partition("?")[0]
        location = (route.prefix + path) + (f"?{query}" if query else "")
        cookie = (f"{pa.COOKIE}={token}; Path={route.prefix or '/'}/; HttpOnly; SameSite=Lax"
                  if route.prefix else f"{pa.COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax")
        if secure:
            cookie += "; Secure"
        return _Stop(303, "see_other", "token accepted", [(b"location", location.encode("latin-1")),
                                                          (b"set-cookie", cookie.encode("latin-1"))])

    async def _authorise(self, ctx: ApiContext, route: _Route, row: Any, headers: dict[str, str],
                         query_token: str | None) -> tuple[str, bool]:
        """``(access label, whether an API key was the credential)``; raises :class:`_Stop` (401/403/429)."""
        if row["public"] or (route.mode == "e2b" and row["e2b_public"]):
            if self._limiter is None:  # made on first use: the pool exists once the app has started
                self._limiter = SharedRateLimiter.per_second(ctx.pool, self.settings.ports_public_rate_per_s)
            if not await self._limiter.allow(f"port:{route.sandbox_id}:{route.port}"):
                raise _Stop(429, "rate_limited", f"port {route.port} of sandbox {route.sandbox_id} takes at most "
                            f"{self.settings.ports_public_rate_per_s:g} requests per second",
                            [(b"retry-after", b"1")])
            return "public", False
        secret = ctx.settings.internal_token
        expected = pa.traffic_token(secret, route.sandbox_id)
        given = [headers.get(pa.TOKEN_HEADER), _cookie(headers.get("cookie", "")), query_token]
        if route.mode == "e2b":
            given.append(headers.get(pa.E2B_TOKEN_HEADER))
            e2b_expected = pa.e2b_traffic_token(secret, route.sandbox_id)
            if pa.token_ok(headers.get(pa.E2B_TOKEN_HEADER), e2b_expected):
                return "private", False
        if any(pa.token_ok(t, expected) for t in given):
            return "private", False
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer pb_"):
            try:
                who = await authenticate(ctx.pool, auth, on_refused=ctx.relay.kick)
            except Unauthorized as exc:
                raise _Stop(401, "unauthorized", exc.message) from exc
            if who.tenant_id == row["tenant_id"]:
                return "private", True
            raise _Stop(403, "forbidden", f"that API key does not open sandbox {route.sandbox_id}")
        if any(given) or route.mode == "e2b":  # E2B answers a missing traffic token 403 too
            raise _Stop(403, "forbidden", f"that token does not open sandbox {route.sandbox_id}"
                        if any(given) else f"port {route.port} of sandbox {route.sandbox_id} needs the "
                        f"{pa.E2B_TOKEN_HEADER} header")
        raise _Stop(401, "unauthorized", f"port {route.port} of sandbox {route.sandbox_id} is private: send its "
                    f"traffic token in {pa.TOKEN_HEADER} (or ?{pa.TOKEN_QUERY}=), or an API key of its tenant")

    async def _ready(self, ctx: ApiContext, route: _Route, row: Any) -> Any:
        """The row of a running sandbox with a node, waking a paused or suspended one when allowed; renews
        the lease (throttled). Raises :class:`_Stop` 409 or the resume's own errors."""
        # Through E2B's hosts, E2B's rule: only a sandbox created with autoResume wakes on traffic.
        wake = self.settings.ports_wake and (route.mode != "e2b" or row["e2b_auto_resume"])
        if row["state"] in _WAKE_STATES and wake:
            await auto_resume(ctx, Principal(tenant_id=row["tenant_id"], key_id="ports-edge"), route.sandbox_id)
            row = await edge_row(ctx.pool, route.sandbox_id, route.port)
        if row is None or row["state"] != "running" or not row["dataplane_url"]:
            state = row["state"] if row is not None else "deleted"
            raise _Stop(409, "invalid_state", f"sandbox {route.sandbox_id} is {state}"
                        + ("" if wake or state not in _WAKE_STATES
                           else ": resume it first (waking on a request is off for it)"))
        now = time.monotonic()
        if now - self._renewed.get(route.sandbox_id, 0.0) > LEASE_RENEW_EVERY_S:
            if len(self._renewed) > 10000:
                self._renewed.clear()
            self._renewed[route.sandbox_id] = now
            await renew_lease(ctx.pool, route.sandbox_id, only_running=True)
        return row

    def _forward_headers(self, scope: Scope, headers: dict[str, str], route: _Route,
                         key_used: bool) -> list[tuple[bytes, bytes]]:
        """The client's headers without podbay's credentials, plus X-Forwarded-*."""
        out: list[tuple[bytes, bytes]] = []
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            if name in _CREDENTIAL_HEADERS or name.startswith("x-forwarded-") or (name == "authorization" and key_used) \
                    or name == SANDBOX_ENV_HEADER:
                continue
            if name == "cookie":
                kept = guest_cookie_header(v.decode("latin-1"))
                if kept:
                    out.append((k, kept.encode("latin-1")))
                continue
            out.append((k, v))
        client = scope.get("client")
        proto = "https" if scope.get("scheme") in ("https", "wss") else "http"
        out += [(b"x-forwarded-host", headers.get("host", "").encode("latin-1")),
                (b"x-forwarded-proto", proto.encode())]
        if client:
            out.append((b"x-forwarded-for", str(client[0]).encode()))
        if route.prefix:
            out.append((b"x-forwarded-prefix", route.prefix.encode("latin-1")))
        return out

    async def _http(self, ctx: ApiContext, scope: Scope, receive: Receive, send: Send, url: str,
                    extra: dict[str, str], labels: tuple[str, str]) -> int:
        req_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                       if k.decode("latin-1").lower() not in HOP_BY_HOP]
        req_headers += list(extra.items())
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        sent = pa.PORT_BYTES.labels(*labels, "in")
        received = pa.PORT_BYTES.labels(*labels, "out")

        async def body() -> Any:
            async for chunk in request_body(receive):
                sent.inc(len(chunk))
                yield chunk

        http = self._client()
        req = http.build_request(scope["method"], url, headers=req_headers,
                                           content=body() if has_body else None)
        try:
            resp = await http.send(req, stream=True)
        except httpx.HTTPError as exc:
            log.warning("node %s did not answer for a port: %r", url, exc)
            raise _Stop(502, "node_unavailable", "the sandbox's node did not answer; retry shortly") from exc
        try:
            code = resp.headers.get(ERROR_HEADER)
            if code:
                body_bytes = await resp.aread()
                try:
                    message = json.loads(body_bytes)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = code
                raise _Stop(resp.status_code, code, str(message))
            await relay_response(resp, send, on_bytes=received.inc, receive=receive)
            return resp.status_code
        finally:
            await resp.aclose()

    async def _ws(self, scope: Scope, receive: Receive, send: Send, url: str, extra: dict[str, str],
                  labels: tuple[str, str]) -> int:
        uri = "ws" + url[len("http"):] if url.startswith("http") else url
        counts = await relay_websocket(scope, receive, send, uri, extra)
        pa.PORT_BYTES.labels(*labels, "in").inc(counts["in"])
        pa.PORT_BYTES.labels(*labels, "out").inc(counts["out"])
        return 101

    async def _answer(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str],
                      stop: _Stop) -> None:
        """The edge's own answer, as JSON (podbay's error shape) or, for a browser, a small HTML page."""
        accept = headers.get("accept", "")
        if "text/html" in accept and "application/json" not in accept.split(",")[0]:
            page = (f"<!doctype html><html><head><meta charset=utf-8><title>{stop.status} {html.escape(stop.code)}"
                    f"</title></head><body><h1>{stop.status}: {html.escape(stop.code)}</h1>"
                    f"<p>{html.escape(stop.message)}</p><p><small>podbay</small></p></body></html>").encode()
            ctype = b"text/html; charset=utf-8"
        else:
            page = json.dumps({"error": {"code": stop.code, "message": stop.message}}).encode()
            ctype = b"application/json"
        await deny(scope, receive, send, stop.status,
                   [(b"content-type", ctype), (b"content-length", str(len(page)).encode()), *stop.headers], page)


def _cookie(header: str, wanted: str = pa.COOKIE) -> str | None:
    """The value of cookie ``wanted`` in a ``Cookie`` header, or None."""
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == wanted:
            return value
    return None


class PortsGauge:
    """Open requests and WebSockets per addressing mode and guest port (``podbay_port_open_connections``)."""

    @staticmethod
    def inc(labels: tuple[str, str]) -> None:
        pa.PORT_OPEN.labels(*labels).inc()

    @staticmethod
    def dec(labels: tuple[str, str]) -> None:
        pa.PORT_OPEN.labels(*labels).dec()
