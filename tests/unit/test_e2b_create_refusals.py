"""E2B create fields podbay cannot honour are refused in E2B's error shape, not accepted and ignored:
an ``mcp`` that is not a JSON object, an ``iam`` token E2B's API would refuse (a token type other than JWT-SVID), and
``autoResume`` with a filesystem-only auto-pause (services/api/e2b/sandboxes.py). Through the real route with the
principal and context replaced: a refusal comes before any database call."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from podbay_api.e2b import sandboxes as e2b
from podbay_api.core.auth import Principal
from podbay_api.core.deps import ctx_dep
from podbay_api.e2b.common import _principal


class _NoDatabase:
    """A context whose every attribute fails: the refused requests must not reach it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the request reached ctx.{name}")


def _client() -> httpx.AsyncClient:
    app = FastAPI()
    app.include_router(e2b.router)
    app.dependency_overrides[_principal] = lambda: Principal(tenant_id="t", key_id="k")
    app.dependency_overrides[ctx_dep] = lambda: _NoDatabase()
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mcp", ["time"], "mcp must be a JSON object"),
    ("mcp", "time", "mcp must be a JSON object"),
    ("iam", {"tokens": {"gh": {"audience": "https://example.com", "tokenType": "jwt"}}},
     "iam.tokens.gh.tokenType: only 'JWT-SVID' is supported"),
])
async def test_mcp_and_a_bad_iam_token_are_400_naming_the_field(field: str, value: Any, message: str) -> None:
    for path in ("/e2b/sandboxes", "/e2b/v2/sandboxes"):
        async with _client() as client:
            r = await client.post(path, json={"templateID": "base", field: value})
        assert r.status_code == 400, r.text
        body = r.json()
        assert set(body) == {"code", "message"} and body["code"] == 400
        assert body["message"].startswith(message)


async def test_a_filesystem_auto_pause_with_auto_resume_is_400() -> None:
    async with _client() as client:
        r = await client.post("/e2b/v2/sandboxes", json={"templateID": "base", "autoPause": True,
                                                          "autoPauseMemory": False, "autoResume": {"enabled": True}})
    assert r.status_code == 400 and "autoResume" in r.json()["message"], r.text


@pytest.mark.parametrize("value", [None, {}, {"tokens": {}}, {"tokens": None}])
def test_empty_mcp_and_iam_pass_the_check(value: Any) -> None:
    body = e2b.NewSandbox.model_validate({"templateID": "base", "mcp": value, "iam": value})
    e2b._refuse_unsupported(body)  # raises nothing


def test_an_mcp_object_passes_the_check() -> None:
    """What E2B's SDK sends with ``Sandbox.create(mcp=...)``: the SDK starts the gateway with it itself."""
    body = e2b.NewSandbox.model_validate({"templateID": "mcp-gateway", "mcp": {"time": {}, "github": {
        "githubPersonalAccessToken": "x"}}})
    e2b._refuse_unsupported(body)  # raises nothing
