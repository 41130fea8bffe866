"""ASGI middleware shared by the services' HTTP apps: ``podbay_http_request_seconds`` per route, and the
node's internal-token check, both as plain ASGI.

Plain ASGI rather than ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``), whose per-request
task and stream hand-off cost about a millisecond per request on a busy host: on the API's warm create and
on every exec and file call, which passes the API and then the node's data plane.
"""

from __future__ import annotations

import hmac
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from podbay.errors import Unauthorized
from podbay.logs import bind_from_path
from podbay.telemetry import HTTP_REQUEST_SECONDS

__all__ = ["RequestMetrics", "InternalToken"]


class RequestMetrics:
    """``podbay_http_request_seconds{service, route, method, status}`` of every HTTP request; ``route`` is
    the matched route's template (``/v1/sandboxes/{sandbox_id}/exec``), ``unmatched`` when none matched.
    Log lines of the request carry the sandbox or operation id its path names (``podbay.logs``)."""

    def __init__(self, app: ASGIApp, service: str = "api") -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = time.perf_counter()
        bind_from_path(scope["path"])  # log lines of this request carry its sandbox / operation id
        status = 500  # what the client gets when the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # The router records the matched route in the (shared) scope; unmatched paths stay one label.
            path = getattr(scope.get("route"), "path", "unmatched")
            HTTP_REQUEST_SECONDS.labels(self.service, path, scope["method"], f"{status // 100}xx").observe(
                time.perf_counter() - t)


class InternalToken:
    """401 ``unauthorized`` (the wire error shape) for an HTTP request under ``prefix`` whose
    ``x-podbay-internal-token`` header is not ``token`` (compared in constant time); others pass."""

    def __init__(self, app: ASGIApp, token: str, prefix: str = "/internal/") -> None:
        self.app = app
        self.token = token.encode()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            given = next((v for k, v in scope["headers"] if k == b"x-podbay-internal-token"), b"")
            if not hmac.compare_digest(given, self.token):
                body = json.dumps(Unauthorized("bad internal token").to_wire()).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
