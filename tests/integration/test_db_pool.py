"""``podbay.db.connect_pool`` against a real PostgreSQL: a release costs no reset round trip (the session is
kept), yet a transaction left open is rolled back before the connection serves anyone else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from podbay import db


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
