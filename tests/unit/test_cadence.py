"""Snapshot cadence (services/nodeagent/cadence.py) with a fake manager: which snapshots it asks for."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from podbay_nodeagent import cadence


def test_due() -> None:
    assert cadence.due(100.0, None, 60)
    assert not cadence.due(100.0, 50.0, 60)
    assert cadence.due(110.0, 50.0, 60)
    assert not cadence.due(110.0, 50.0, 60, changed=False)
    assert not cadence.due(1e9, None, 0)  # interval 0 turns the cadence off


async def test_disk_snapshots_only_when_the_disk_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cadence, "TICK_S", 0.01)
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"x")
    taken: list[str] = []

    async def take_scheduled(sid: str, kind: str) -> None:
        taken.append(kind)

    vm = SimpleNamespace(stopping=False, channel=object(),
                         handle=SimpleNamespace(process=SimpleNamespace(paths=SimpleNamespace(disk=disk))))
    manager = SimpleNamespace(
        settings=SimpleNamespace(snapshot_full_interval_s=0, snapshot_disk_interval_s=0.05),
        vms={"sbx_1": vm}, snapshots=SimpleNamespace(take_scheduled=take_scheduled))
    stop = asyncio.Event()
    task = asyncio.create_task(cadence.cadence_loop(manager, stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.3)
    first = len(taken)
    await asyncio.sleep(0.3)  # the disk did not change: no more snapshots
    assert first == 1 and len(taken) == 1
    st = disk.stat()
    os.utime(disk, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    await asyncio.sleep(0.3)
    stop.set()
    await task
    assert taken == ["disk", "disk"]
