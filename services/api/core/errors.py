"""Error handlers: every error leaves the API as ``{"error": {"code", "message", "details"?}}``."""

from __future__ import annotations

import logging

import asyncpg

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from podbay.errors import NoCapacity, PodbayError, validation_message

__all__ = ["install_error_handlers", "retry_headers", "BAD_TEXT_MESSAGE", "DB_LOST"]

log = logging.getLogger("podbay.api")

#: What PostgreSQL says when a client's value cannot be stored or compared as text (a NUL byte, bad UTF-8).
BAD_TEXT_MESSAGE = "a value in the request is not valid text (NUL bytes and invalid UTF-8 are refused)"

_HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               409: "conflict", 413: "too_large", 415: "unsupported_media_type", 422: "validation_error"}


#: Errors of a PostgreSQL connection that broke or could not be made (a restart, a failover): answered 503.
DB_LOST: tuple[type[Exception], ...] = (
    asyncpg.PostgresConnectionError, asyncpg.AdminShutdownError, asyncpg.CrashShutdownError,
    asyncpg.CannotConnectNowError, asyncpg.InterfaceError, asyncpg.InternalClientError, ConnectionRefusedError,
    ConnectionResetError,
)


def retry_headers(exc: PodbayError) -> dict[str, str] | None:
    """``Retry-After`` (seconds) for an error that says when to try again (``NoCapacity``), else None."""
    return {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, NoCapacity) else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PodbayError)
    async def _podbay(_: Request, exc: PodbayError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.http_status, headers=retry_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": ".".join(str(p) for p in e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in exc.errors()
        ]
        return JSONResponse(
            {
                "error": {
                    "code": "validation_error",
                    "message": validation_message(exc.errors()[0]) if errors else "invalid",
                    "details": {"errors": errors},
                }
            },
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code)

    @app.exception_handler(asyncpg.DataError)
    async def _bad_text(_: Request, exc: asyncpg.DataError) -> JSONResponse:
        # Ids and names from the path or body reach queries as text parameters; PostgreSQL refuses NUL there
        # (CharacterNotInRepertoireError). That is the client's input, not a server fault.
        log.info("refused a value PostgreSQL cannot hold: %s", exc)
        return JSONResponse({"error": {"code": "invalid_request", "message": BAD_TEXT_MESSAGE}}, status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client went away mid-upload; nobody reads this answer, and nothing was written (atomic writes).
        log.info("client disconnected during the request")
        return JSONResponse({"error": {"code": "client_disconnected", "message": "client disconnected"}},
                            status_code=400)

    async def _db_lost(_: Request, exc: Exception) -> JSONResponse:
        # PostgreSQL restarting or failing over: the connection broke mid-request or a new one was refused.
        # Whatever the request did was in a transaction that did not commit (or, for a lost commit answer,
        # is found by the retry: creates carry an Idempotency-Key). 503 says "try again", not "podbay broke".
        # asyncpg's InterfaceError covers a closed connection, and with InternalClientError the protocol state
        # a connection broken mid-query is left in ("cannot switch to state 15; another operation (2) is in
        # progress"), seen during restarts; their traceback is logged, so a real misuse still shows.
        log.warning("database connection lost during a request: %s: %s", type(exc).__name__, exc,
                    exc_info=isinstance(exc, asyncpg.InterfaceError | asyncpg.InternalClientError))
        return JSONResponse({"error": {"code": "unavailable", "message": "the database is not reachable right "
                                       "now; try again"}}, status_code=503, headers={"Retry-After": "1"})

    for lost in DB_LOST:
        app.add_exception_handler(lost, _db_lost)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"error": {"code": "internal", "message": "internal error"}}, status_code=500)
