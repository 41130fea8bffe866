"""The node's heartbeat carries its CPU pressure and says when it is saturated (services/nodeagent/ops/heartbeat.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from podbay.config import Settings
from podbay.contracts.messages import NodeHeartbeat
from podbay.telemetry import CPU_PRESSURE
from podbay_nodeagent.ops import heartbeat


class FakeKv:
    def __init__(self, stop: asyncio.Event) -> None:
        self.puts: list[NodeHeartbeat] = []
        self.stop = stop

    async def put(self, key: str, value: bytes) -> None:
        self.puts.append(NodeHeartbeat.model_validate_json(value))
        self.stop.set()

    async def delete(self, key: str) -> None:
        pass


@pytest.mark.parametrize(("pressure", "threshold", "saturated"),
                         [((96.0, 93.0), 90.0, True), ((96.0, 50.0), 90.0, False), ((96.0, 93.0), 0.0, False),
                          (None, 90.0, False)])
async def test_heartbeat_reports_cpu_pressure(monkeypatch: pytest.MonkeyPatch, pressure: tuple[float, float] | None,
                                              threshold: float, saturated: bool) -> None:
    monkeypatch.setattr(heartbeat, "cpu_pressure", lambda: pressure)
    stop = asyncio.Event()
    kv = FakeKv(stop)

    async def nodes_kv() -> FakeKv:
        return kv

    settings = Settings(node_id="node-hb", node_cpu_pressure_max=threshold, node_memory_mib=4096, node_vcpus=8)
    await heartbeat.heartbeat_loop(SimpleNamespace(nodes_kv=nodes_kv), settings,  # type: ignore[arg-type]
                                   "http://x", "tcg", lambda: (0, 0, 0, ["base"]), stop)
    hb = kv.puts[0]
    assert hb.cpu_saturated is saturated
    assert hb.cpu_pressure == (None if pressure is None else pressure[0])
    if pressure is not None:
        assert CPU_PRESSURE._value.get() == pressure[0]  # noqa: SLF001 - the exported gauge
