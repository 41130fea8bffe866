"""Fixtures of the security tests: each module under ``tests/security`` checks one trust boundary of
docs/SECURITY.md (tenant vs tenant, guest vs host, image vs host, client vs node).

tests/conftest.py marks every test here ``security`` and, unless the module marks itself ``e2e``
(``pytestmark = pytest.mark.e2e``: it needs real microVMs and the base template, skipped under
``PODBAY_SKIP_E2E=1``), ``integration``: it runs against the real servers of the session fixtures (``stack``,
``pg_dsn``, ...). The helpers of tests/integration (``access_helpers``: fresh tenants, SQL on the stack) are
importable here as ``from access_helpers import ...``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from podbay import db

# pytest's prepend import mode puts only this folder on sys.path; the integration helpers are shared.
_INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
if _INTEGRATION not in sys.path:
    sys.path.insert(0, _INTEGRATION)


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool (at most 8 connections) on the session's PostgreSQL with podbay's migrations applied."""
    p = await db.connect_pool(pg_dsn, min_size=1, max_size=8)
    await db.migrate(p)
    yield p
    await p.close()
