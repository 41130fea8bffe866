"""What every module of E2B's API under ``/e2b`` shares: the route class that answers errors in E2B's shape
(``{"code": <HTTP status>, "message"}``), the caller's principal from ``X-API-KEY``, the envd access token,
the ``Sandbox`` body and the lookups of a sandbox in a state E2B knows.

It imports none of E2B's route modules, so each of them (services/api/e2b/sandboxes.py, network.py,
snapshots.py, volumes.py, and the envd proxy services/api/edge/envd.py) can import it, and e2b/sandboxes.py can
import its siblings, without an import cycle.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any

import asyncpg
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict

from podbay.errors import InvalidRequest, NotFound, PodbayError
from podbay.lifecycle import set_lease
from podbay.naming import e2b_sandbox_id

from ..core.auth import Principal, authenticate
from ..core.context import ApiContext
from ..core.errors import BAD_TEXT_MESSAGE, retry_headers
from ..services.sandbox_lookup import audit, load_sandbox

__all__ = ["ENVD_VERSION", "CLIENT_ID", "E2B_STATES", "error_body", "WhoDep", "envd_access_token", "encode_cursor",
           "decode_cursor"]

# The envd protocol version podbay's envd API speaks: the SDK enables features by it (default user,
# closing stdin, octet-stream uploads, file metadata (0.6.2), entries in watch events (0.6.3), watching
# network mounts (0.6.4: podbay's watcher scans, so any filesystem can be watched)). Never raise it past a
# feature podbay lacks.
ENVD_VERSION = "0.6.4"
CLIENT_ID = "podbay"
# podbay states -> E2B's two; the others are not listed (and answer 404 where E2B has no word for them).
E2B_STATES = {"pending": "running", "starting": "running", "running": "running", "paused": "paused",
              "suspending": "paused", "suspended": "paused", "resuming": "running"}

def error_body(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """E2B's error shape."""
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


class _E2bRoute(APIRoute):
    """Answers every error of these routes in E2B's shape (validation errors are 400, as E2B's are)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except PodbayError as exc:
                # No capacity is 503 with Retry-After, as E2B's API answers a placement without room.
                return error_body(exc.http_status, exc.message, retry_headers(exc))
            except asyncpg.DataError:
                return error_body(400, BAD_TEXT_MESSAGE)
            except RequestValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {}
                where = ".".join(str(p) for p in first.get("loc", ()))
                return error_body(400, f"{where}: {first.get('msg', 'invalid request')}")

        return handler



async def _principal(request: Request) -> Principal:
    """401 unless ``X-API-KEY`` (or a bearer header) holds a valid podbay API key."""
    ctx: ApiContext = request.app.state.ctx
    key = request.headers.get("x-api-key")
    return await authenticate(ctx.pool, f"Bearer {key}" if key else request.headers.get("authorization"),
                              on_refused=ctx.relay.kick)


WhoDep = Annotated[Principal, Depends(_principal)]


def envd_access_token(internal_token: str, sandbox_id: str) -> str:
    """The token the SDK sends to a sandbox's envd API (``X-Access-Token``): hex HMAC-SHA256."""
    return hmac.new(internal_token.encode(), f"e2b-envd:{sandbox_id}".encode(), hashlib.sha256).hexdigest()


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)



async def _exact_lease(ctx: ApiContext, who: Principal, sandbox_id: str, seconds: int, *,
                       only_extend: bool = False) -> None:
    """The lease runs out ``seconds`` from now, any length E2B accepts (podbay's own API keeps a 10 s floor).
    With ``only_extend`` a lease that already ends later is kept, as E2B's connect does."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        if row["state"] in ("deleting", "deleted"):
            raise NotFound(f"sandbox {sandbox_id} was not found")
        if await set_lease(conn, sandbox_id, seconds, only_extend=only_extend):
            await audit(conn, who, "sandbox.timeout", sandbox_id)


def _iso(ts: datetime | None) -> str:
    return (ts or datetime.now(UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")


def _sandbox(ctx: ApiContext, sandbox_id: str, template: str) -> dict[str, Any]:
    # sandboxID in E2B's spelling (a host label); the tokens are bound to the stored id, whatever the spelling.
    body: dict[str, Any] = {"templateID": template, "sandboxID": e2b_sandbox_id(sandbox_id), "alias": template,
                            "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                            "envdAccessToken": envd_access_token(ctx.settings.internal_token, sandbox_id)}
    if ctx.settings.e2b_domain:
        body["domain"] = ctx.settings.e2b_domain
    return body



async def _row(ctx: ApiContext, who: Principal, sandbox_id: str) -> Any:
    """The caller's sandbox in a state E2B knows; NotFound ("... was not found") otherwise."""
    try:
        row = await load_sandbox(ctx.pool, who.tenant_id, sandbox_id)
    except NotFound:
        row = None
    if row is None or row["state"] not in E2B_STATES:
        raise NotFound(f"sandbox {sandbox_id} was not found")
    return row


def encode_cursor(created_at: datetime, row_id: str) -> str:
    """E2B's ``nextToken`` for a list page that ends at (``created_at``, ``row_id``): opaque to the SDK, which
    sends it back as given (url-safe base64 of a JSON pair)."""
    return base64.urlsafe_b64encode(json.dumps([created_at.isoformat(), row_id]).encode()).decode()


def decode_cursor(raw: str | None) -> tuple[datetime, str] | None:
    """The (created_at, id) a ``nextToken`` from :func:`encode_cursor` names; None for none. Raises
    ``InvalidRequest`` (400) for a token this server did not issue."""
    if not raw:
        return None
    try:
        ts, sid = json.loads(base64.urlsafe_b64decode(raw.encode()))
        return datetime.fromisoformat(ts), str(sid)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest("nextToken is not one this server issued") from exc
