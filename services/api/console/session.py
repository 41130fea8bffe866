"""Console sessions: an API key signs a browser in; the browser then holds a session cookie, not the key.

``POST /console/session`` checks the key with :func:`services.api.auth.authenticate` and opens a session:
a random id (32 bytes, URL-safe base64) goes to the browser as the ``podbay_session`` cookie (HttpOnly,
SameSite=Strict, Secure when the request came over https, Path=/); PostgreSQL keeps only its sha256 with the
key's id and tenant, a CSRF token and an expiry (``console_sessions``, migration 0034). A session acts as its
key: revoking the key ends it (the lookup joins ``api_keys`` and refuses a revoked one).

CSRF (synchronizer token): every request authenticated by the cookie whose method is not GET, HEAD or
OPTIONS must carry the session's token in ``X-CSRF-Token`` (compared in constant time), else 403
``csrf_refused``. The console's JavaScript reads the token from ``GET /console/session`` (same origin only:
the API sends no CORS headers) and sends it on each change. A WebSocket cannot carry headers from a
browser: the terminal's handshake carries the token as the ``csrf`` query parameter and its ``Origin`` must
be the API's own host (:func:`websocket_principal`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from starlette.datastructures import Headers

from podbay.errors import CsrfRefused, Unauthorized

from ..core.auth import Principal, authenticate

__all__ = ["COOKIE", "CSRF_HEADER", "SAFE_METHODS", "SESSION_TTL_S", "ConsoleSession", "open_session", "find_session",
           "close_session", "cookie_principal", "request_principal", "websocket_principal"]

COOKIE = "podbay_session"
CSRF_HEADER = "x-csrf-token"
# Methods that never change state: the cookie alone authorises them.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A session lasts a working day from sign-in, then the person signs in again.
SESSION_TTL_S = 12 * 3600


@dataclass(frozen=True)
class ConsoleSession:
    """A live session: who it acts as, its CSRF token and when it ends (UTC)."""

    principal: Principal
    csrf: str
    expires_at: datetime


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


async def open_session(pool: asyncpg.Pool, principal: Principal, ttl_s: int = SESSION_TTL_S) -> tuple[str, str]:
    """Store a new session for ``principal`` lasting ``ttl_s`` seconds; returns ``(session_id, csrf_token)``.
    Sessions that have run out (anyone's) are deleted on the way."""
    session_id = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("DELETE FROM console_sessions WHERE expires_at < now()")
        await conn.execute(
            "INSERT INTO console_sessions (id_hash, key_id, tenant_id, csrf_token, expires_at)"
            " VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))",
            _digest(session_id), principal.key_id, principal.tenant_id, csrf, float(ttl_s))
    return session_id, csrf


async def find_session(pool: asyncpg.Pool, session_id: str | None) -> ConsoleSession | None:
    """The live session of ``session_id``: None when unknown, expired, or its key was revoked."""
    if not session_id or len(session_id) > 128:
        return None
    row = await pool.fetchrow(
        "SELECT s.key_id, s.tenant_id, s.csrf_token, s.expires_at FROM console_sessions s"
        " JOIN api_keys k ON k.id = s.key_id"
        " WHERE s.id_hash = $1 AND s.expires_at > now() AND k.revoked_at IS NULL", _digest(session_id))
    if row is None:
        return None
    return ConsoleSession(Principal(tenant_id=row["tenant_id"], key_id=row["key_id"]), row["csrf_token"],
                          row["expires_at"])


async def close_session(pool: asyncpg.Pool, session_id: str | None) -> None:
    """Forget ``session_id`` (sign out); nothing when it is unknown."""
    if session_id:
        await pool.execute("DELETE FROM console_sessions WHERE id_hash = $1", _digest(session_id))


def _token_matches(given: str | None, want: str) -> bool:
    return bool(given) and hmac.compare_digest(str(given).encode(), want.encode())


async def cookie_principal(pool: asyncpg.Pool, session_id: str, method: str, csrf: str | None) -> Principal:
    """The principal of a cookie-authenticated request: Unauthorized (401) for a dead session, CsrfRefused
    (403) for a change (``method`` not in SAFE_METHODS) whose ``csrf`` is not the session's token."""
    session = await find_session(pool, session_id)
    if session is None:
        raise Unauthorized("the console session has expired or was signed out: sign in again")
    if method.upper() not in SAFE_METHODS and not _token_matches(csrf, session.csrf):
        raise CsrfRefused(f"a console session's {method.upper()} needs its CSRF token in X-CSRF-Token")
    return session.principal


async def request_principal(pool: asyncpg.Pool, method: str, headers: Headers, cookies: dict[str, str],
                            on_refused: Callable[[], None] | None = None) -> Principal:
    """The caller of an HTTP request: the bearer key when ``Authorization`` is present (a key always wins,
    so API clients never meet CSRF), else the console session cookie; 401 when neither is valid."""
    authorization = headers.get("authorization")
    session_id = cookies.get(COOKIE)
    if authorization or not session_id:
        return await authenticate(pool, authorization, on_refused=on_refused)
    return await cookie_principal(pool, session_id, method, headers.get(CSRF_HEADER))


async def websocket_principal(pool: asyncpg.Pool, headers: Headers, cookies: dict[str, str],
                              query_csrf: str | None) -> Principal:
    """The caller of a WebSocket handshake: the bearer key when sent; otherwise the session cookie, with the
    session's CSRF token as ``query_csrf`` and an ``Origin`` whose host is the request's own ``Host``
    (a page of another site must not open a terminal with the person's cookie)."""
    authorization = headers.get("authorization")
    session_id = cookies.get(COOKIE)
    if authorization or not session_id:
        return await authenticate(pool, authorization)
    origin = headers.get("origin", "")
    host = headers.get("host", "")
    if not host or origin.split("://", 1)[-1] != host:
        raise CsrfRefused("a console terminal must be opened from the console's own origin")
    session = await find_session(pool, session_id)
    if session is None:
        raise Unauthorized("the console session has expired or was signed out: sign in again")
    if not _token_matches(query_csrf, session.csrf):
        raise CsrfRefused("a console terminal needs the session's CSRF token (csrf query parameter)")
    return session.principal
