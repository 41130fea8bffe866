"""A bound on the request bodies the API reads into memory (``PODBAY_API_BODY_MAX_MIB``, default 32 MiB: an exec
body holds up to 16 MiB of stdin and 2 MiB of arguments).

FastAPI reads a route's whole body before it parses it, and before the route's dependencies (the API key
check among them) run, so without a bound one anonymous request of any size lands in the API's memory. This
ASGI middleware refuses, with 413 ``body_too_large``, a request whose ``Content-Length`` is over the bound,
and cuts off a chunked one once it has sent more than the bound (413 when no answer has started yet).

Routes that stream their body to where it goes, with limits of their own, are not bounded here: a file
upload (``PUT /v1/sandboxes/{id}/files``), a template build's multipart context (``POST /v1/templates``,
spooled to disk; ``context_too_large``), E2B's template file upload and envd traffic (``/e2b/envd/...``,
after ``EnvdRouting`` rewrote host-routed requests). Guest-port traffic is answered by the port edge, which
sits outside this middleware. WebSockets carry no request body.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from podbay.asgiproxy import deny, json_error

__all__ = ["BodyLimit", "STREAMED"]

#: ``(method, path)`` of the routes whose bodies stream (see the module docstring).
STREAMED: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("PUT", re.compile(r"/v1/sandboxes/[^/]+/files")),
    ("POST", re.compile(r"/v1/templates")),
    ("PUT", re.compile(r"/e2b/templates/[^/]+/files/[^/]+/upload")),
    ("*", re.compile(r"/e2b/envd/.*")),
)


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: bodies over ``max_bytes`` are refused (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _streamed(self, method: str, path: str) -> bool:
        return any(m in ("*", method) and rx.fullmatch(path) for m, rx in STREAMED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._streamed(scope.get("method", ""), scope["path"]):
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        message = f"the request body is over the API's limit of {limit} bytes (PODBAY_API_BODY_MAX_MIB)"
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                if not v.isdigit() or int(v) > limit:
                    await deny(scope, receive, send, *json_error(413, "body_too_large", message))
                    return
        seen = 0
        over = False  # the body went past the limit: whatever the app answers, the client gets the 413
        answered = False

        async def counted() -> Message:
            nonlocal seen, over
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    # The app's body reader turns any error into its own answer (FastAPI: 400 "error parsing
                    # the body"); raising stops the read, and ``tracked`` puts the 413 in its place.
                    over = True
                    raise _TooLarge
            return msg

        async def tracked(msg: Message) -> None:
            nonlocal answered
            if not over:
                await send(msg)
            elif not answered and msg["type"] == "http.response.start":
                answered = True
                status, headers, body = json_error(413, "body_too_large", message)
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not answered:
                await deny(scope, receive, send, *json_error(413, "body_too_large", message))
