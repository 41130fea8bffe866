"""The API's request metrics middleware (``RequestMetrics``): route template, method and status class."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
import httpx
from collections.abc import AsyncIterator

from podbay.telemetry import HTTP_REQUEST_SECONDS
from podbay_api.app import RequestMetrics


def _count(path: str, method: str, status: str) -> float:
    return sum(
        s.value for m in HTTP_REQUEST_SECONDS.collect() for s in m.samples
        if s.name.endswith("_count") and s.labels == {"service": "api", "route": path, "method": method,
                                                      "status": status})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    app.add_middleware(RequestMetrics)

    @app.get("/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    @app.post("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


async def test_counts_by_route_template_and_status_class(client: httpx.AsyncClient) -> None:
    before = _count("/things/{thing_id}", "GET", "2xx")
    assert (await client.get("/things/a")).status_code == 200
    assert (await client.get("/things/b")).status_code == 200
    assert _count("/things/{thing_id}", "GET", "2xx") == before + 2


async def test_unmatched_and_failing_requests_are_counted(client: httpx.AsyncClient) -> None:
    unmatched, failed = _count("unmatched", "GET", "4xx"), _count("/boom", "POST", "5xx")
    assert (await client.get("/nowhere")).status_code == 404
    assert (await client.post("/boom")).status_code == 500
    assert _count("unmatched", "GET", "4xx") == unmatched + 1
    assert _count("/boom", "POST", "5xx") == failed + 1
