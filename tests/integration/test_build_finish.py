"""A build's end is recorded in ``template_builds`` even when its task is cancelled while recording it
(services/nodeagent/build/http.py ``record_outcome``), against a real PostgreSQL: a build whose caller
went away must not stay ``running``, which would refuse every later build of the name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from podbay import db
from podbay.contracts.templates import BuildState
from podbay.outbox import new_id
from podbay_nodeagent.build.http import record_outcome


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.connect_pool(pg_dsn, min_size=1, max_size=4)
    await db.migrate(p)
    yield p
    await p.close()


async def test_outcome_recorded_through_repeated_cancellation(pool: asyncpg.Pool) -> None:
    build_id, name = new_id("bld"), f"finish-{new_id('t')[-8:].lower()}"
    await pool.execute("INSERT INTO template_builds (id, name, tenant_id, node_id, dockerfile) VALUES"
                       " ($1, $2, 'tnt', 'node', 'FROM base')", build_id, name)
    started = asyncio.Event()

    async def build() -> None:  # as the endpoint's build task: cut off, then its finaliser cut off again
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await record_outcome(pool, build_id, BuildState.FAILED, None,
                                 {"code": "interrupted", "message": "the caller went away"})

    task = asyncio.create_task(build())
    await started.wait()
    task.cancel()
    await asyncio.sleep(0)  # the finaliser has started its write
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    row = await pool.fetchrow("SELECT state, error FROM template_builds WHERE id=$1", build_id)
    assert row["state"] == "failed"
    assert row["error"]["code"] == "interrupted"
