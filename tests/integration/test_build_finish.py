"""A build's ``template_builds`` row never stays ``running`` with no build behind it (which would refuse every
later build of the name), against a real PostgreSQL: the node records a build's end even when its task is
cancelled while recording it (services/nodeagent/build/http.py ``record_outcome``), and the API fails a row
whose node is gone before it refuses a new build (services/api/services/templates.py ``fail_stale_build``); and a
build's row is finished before its stream's last event is sent, so a caller that lists the builds on ``done``
finds it ``succeeded``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import httpx
import pytest

from fastapi import FastAPI
from fastapi.routing import APIRoute

from podbay.contracts.templates import BuildEvent, BuildSpec, BuildState, FromRef, NodeBuildRequest, TemplateDetail
from podbay.errors import Unprocessable
from podbay.outbox import new_id
from podbay_api.services.templates import fail_stale_build
from podbay_nodeagent.build.http import add_build_routes, record_outcome


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


async def _running_build(pool: asyncpg.Pool, *, node_state: str, age_s: float) -> tuple[str, str]:
    node, build_id, name = new_id("node"), new_id("bld"), f"stale-{new_id('t')[-8:].lower()}"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:9', 1024, 1, 'tcg', $2)", node, node_state)
    await pool.execute("INSERT INTO template_builds (id, name, tenant_id, node_id, dockerfile, created_at) VALUES"
                       " ($1, $2, 'tnt', $3, 'FROM base', now() - make_interval(secs => $4))",
                       build_id, name, node, age_s)
    return build_id, name


async def test_stale_build_of_a_gone_node_is_failed(pool: asyncpg.Pool) -> None:
    build_id, name = await _running_build(pool, node_state="lost", age_s=600.0)
    async with httpx.AsyncClient() as http:
        assert await fail_stale_build(pool, http, {}, name) is True
    row = await pool.fetchrow("SELECT state, error FROM template_builds WHERE id=$1", build_id)
    assert row["state"] == "failed"
    assert row["error"]["code"] == "interrupted"


@pytest.mark.parametrize(("node_state", "age_s"), [("lost", 0.0), ("ready", 600.0)])
async def test_fresh_or_unconfirmed_build_is_left_running(pool: asyncpg.Pool, node_state: str, age_s: float) -> None:
    """A row younger than the grace (the node may not have claimed the name yet), or one whose ready node does
    not answer (it may still be building), is not failed."""
    build_id, name = await _running_build(pool, node_state=node_state, age_s=age_s)
    async with httpx.AsyncClient() as http:
        assert await fail_stale_build(pool, http, {}, name) is False
    assert await pool.fetchval("SELECT state FROM template_builds WHERE id=$1", build_id) == "running"


class _SlowPool:
    """The real pool, whose writes land only after a delay: a terminal event sent before the write is seen."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def execute(self, *args: Any) -> str:
        await asyncio.sleep(0.5)
        return str(await self._pool.execute(*args))


class _Builder:
    """A builder whose build succeeds at once (or fails with ``error``), with no VM."""

    def __init__(self, name: str, error: Exception | None) -> None:
        self.name, self.error = name, error

    def check_parent(self, spec: BuildSpec) -> None:
        pass

    @contextlib.contextmanager
    def claim(self, name: str) -> Iterator[None]:
        yield

    def resolve(self, req: Any) -> list[Any]:
        return []

    async def build(self, req: Any, steps: list[Any], emit: Any) -> TemplateDetail:
        if self.error is not None:
            raise self.error
        return TemplateDetail(name=self.name, digest="d" * 64, memory_mib=512, vcpus=1,
                              created_at=datetime.now(UTC))


@pytest.mark.parametrize("fails", [False, True])
async def test_the_row_is_finished_before_the_last_event_is_sent(pool: asyncpg.Pool, tmp_path: Path,
                                                                 fails: bool) -> None:
    build_id, name = new_id("bld"), f"order-{new_id('t')[-8:].lower()}"
    await pool.execute("INSERT INTO template_builds (id, name, tenant_id, node_id, dockerfile) VALUES"
                       " ($1, $2, 'tnt', 'node', 'FROM base')", build_id, name)
    error = Unprocessable("no such thing") if fails else None
    manager = SimpleNamespace(builder=_Builder(name, error), pool=_SlowPool(pool), store=SimpleNamespace(root=tmp_path))
    app = FastAPI()
    add_build_routes(app, manager)  # a namespace of the three things the endpoint uses
    [endpoint] = [r.endpoint for r in app.routes if isinstance(r, APIRoute) and r.path.endswith("/build")]
    params = NodeBuildRequest(build_id=build_id, name=name,
                              spec=BuildSpec(base=FromRef(kind="template", ref="base"))).model_dump_json()
    # The data plane's grant check leaves the verified grant in the scope; the route checks its build id.
    request = SimpleNamespace(scope={"podbay.grant": SimpleNamespace(subject=build_id)})
    resp = await endpoint(request=request, params=params, context=None)
    last: BuildEvent | None = None
    async for line in resp.body_iterator:  # read as a caller does, event by event
        last = BuildEvent.model_validate_json(line)
        if last.type in ("done", "failed"):
            break
    assert last is not None and last.type == ("failed" if fails else "done")
    row = await pool.fetchrow("SELECT state, digest FROM template_builds WHERE id=$1", build_id)
    assert row["state"] == ("failed" if fails else "succeeded"), row
    assert row["digest"] == (None if fails else "d" * 64)
    await resp.body_iterator.aclose()
