"""Graceful shutdown of a JetStream consumer, and the readiness checks behind every ``/readyz``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from podbay.bus import consume
from podbay.health import run_checks, task_check
from podbay.service import health_app


class FakeMsg:
    """The parts of ``nats.aio.msg.Msg`` that ``consume`` and handlers use."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._ackd = False
        self.outcome: str | None = None

    async def ack(self) -> None:
        self._ackd, self.outcome = True, "ack"

    async def nak(self, delay: float | None = None) -> None:
        self._ackd, self.outcome = True, "nak"


class FakeSub:
    def __init__(self, msgs: list[FakeMsg]) -> None:
        self.msgs = msgs

    async def fetch(self, batch: int, timeout: float) -> list[FakeMsg]:
        if self.msgs:
            return [self.msgs.pop(0)]
        await asyncio.sleep(0.01)
        raise TimeoutError


async def test_stop_finishes_quick_handlers_and_hands_back_slow_ones() -> None:
    quick, slow = FakeMsg(b"quick"), FakeMsg(b"slow")
    stop = asyncio.Event()
    started = asyncio.Event()
    cancelled: list[bytes] = []

    async def handle(msg: Any) -> None:
        if msg.data == b"quick":
            await stop.wait()
            await asyncio.sleep(0)
            await msg.ack()  # finishes within the grace period after stop
            return
        started.set()
        try:
            await asyncio.Event().wait()  # never finishes on its own
        except asyncio.CancelledError:
            cancelled.append(msg.data)
            raise

    task = asyncio.create_task(consume(FakeSub([quick, slow]), handle, stop, finish_timeout_s=0.2))
    await asyncio.wait_for(started.wait(), 5)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert quick.outcome == "ack"
    assert slow.outcome == "nak" and cancelled == [b"slow"]  # handed back for redelivery, not left to ack_wait


async def test_a_handler_that_answered_before_the_cut_is_not_nak_ed_again() -> None:
    msg = FakeMsg(b"x")
    stop = asyncio.Event()

    async def handle(m: Any) -> None:
        await m.ack()
        stop.set()
        await asyncio.Event().wait()  # acked, then stuck in clean-up

    await asyncio.wait_for(consume(FakeSub([msg]), handle, stop, finish_timeout_s=0.1), 10)
    assert msg.outcome == "ack"


async def test_checks_report_reasons_errors_and_silence() -> None:
    async def fine() -> None:
        return None

    async def down() -> str:
        return "NATS not connected"

    async def broken() -> None:
        raise ConnectionRefusedError("refused")

    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    ok, results = await run_checks({"a": fine, "b": down, "c": broken,
                                    "d": task_check("loop", lambda: done), "e": task_check("loop", lambda: None)})
    assert not ok
    assert results == {"a": "ok", "b": "NATS not connected", "c": "ConnectionRefusedError: refused",
                       "d": "loop stopped", "e": "loop not started"}
    assert (await run_checks({"a": fine}))[0]


async def test_health_app_readyz_is_503_with_reasons_and_healthz_keeps_its_meaning() -> None:
    state = {"dep": "ok"}

    async def dep() -> str | None:
        return None if state["dep"] == "ok" else "postgres gone"

    app = health_app("scheduler", lambda: {"ok": True}, {"postgres": dep})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json() == {"service": "scheduler", "ready": True,
                                                     "checks": {"postgres": "ok"}}
        state["dep"] = "down"
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"] == {"postgres": "postgres gone"}
        assert (await c.get("/healthz")).status_code == 200  # alive, just not ready
