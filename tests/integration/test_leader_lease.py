"""``podbay.lease`` against a real JetStream KV bucket: one holder at a time, renewal fenced by revision,
release hands over at once, and a holder that stops renewing loses the lease to a standby after the TTL."""

from __future__ import annotations

import asyncio
import os

import pytest

from podbay.bus import connect_bus
from podbay.lease import Lease

pytestmark = pytest.mark.integration

TTL_S = 2.0


async def _until(pred: object, bound_s: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while loop.time() < end:
        if await pred():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.1)
    return False


async def test_one_holder_release_and_takeover_after_ttl(nats_url: str) -> None:
    name = f"test-{os.urandom(3).hex()}"
    buses = [await connect_bus(nats_url, name=f"lease-{i}", heartbeat_ttl_s=60) for i in range(3)]
    a, b, c = (Lease(bus, name, ttl_s=TTL_S, holder=h) for bus, h in zip(buses, "abc", strict=True))
    try:
        assert await a.tick() and a.held
        assert not await b.tick() and not b.held
        assert await a.tick()  # a renewal keeps it
        assert not await b.tick()

        await a.release()  # a clean stop: the standby takes over at its next try
        assert not a.held
        assert await b.tick() and b.held
        assert not await c.tick()

        # b dies (stops renewing): c acquires once the TTL has expired the key, and only then.
        assert await _until(c.tick)
        # b comes back: its renewal is refused (the revision moved on), so it steps down.
        assert not await b.tick() and not b.held
        assert c.held and await c.tick()
    finally:
        for lease in (a, b, c):
            await lease.release()
        for bus in buses:
            await bus.close()
