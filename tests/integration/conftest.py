"""Fixtures shared by the integration tests (real servers; the session ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from podbay import db


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool (at most 8 connections) on the session's PostgreSQL with podbay's migrations applied."""
    p = await db.connect_pool(pg_dsn, min_size=1, max_size=8)
    await db.migrate(p)
    yield p
    await p.close()
