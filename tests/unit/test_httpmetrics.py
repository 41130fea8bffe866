"""The shared ASGI middleware (``podbay.httpmetrics``): the node's internal-token check and the request
metrics under a service's own label."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from podbay.httpmetrics import InternalToken, RequestMetrics
from podbay.telemetry import HTTP_REQUEST_SECONDS


def _count(service: str, route: str, status: str) -> float:
    return sum(
        s.value for m in HTTP_REQUEST_SECONDS.collect() for s in m.samples
        if s.name.endswith("_count") and s.labels == {"service": service, "route": route, "method": "GET",
                                                      "status": status})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    app.add_middleware(InternalToken, token="s3cret")
    app.add_middleware(RequestMetrics, service="nodeagent")

    @app.get("/internal/v1/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"x-podbay-internal-token": "wrong"}, {"x-podbay-internal-token": ""}])
async def test_internal_paths_refuse_a_missing_or_wrong_token(client: httpx.AsyncClient,
                                                              headers: dict[str, str]) -> None:
    r = await client.get("/internal/v1/things/a", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    assert "bad internal token" in r.json()["error"]["message"]


async def test_the_right_token_passes_and_is_counted_under_the_service(client: httpx.AsyncClient) -> None:
    before = _count("nodeagent", "/internal/v1/things/{thing_id}", "2xx")
    r = await client.get("/internal/v1/things/a", headers={"x-podbay-internal-token": "s3cret"})
    assert r.status_code == 200 and r.json() == {"id": "a"}
    assert _count("nodeagent", "/internal/v1/things/{thing_id}", "2xx") == before + 1


async def test_other_paths_need_no_token(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"ok": True}
