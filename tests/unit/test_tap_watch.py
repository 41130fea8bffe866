"""The tap watch (services/nodeagent/net/tapwatch.py): every VM's tap checked from one listing per pass."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from podbay_nodeagent.net.tapwatch import check_taps


class _Net:
    """Leases of ``count`` VMs whose taps are all there but ``gone``; counts the listings."""

    def __init__(self, count: int, gone: set[str]) -> None:
        self.leases = {f"sbx{i}": SimpleNamespace(tap=f"pbt{i}") for i in range(count)}
        self.gone = gone
        self.listings = 0

    def leased(self) -> dict[str, Any]:
        return dict(self.leases)

    def taps_intact(self, taps: list[str]) -> dict[str, bool]:
        self.listings += 1
        return {t: t not in self.gone for t in taps}

    def tap_intact(self, tap: str) -> bool:
        raise AssertionError("a tap checked on its own: one call (and one thread hop) per VM")


async def test_a_pass_lists_the_devices_once_and_renews_only_the_vm_whose_tap_vanished() -> None:
    net = _Net(150, gone={"pbt7"})
    renewed: list[str] = []

    async def renew_vm(sid: str, why: str, *, still: Any = None) -> bool:
        renewed.append(sid)
        return True

    vms = {sid: SimpleNamespace(stopping=False) for sid in net.leases}
    vms["sbx9"].stopping = True
    net.gone.add("pbt9")  # a stopping VM's tap goes with it: nothing to repair
    manager = SimpleNamespace(net=net, vms=vms, renew_vm=renew_vm)
    assert await check_taps(manager) == ["sbx7"]
    assert renewed == ["sbx7"] and net.listings == 1
    assert await asyncio.wait_for(check_taps(manager), 5) == ["sbx7"]
    assert net.listings == 2
