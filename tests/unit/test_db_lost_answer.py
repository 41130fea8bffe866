"""A PostgreSQL connection lost during a request (a restart, a failover) is answered 503 ``unavailable`` with
``Retry-After``, which clients retry, not 500; other errors stay 500. The restart under load itself is
tests/faults."""

from __future__ import annotations

import asyncpg
import httpx
from fastapi import FastAPI

from podbay_api.core.errors import install_error_handlers


def _app(exc: Exception) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/x")
    async def x() -> None:
        raise exc

    return app


async def _get(exc: Exception) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app(exc), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.get("/x")


async def test_a_lost_database_connection_is_a_retryable_503() -> None:
    for exc in (asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
                asyncpg.CannotConnectNowError("the database system is starting up"),
                asyncpg.AdminShutdownError("terminating connection due to administrator command"),
                asyncpg.InterfaceError("cannot call Transaction.__aexit__(): the underlying connection is closed"),
                ConnectionRefusedError(111, "Connection refused")):
        r = await _get(exc)
        assert r.status_code == 503, (exc, r.text)
        assert r.json()["error"]["code"] == "unavailable" and r.headers["retry-after"] == "1"


async def test_a_broken_connection_s_protocol_state_is_a_503_too_and_other_errors_stay_500() -> None:
    # What asyncpg raises on a connection that broke mid-query during a PostgreSQL restart.
    r = await _get(asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress"))
    assert r.status_code == 503
    r = await _get(asyncpg.InterfaceError("cannot perform operation: another operation is in progress"))
    assert r.status_code == 503
    r = await _get(RuntimeError("a bug"))
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
