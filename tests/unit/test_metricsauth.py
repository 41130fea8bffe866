"""podbay.metricsauth and the health ports' /metrics (podbay.service.health_app): anonymous only while no
PODBAY_METRICS_TOKEN is set."""

from __future__ import annotations

import httpx
import pytest

from podbay import config
from podbay.config import Settings
from podbay.metricsauth import bearer, token_matches
from podbay.service import health_app


def test_bearer_and_token_matches() -> None:
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer(None) is None and bearer("Basic abc") is None and bearer("Bearer ") is None
    assert token_matches("Bearer s3cret", "s3cret")
    assert not token_matches("Bearer s3cre", "s3cret") and not token_matches(None, "s3cret")
    assert not token_matches("Bearer ", "") and not token_matches("Bearer x", "")  # no token: nothing matches


@pytest.mark.parametrize("token", ["", "s3cret"])
async def test_health_port_metrics(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    monkeypatch.setattr(config, "_settings", Settings(metrics_token=token))
    app = health_app("scheduler", lambda: {"ok": True})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        anon = await client.get("/metrics")
        if not token:
            assert anon.status_code == 200  # loopback by default (PODBAY_HEALTH_HOST)
            return
        assert anon.status_code == 401 and anon.json()["error"]["code"] == "unauthorized"
        assert (await client.get("/metrics", headers={"authorization": "Bearer nope"})).status_code == 401
        ok = await client.get("/metrics", headers={"authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and "process_cpu_seconds_total" in ok.text
        assert (await client.get("/healthz")).status_code == 200  # probes stay anonymous
