"""Shared rate limits (libs/podbay/ratelimit.py) against a real PostgreSQL: two limiters on two pools, as two
API replicas would hold them, spend one budget. The shared-budget tests use a window far longer than a test,
so no window ends while one runs."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from podbay import db
from podbay.ratelimit import SharedRateLimiter

pytestmark = pytest.mark.integration

LONG_S = 10**9  # one window from 2001 to 2033


def _key() -> str:
    return f"test:{uuid.uuid4().hex}"


async def test_two_replicas_share_one_budget(pool: asyncpg.Pool, pg_dsn: str) -> None:
    other = await db.connect_pool(pg_dsn, min_size=1, max_size=2)
    try:
        a = SharedRateLimiter(pool, budget=20, window_s=LONG_S, batch=5)
        b = SharedRateLimiter(other, budget=20, window_s=LONG_S, batch=5)
        key = _key()
        assert [await a.allow(key) for _ in range(15)] == [True] * 15
        # b gets what a left (5), then the window's budget is gone for both.
        assert [await b.allow(key) for _ in range(10)] == [True] * 5 + [False] * 5
        assert not await a.allow(key)
        assert await pool.fetchval("SELECT used FROM rate_windows WHERE key = $1", key) == 20
        # Another key has its own budget.
        assert await a.allow(_key()) and await b.allow(_key())
    finally:
        await other.close()


async def test_concurrent_calls_on_two_replicas_admit_exactly_the_budget(pool: asyncpg.Pool, pg_dsn: str) -> None:
    other = await db.connect_pool(pg_dsn, min_size=1, max_size=4)
    try:
        a = SharedRateLimiter(pool, budget=20, window_s=LONG_S, batch=3)
        b = SharedRateLimiter(other, budget=20, window_s=LONG_S, batch=3)
        key = _key()
        # Each replica has more callers than the budget, so every token it reserves is spent.
        got = await asyncio.gather(*(lim.allow(key) for _ in range(25) for lim in (a, b)))
        assert got.count(True) == 20
    finally:
        await other.close()


async def test_a_refusal_lasts_until_the_window_ends(pool: asyncpg.Pool) -> None:
    lim = SharedRateLimiter(pool, budget=1, window_s=1)
    key = _key()
    for _ in range(50):  # the first call of a new window is admitted; a window is 1 s
        if await lim.allow(key):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("no call admitted in 5 s")
    assert not await lim.allow(key)  # refused locally until the window ends, without asking PostgreSQL
    for _ in range(50):
        if await lim.allow(key):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("still refused 5 s after a 1 s window")


async def test_rows_of_ended_windows_are_swept(pool: asyncpg.Pool) -> None:
    old = _key()
    await pool.execute("INSERT INTO rate_windows (key, window_start, ends_at, used, granted) VALUES ($1, 0, 1, 1, 1)",
                       old)
    lim = SharedRateLimiter(pool, budget=5, window_s=LONG_S)
    lim._swept -= 120  # due now: a limiter sweeps at most once a minute
    assert await lim.allow(_key())
    assert await pool.fetchval("SELECT count(*) FROM rate_windows WHERE key = $1", old) == 0
