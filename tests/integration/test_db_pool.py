"""``podbay.db.connect_pool`` against a real PostgreSQL: a release costs no reset round trip (the session is
kept), yet a transaction left open is rolled back before the connection serves anyone else; a refused login
fails at once as ``DatabaseRefused``, while a server that does not answer is retried until ``Unavailable``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import asyncpg
import pytest

from podbay import db
from podbay.devstack.procs import free_port
from podbay.errors import Unavailable


def _with(dsn: str, *, user: str | None = None, password: str | None = None, database: str | None = None,
          port: int | None = None) -> str:
    """``dsn`` with some of its parts replaced."""
    parts = urlsplit(dsn)
    netloc = (f"{quote(user or unquote(parts.username or ''), safe='')}:"
              f"{quote(password if password is not None else unquote(parts.password or ''), safe='')}"
              f"@{parts.hostname}:{port or parts.port}")
    return urlunsplit(parts._replace(netloc=netloc, path="/" + quote(database, safe="") if database else parts.path))


@pytest.fixture
async def one(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool of exactly one connection, so every acquire gets the connection the last release returned."""
    p = await db.connect_pool(pg_dsn, min_size=1, max_size=1)
    yield p
    await p.close()


async def test_release_runs_no_reset_query(one: asyncpg.Pool) -> None:
    # asyncpg's default reset ends with RESET ALL, which would put application_name back; a session setting
    # that survives the release shows no reset query ran.
    async with one.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        await conn.execute("SELECT set_config('application_name', 'podbay-pool-test', false)")
    async with one.acquire() as conn:
        assert await conn.fetchval("SELECT pg_backend_pid()") == pid
        assert await conn.fetchval("SHOW application_name") == "podbay-pool-test"


async def test_a_transaction_left_open_is_rolled_back_at_release(one: asyncpg.Pool) -> None:
    async with one.acquire() as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS pool_reset_probe (v int)")
        tx = conn.transaction()
        await tx.start()
        await conn.execute("INSERT INTO pool_reset_probe VALUES (1)")
        # Released without commit or rollback (a cancelled request would do this).
    async with one.acquire() as conn:
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM pool_reset_probe") == 0
        await conn.execute("DROP TABLE pool_reset_probe")


@pytest.mark.parametrize("change", [
    {"password": "not-the-password"},
    {"user": "no_such_role"},
    {"database": "no_such_database"},
], ids=["wrong-password", "no-such-role", "no-such-database"])
async def test_a_refused_login_fails_at_once_and_says_so(pg_dsn: str, change: dict[str, str]) -> None:
    # Were the refusal retried, the error would be Unavailable, at the end of the window.
    with pytest.raises(db.DatabaseRefused) as caught:
        await db.connect_pool(_with(pg_dsn, **change), timeout_s=20)
    assert caught.value.code == "database_refused" and not caught.value.retryable
    assert "refused the login" in caught.value.message and "PODBAY_PG_DSN" in caught.value.message
    assert "not-the-password" not in caught.value.message  # the DSN is shown redacted


async def test_a_server_that_does_not_answer_is_retried_until_unavailable(pg_dsn: str) -> None:
    with pytest.raises(Unavailable) as caught:
        await db.connect_pool(_with(pg_dsn, port=free_port()), timeout_s=1)
    assert caught.value.retryable and "did not answer" in caught.value.message
