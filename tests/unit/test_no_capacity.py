"""A create no node has room for: the API's 503 ``no_capacity`` with ``Retry-After`` (services/api/core/errors.py,
the E2B route's shape too), the SDK's typed ``NoCapacity`` and the CLI's one error line."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, FastAPI
from test_cli import assert_error_line, run
from test_sdk_fake import API_KEY, FakeApi, _served, clean_env, fake_api  # noqa: F401  (fixtures)

from podbay.errors import NoCapacity, Unavailable, error_from_wire
from podbay.sdk import Client
from podbay_api.e2b.sandboxes import _E2bRoute
from podbay_api.core.errors import install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/sandboxes")
    async def create() -> None:
        raise NoCapacity("no node has room for sandbox sbx_1: no node has room for 256 MiB",
                         details={"sandbox_id": "sbx_1", "retry_after_s": 5})

    e2b = APIRouter(prefix="/e2b", route_class=_E2bRoute)

    @e2b.post("/sandboxes")
    async def e2b_create() -> None:
        raise NoCapacity("no node has room for sandbox sbx_2")

    app.include_router(e2b)
    return app


async def test_the_api_answers_503_no_capacity_with_retry_after() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://api") as c:
        r = await c.post("/v1/sandboxes")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "no_capacity"
        assert "no node has room" in r.json()["error"]["message"]
        e2b = await c.post("/e2b/sandboxes")
        assert e2b.status_code == 503 and e2b.headers["retry-after"] == str(NoCapacity.DEFAULT_RETRY_AFTER_S)
        assert e2b.json() == {"code": 503, "message": "no node has room for sandbox sbx_2"}


def test_the_wire_shape_becomes_no_capacity_a_retryable_unavailable() -> None:
    exc = error_from_wire({"error": {"code": "no_capacity", "message": "full", "details": {"retry_after_s": 9}}}, 503)
    assert isinstance(exc, NoCapacity) and isinstance(exc, Unavailable) and exc.retryable
    assert exc.retry_after_s == 9 and exc.http_status == 503
    assert NoCapacity("full").retry_after_s == NoCapacity.DEFAULT_RETRY_AFTER_S


def test_the_sdk_raises_no_capacity(fake_api: FakeApi) -> None:
    with Client(fake_api.url, API_KEY) as c:
        try:
            c.create_sandbox("full")
        except NoCapacity as exc:
            assert exc.retry_after_s == 7 and exc.details["sandbox_id"] == "sb-full"
        else:
            raise AssertionError("no NoCapacity")


def test_the_cli_prints_no_capacity_and_exits_1(fake_api: FakeApi) -> None:
    result = run(fake_api, "sandbox", "create", "--template", "full")
    assert_error_line(result, "no_capacity", 1)
    assert "no node has room" in result.stderr
