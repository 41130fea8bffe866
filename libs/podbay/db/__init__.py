"""PostgreSQL access: connection pools, migrations, and the error conversion at the boundary.

Migrations are plain SQL files in ``migrations/`` named ``NNNN_name.sql``; ``migrate`` applies each one
once, in order, inside a transaction, under an advisory lock so concurrent starters do not race.
asyncpg errors are converted to ``podbay.errors`` with ``raise ... from``:

    PodbayError
    ├── Unavailable       503 unavailable      retryable (the server did not answer within the start-up window)
    └── DatabaseRefused   503 database_refused (the server answered and refused the login: not retried)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import asyncpg
from tenacity import retry_if_exception

from podbay.errors import PodbayError, Unavailable
from podbay.retrying import while_starting

__all__ = ["connect_pool", "DatabaseRefused", "migrate", "MIGRATION_LOCK_ID", "transaction"]

log = logging.getLogger("podbay.db")

MIGRATION_LOCK_ID = 0x706F6462  # "podb": one advisory lock id for schema changes


async def _init_conn(conn: asyncpg.Connection) -> None:
    import json

    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's ``reset`` (asyncpg >= 0.30): nothing beyond what asyncpg always does at release (roll back
    an open transaction, drop listener callbacks). asyncpg's default runs ``SELECT pg_advisory_unlock_all();
    CLOSE ALL; UNLISTEN *; RESET ALL`` at every release, one more round trip on every pooled statement (about
    0.3-0.8 ms here, twice on the warm create path). podbay keeps no session state on pooled connections:
    no LISTEN, no session ``SET``, no cursors outside a transaction, and advisory locks are transaction-scoped
    except ``migrate``'s, which it releases itself."""


class DatabaseRefused(PodbayError):
    """PostgreSQL answered and refused the login: wrong password, no such role or database, no ``pg_hba.conf``
    entry, no CONNECT privilege. Not retryable: waiting does not change the DSN (``PODBAY_PG_DSN``)."""

    code = "database_refused"
    http_status = 503


#: Errors that waiting does not cure (SQLSTATE 28000, 28P01, 3D000, 42501). Everything else that
#: ``create_pool`` raises (connection refused, "the database system is starting up" 57P03, too many
#: connections) may pass while the server starts, and is retried.
_REFUSED: tuple[type[BaseException], ...] = (
    asyncpg.InvalidAuthorizationSpecificationError,  # includes InvalidPasswordError; no such role; pg_hba
    asyncpg.InvalidCatalogNameError,  # no such database
    asyncpg.InsufficientPrivilegeError,  # CONNECT revoked
)
_TRANSIENT = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


def _worth_retrying(exc: BaseException) -> bool:
    return isinstance(exc, _TRANSIENT) and not isinstance(exc, _REFUSED)


async def connect_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, timeout_s: float = 30.0) -> asyncpg.Pool:
    """Open a pool (jsonb decoded to Python, no reset query at release: ``_keep_session``), retrying while the
    server starts (connection refused, starting up); ``Unavailable`` after ``timeout_s``. ``DatabaseRefused`` at
    the first refused login (wrong password, no such role or database), which no retry would cure."""
    try:
        async for attempt in while_starting(timeout_s, retry_if_exception(_worth_retrying)):
            with attempt:
                pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, init=_init_conn,
                                                 reset=_keep_session)
                assert pool is not None
                return pool
    except _REFUSED as exc:
        raise DatabaseRefused(
            f"PostgreSQL at {_redact(dsn)} refused the login: {exc} (check the user, password and database "
            "in PODBAY_PG_DSN)"
        ) from exc
    except _TRANSIENT as exc:
        raise Unavailable(f"PostgreSQL at {_redact(dsn)} did not answer: {exc}") from exc
    raise AssertionError("unreachable")


def _redact(dsn: str) -> str:
    if "@" in dsn and ":" in dsn.split("@", 1)[0].split("//", 1)[-1]:
        head, tail = dsn.split("@", 1)
        return head.rsplit(":", 1)[0] + ":***@" + tail
    return dsn


def _migrations() -> list[tuple[str, str]]:
    files = resources.files("podbay.db").joinpath("migrations")
    out = [(f.name, f.read_text()) for f in files.iterdir() if f.name.endswith(".sql")]
    return sorted(out)


async def migrate(pool: asyncpg.Pool) -> list[str]:
    """Apply pending migrations; returns the names applied now (empty when up to date)."""
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_ID)
        try:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
            for name, sql in _migrations():
                if name in done:
                    continue
                async with conn.transaction():
                    await conn.execute(sql)
                    await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", name)
                log.info("applied migration %s", name)
                applied_now.append(name)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_ID)
    return applied_now


@asynccontextmanager
async def transaction(pool: asyncpg.Pool) -> AsyncIterator[Any]:
    """``async with transaction(pool) as conn:`` — one connection, one transaction."""
    async with pool.acquire() as conn:
        async with conn.transaction():
            yield conn
