"""The web console's own routes (docs/console.md), served by the API process at ``/console``.

* ``GET /console``: the single-page app (``static/index.html``, built by scripts/setup.sh from ``web/``
  with npm and esbuild); 503 with a hint when it was not built.
* ``GET /console/assets/{name}``: its content-hashed scripts, styles and fonts, cached for a year.
* ``POST /console/session`` (``{"key": "pb_..."}``): sign in; sets the session cookie (session.py) and
  answers :class:`SessionInfo` with the CSRF token. ``GET /console/session``: the same for a live session
  (how the page learns its token after a reload). ``DELETE /console/session``: sign out (CSRF token needed).
* ``GET /console/events/position``: the event stream's last position, so that the live sandbox list follows
  ``/v1/events`` from now on instead of replaying the stream's history.
* ``GET /console/sandboxes/{id}/metrics``: the sandbox's resource samples (CPU, memory, disk), oldest first,
  sampling a running sandbox now: the same samples as E2B's ``GET /e2b/sandboxes/{id}/metrics``, which only
  takes an API key, not the console's cookie.
* ``GET /v1/sandboxes/{id}/pty`` (WebSocket, pty.py): the terminal.

Every other call the page makes is the public API (``/v1/...``) with the session cookie, through
``deps.principal_dep``: it sees exactly what the key it was opened with sees.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field

from podbay.errors import NotFound, Unauthorized

from podbay.contracts import subjects
from podbay.errors import Unavailable

from ..e2b import sandboxes as e2b
from ..core.auth import Principal, authenticate
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services.nodes import tenant_name
from . import session

__all__ = ["router", "STATIC", "SessionInfo", "SignIn"]

STATIC = Path(__file__).resolve().parent / "static"
_ASSET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TYPES = {".js": "text/javascript", ".css": "text/css", ".woff2": "font/woff2", ".svg": "image/svg+xml",
          ".map": "application/json"}
# The page loads only its own files; the terminal's WebSocket is same-origin ('self' covers ws: in CSP 3).
# xterm.js sets inline styles on its elements, hence 'unsafe-inline' for styles only.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
_PAGE_HEADERS = {"content-security-policy": _CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
                 "x-frame-options": "DENY", "cache-control": "no-cache"}

router = APIRouter(prefix="/console", include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


class SignIn(BaseModel):
    """The body of a sign-in: an API key (``pb_...`` or its ``e2b_`` alias)."""

    key: str = Field(min_length=1, max_length=200)


class SessionInfo(BaseModel):
    """A live console session: who it acts as and the token its changes must carry."""

    tenant_id: str
    tenant: str
    key_id: str
    operator: bool = Field(description="The operator tenant: the console also shows nodes.")
    csrf_token: str
    expires_at: datetime


async def _info(ctx: ApiContext, s: session.ConsoleSession) -> SessionInfo:
    name = await tenant_name(ctx.pool, s.principal.tenant_id)
    return SessionInfo(tenant_id=s.principal.tenant_id, tenant=str(name), key_id=s.principal.key_id,
                       operator=name == ctx.settings.operator_tenant, csrf_token=s.csrf, expires_at=s.expires_at)


@router.get("", response_class=HTMLResponse)
@router.get("/", response_class=HTMLResponse)
async def index() -> Response:
    """The console's page (hash routes inside it)."""
    page = STATIC / "index.html"
    if not page.is_file():
        return HTMLResponse("<!doctype html><title>podbay console</title><p>The console is not built: run "
                            "<code>scripts/setup.sh</code> (it builds services/api/console/web with npm).</p>",
                            status_code=503, headers=_PAGE_HEADERS)
    return FileResponse(page, media_type="text/html", headers=_PAGE_HEADERS)


@router.get("/assets/{name}")
async def asset(name: str) -> Response:
    """A built file by its plain name (no directories); 404 for anything else."""
    if not _ASSET.match(name) or Path(name).suffix not in _TYPES:
        raise NotFound("no such console file")
    path = STATIC / "assets" / name
    if not path.is_file():
        raise NotFound("no such console file")
    return FileResponse(path, media_type=_TYPES[path.suffix],
                        headers={"cache-control": "public, max-age=31536000, immutable",
                                 "x-content-type-options": "nosniff"})


def _set_cookie(request: Request, response: Response, value: str, max_age: int) -> None:
    secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
    response.set_cookie(session.COOKIE, value, max_age=max_age, path="/", httponly=True, samesite="strict",
                        secure=secure)


@router.post("/session", response_model=SessionInfo)
async def sign_in(body: SignIn, request: Request, response: Response, ctx: CtxDep) -> SessionInfo:
    """Open a session for ``body.key`` (401 ``unauthorized`` for an invalid or revoked key)."""
    who = await authenticate(ctx.pool, f"Bearer {body.key.strip()}", on_refused=ctx.relay.kick)
    session_id, _ = await session.open_session(ctx.pool, who)
    found = await session.find_session(ctx.pool, session_id)
    assert found is not None
    _set_cookie(request, response, session_id, session.SESSION_TTL_S)
    return await _info(ctx, found)


@router.get("/session", response_model=SessionInfo)
async def current(request: Request, ctx: CtxDep) -> SessionInfo:
    """The live session of this browser; 401 without one."""
    found = await session.find_session(ctx.pool, request.cookies.get(session.COOKIE))
    if found is None:
        raise Unauthorized("not signed in to the console")
    return await _info(ctx, found)


@router.delete("/session", status_code=204)
async def sign_out(request: Request, ctx: CtxDep) -> Response:
    """End this browser's session (needs its CSRF token) and clear the cookie."""
    sid = request.cookies.get(session.COOKIE)
    if sid:
        await session.cookie_principal(ctx.pool, sid, "DELETE", request.headers.get(session.CSRF_HEADER))
        await session.close_session(ctx.pool, sid)
    response = Response(status_code=204)
    _set_cookie(request, response, "", 0)
    return response


class EventPosition(BaseModel):
    """Where the event stream ends now: pass ``last_seq`` as ``after`` to ``/v1/events`` to see only new events."""

    last_seq: int


@router.get("/events/position", response_model=EventPosition)
async def event_position(ctx: CtxDep, who: PrincipalDep) -> EventPosition:
    """The last position of the event stream (a number that orders every tenant's events, nothing more)."""
    try:
        info = await ctx.bus.js.stream_info(subjects.EVT_STREAM)
    except Exception as exc:  # nats-py raises several unrelated types here
        raise Unavailable(f"the event stream did not answer: {exc}") from exc
    return EventPosition(last_seq=int(info.state.last_seq))


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(sandbox_id: str, ctx: CtxDep, who: PrincipalDep,
                          start: int | None = Query(None, ge=0)) -> Response:
    """The caller's sandbox's resource samples since ``start`` (unix seconds; default: all kept, at most
    ``e2b.METRICS_KEEP``), oldest first -> 200 ``[{"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct",
    "memUsed", "memTotal", "memCache", "diskUsed", "diskTotal"}]`` (bytes; percent of all vCPUs). A running
    sandbox is sampled now (at most once a second). 404 ``not_found`` for another tenant's or no sandbox;
    503 ``unavailable`` when the guest did not answer."""
    return await e2b.metrics(sandbox_id, ctx, who, start, None)
