"""The node data plane's gate: every ``/internal/...`` request needs the API's grant for its own sandbox.

Plain ASGI (no Starlette middleware task per request), outermost on the data-plane app, so the ports proxy,
the envd app and every route behind it see only requests it let through. For each request it parses the
path into ``(kind, subject)`` with :func:`route_of`, the one table of the node's routes, and verifies the
``x-podbay-grant`` header (podbay.grants) against them:

    /internal/v1/sandboxes/{id}/exec, /exec/stream                     exec
    /internal/v1/sandboxes/{id}/files, /files/{stat,list,mkdir}         files
    /internal/v1/sandboxes/{id}/ports                                   ports
    /internal/v1/sandboxes/{id}/computer/{screenshot,mouse,keyboard,cdp}  computer
    /internal/v1/sandboxes/{id}/computer/fill                           fill
    /internal/v1/sandboxes/{id}/snapshots/{a}/diff/{b}                  diff
    /internal/e2b/{id}/<an envd route of podbay.envdpath>               envd
    /internal/ports/{id}/{port}  (HTTP and WebSocket)                   traffic
    /internal/v1/templates/build  (subject: x-podbay-build-id)          build
    /internal/v1/templates/building/{name}                              build_status
    /internal/v1/volumes/{id}/content/{path,dir,file}  (subject: the volume id)  volume

Refused with 403 ``grant_refused``: a missing, malformed, badly signed, expired or replayed grant, one for
another sandbox (or build), kind or generation (the ``x-podbay-generation`` header, when sent, must be the
grant's; it is then set from the grant, so the generation fencing behind works on the signed value), and
every other ``/internal`` path, dot segments and empty segments included. ``/healthz`` and ``/readyz``
stay open; ``/metrics`` needs the internal token (``x-podbay-internal-token``) or, for a scraper,
``Authorization: Bearer <PODBAY_METRICS_TOKEN>`` (podbay.metricsauth); any other path is 404. The verified grant is left in
``scope["podbay.grant"]`` (the build route checks its build id against it).
"""

from __future__ import annotations

import hmac
import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.asgiproxy import deny, json_error
from podbay.envdpath import SANDBOX_ID, EnvdPathRefused, parse_envd_path
from podbay.errors import GrantRefused
from podbay.grants import BUILD_ID_HEADER, HEADER, GrantKind, GrantVerifier
from podbay.metricsauth import token_matches

__all__ = ["GrantCheck", "route_of", "BUILD_ID_HEADER", "SCOPE_KEY"]

log = logging.getLogger("podbay.nodeagent.grants")

#: Where the verified :class:`podbay.grants.Grant` is left in the ASGI scope.
SCOPE_KEY = "podbay.grant"
_OPEN = frozenset({"/healthz", "/readyz"})
_SANDBOX_ROUTES: dict[str, GrantKind] = {
    "exec": GrantKind.EXEC, "exec/stream": GrantKind.EXEC,
    "files": GrantKind.FILES, "files/stat": GrantKind.FILES, "files/list": GrantKind.FILES,
    "files/mkdir": GrantKind.FILES,
    "ports": GrantKind.PORTS,
    "computer/screenshot": GrantKind.COMPUTER, "computer/mouse": GrantKind.COMPUTER,
    "computer/keyboard": GrantKind.COMPUTER, "computer/cdp": GrantKind.COMPUTER,
    "computer/fill": GrantKind.FILL,
}
_NAME = SANDBOX_ID  # template names, build ids and volume ids: the same strict id alphabet
_VOLUME_ROUTES = frozenset({"path", "dir", "file"})


def route_of(path: str, headers: dict[bytes, bytes]) -> tuple[GrantKind, str]:
    """``(kind, subject)`` of an ``/internal/...`` request ``path`` (the ASGI ``path``, as routing sees it);
    GrantRefused for a path that is not one of the node's routes with a well-formed id."""
    parts = path.split("/")  # "", "internal", ...
    if len(parts) < 4 or any(p in ("", ".", "..") for p in parts[1:]):
        raise GrantRefused("not a node route")
    if parts[2] == "v1" and parts[3] == "sandboxes" and len(parts) >= 6:
        sid, rest = parts[4], "/".join(parts[5:])
        kind = _SANDBOX_ROUTES.get(rest)
        if kind is None and len(parts) == 9 and parts[5] == "snapshots" and parts[7] == "diff":
            kind = GrantKind.DIFF
        if kind is None or not SANDBOX_ID.fullmatch(sid):
            raise GrantRefused("not a node route")
        return kind, sid
    if parts[2] == "e2b" and len(parts) >= 5:
        sid = parts[3]
        try:
            parse_envd_path("/" + "/".join(parts[4:]))
        except EnvdPathRefused as exc:
            raise GrantRefused(f"not an envd route: {exc.message}") from exc
        if not SANDBOX_ID.fullmatch(sid):
            raise GrantRefused("not a node route")
        return GrantKind.ENVD, sid
    if parts[2] == "ports" and len(parts) == 5 and SANDBOX_ID.fullmatch(parts[3]):
        return GrantKind.TRAFFIC, parts[3]
    if parts[2] == "v1" and parts[3] == "templates":
        if len(parts) == 5 and parts[4] == "build":
            build_id = headers.get(BUILD_ID_HEADER.encode(), b"").decode("latin-1")
            if not _NAME.fullmatch(build_id):
                raise GrantRefused(f"a build call needs {BUILD_ID_HEADER}")
            return GrantKind.BUILD, build_id
        if len(parts) == 6 and parts[4] == "building" and _NAME.fullmatch(parts[5]):
            return GrantKind.BUILD_STATUS, parts[5]
    if parts[2] == "v1" and parts[3] == "volumes" and len(parts) == 7 and parts[5] == "content" \
            and parts[6] in _VOLUME_ROUTES and _NAME.fullmatch(parts[4]):
        return GrantKind.VOLUME, parts[4]
    raise GrantRefused("not a node route")


class GrantCheck:
    """ASGI middleware (see the module docstring). ``verifier`` checks grants; ``internal_token`` and
    ``metrics_token`` (either; an empty one opens nothing) guard ``/metrics``."""

    def __init__(self, app: ASGIApp, verifier: GrantVerifier, internal_token: str, metrics_token: str = "") -> None:
        self.app = app
        self.verifier = verifier
        self.token = internal_token.encode()
        self.metrics_token = metrics_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in _OPEN:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        if path == "/metrics":
            given = headers.get(b"x-podbay-internal-token", b"")
            by_token = bool(self.token) and hmac.compare_digest(given, self.token)
            if not by_token and not token_matches(headers.get(b"authorization", b"").decode("latin-1"),
                                                  self.metrics_token):
                await deny(scope, receive, send, *json_error(401, "unauthorized", "bad internal token"))
                return
            await self.app(scope, receive, send)
            return
        if not path.startswith("/internal/"):
            await deny(scope, receive, send, *json_error(404, "not_found", "no such route"))
            return
        try:
            kind, subject = route_of(path, headers)
            sent_gen = headers.get(b"x-podbay-generation", b"")
            grant = self.verifier.verify(headers.get(HEADER.encode()), subject, kind,
                                         generation=int(sent_gen) if sent_gen.isdigit() else None)
            if sent_gen and not sent_gen.isdigit():
                raise GrantRefused("malformed x-podbay-generation")
        except GrantRefused as exc:
            log.warning("node call refused: %s %s: %s", scope.get("method", "WS"), path[:200], exc.message)
            await deny(scope, receive, send, *_refusal(exc))
            return
        # The generation fencing behind reads this header: from here on it is the signed one.
        if kind not in (GrantKind.BUILD, GrantKind.BUILD_STATUS, GrantKind.VOLUME):
            raw = [(k, v) for k, v in scope.get("headers", []) if k != b"x-podbay-generation"]
            raw.append((b"x-podbay-generation", str(grant.generation).encode()))
            scope = dict(scope, headers=raw)
        scope[SCOPE_KEY] = grant
        await self.app(scope, receive, send)


def _refusal(exc: GrantRefused) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(exc.to_wire()).encode()
    return 403, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body
