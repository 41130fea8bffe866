"""Webhook delivery attempts with a fake pool and a mock transport: retry on 5xx up to the bound, no retry on
other 4xx, and the recorded state."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from podbay.webhooks import Deliverer


class FakePool:
    def __init__(self) -> None:
        self.updates: list[tuple[Any, ...]] = []

    async def execute(self, sql: str, *args: Any) -> None:
        self.updates.append(args)


def _run(statuses: list[int], max_attempts: int = 3) -> tuple[list[httpx.Request], tuple[Any, ...]]:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(statuses.pop(0) if statuses else 200)

    async def public(host: str, port: int) -> list[str]:
        return ["93.184.216.34"]  # "receiver" is a public host here, so the default destination check passes

    pool = FakePool()
    d = Deliverer(pool, bus=None, max_attempts=max_attempts, backoff_s=0.001, backoff_max_s=0.001,  # type: ignore[arg-type]
                  transport=httpx.MockTransport(handler), resolver=public)
    hook = {"id": "whk_1", "url": "http://receiver/x", "secret": "whsec_s"}
    asyncio.run(d._deliver(hook, b'{"type":"paused"}', {"id": "evt_1", "type": "paused"}, 42))  # type: ignore[arg-type]
    return seen, pool.updates[-1]


def test_5xx_is_retried_until_success() -> None:
    seen, (hook_id, ok, failed, status, attempts, error, seq) = _run([503, 500])
    assert len(seen) == 3 and (ok, failed, status, attempts, error, seq) == (1, 0, 200, 3, None, 42)
    assert {r.headers["podbay-event-id"] for r in seen} == {"evt_1"}


def test_gives_up_after_the_bound() -> None:
    seen, (_, ok, failed, status, attempts, error, _) = _run([500] * 10, max_attempts=3)
    assert len(seen) == 3 and (ok, failed, status, attempts) == (0, 1, 500, 3) and error == "HTTP 500"


def test_other_4xx_is_not_retried() -> None:
    seen, (_, ok, failed, status, attempts, error, _) = _run([410])
    assert len(seen) == 1 and (ok, failed, status, attempts, error) == (0, 1, 410, 1, "HTTP 410")
