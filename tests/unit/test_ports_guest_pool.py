"""The node's port proxy keeps one pool of guest connections per holder of a guest address (sandbox id and VM
generation; services/nodeagent/net/ports.py ``PortsProxy._client_for``): an address leased again, or a VM restored
at a new generation, gets a fresh pool, so a kept-alive connection to the previous holder is never reused (it
would end in a reset, 502 ``port_error``, on the new sandbox's first request)."""

from __future__ import annotations

import asyncio

from podbay_nodeagent.net.ports import PortsProxy


async def test_a_new_holder_of_a_guest_address_gets_a_new_pool_and_the_old_one_is_closed() -> None:
    proxy = PortsProxy(app=None, manager=None)  # type: ignore[arg-type]
    first = proxy._client_for("10.0.0.2", ("sbx_a", 1))
    assert proxy._client_for("10.0.0.2", ("sbx_a", 1)) is first  # the same holder keeps its connections
    other = proxy._client_for("10.0.0.3", ("sbx_b", 1))
    assert other is not first
    reused = proxy._client_for("10.0.0.2", ("sbx_c", 1))  # the address leased to another sandbox
    assert reused is not first
    restored = proxy._client_for("10.0.0.2", ("sbx_c", 2))  # the same sandbox at a new generation
    assert restored is not reused
    await asyncio.sleep(0)
    await asyncio.gather(*proxy._closing)
    assert first.is_closed and reused.is_closed
    assert not other.is_closed and not restored.is_closed
    await proxy.aclose()
    assert other.is_closed and restored.is_closed
