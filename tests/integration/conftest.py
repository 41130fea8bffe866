"""Fixtures shared by the integration tests (real servers; the session ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from access_helpers import Tenant, new_tenant

from podbay import db
from podbay.devstack.stack import Stack


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool (at most 8 connections) on the session's PostgreSQL with podbay's migrations applied."""
    p = await db.connect_pool(pg_dsn, min_size=1, max_size=8)
    await db.migrate(p)
    yield p
    await p.close()


@pytest.fixture
def acme(stack: Stack) -> Tenant:
    """A fresh tenant with an API key of its own (access_helpers.new_tenant); a module may override it."""
    return new_tenant(stack, "acme")


@pytest.fixture
def other(stack: Stack) -> Tenant:
    """A second fresh tenant, for what one tenant must not see or touch of another's."""
    return new_tenant(stack, "other")
