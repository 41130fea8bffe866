"""The VMM interface is a seam: template readiness logic runs against a tiny fake (vmm.py, template.py)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

import podbay_nodeagent.build.template as template
from podbay_nodeagent.build.template import GUESTD_CONSOLE_MARKER, wait_guest_ready
from podbay_nodeagent.vm.vmm import SnapshotResult, VmConfig, VmProcess, Vmm, VmPaths


class FakeVmm(Vmm):
    """Only what readiness needs; every other operation is unused here."""

    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    async def boot(self, config: VmConfig, vm_dir: Path) -> VmProcess:
        raise NotImplementedError

    async def restore(self, snapshot_dir: Path, vm_dir: Path, config: VmConfig, *, paused: bool = False) -> VmProcess:
        raise NotImplementedError

    async def snapshot_full(self, vm: VmProcess, dest_dir: Path, *, leave_stopped: bool = False) -> SnapshotResult:
        raise NotImplementedError

    async def attach(self, vm_dir: Path, config: VmConfig | None = None) -> VmProcess:
        raise NotImplementedError

    async def pause(self, vm: VmProcess) -> None: ...

    async def resume(self, vm: VmProcess) -> None: ...

    async def stop(self, vm: VmProcess, timeout_s: float = 5.0) -> None: ...

    async def kill(self, vm: VmProcess) -> None: ...

    def is_alive(self, vm: VmProcess) -> bool:
        return self.alive

    async def wait_exit(self, vm: VmProcess, timeout_s: float | None = None) -> int | None:
        return None

    async def query_status(self, vm: VmProcess) -> str:
        return "running"

    async def start_incoming(self, config: VmConfig, paths: VmPaths, *, tap_fd: int | None = None) -> VmProcess:
        raise NotImplementedError

    async def execute(self, vm: VmProcess, cmd: str, args: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    async def give_fd(self, vm: VmProcess, fd: int, name: str) -> None:
        raise NotImplementedError

    def events(self, vm: VmProcess, *names: str) -> AbstractContextManager[AsyncIterable[Mapping[str, Any]]]:
        raise NotImplementedError

    async def detach(self, vm: VmProcess) -> None: ...

    async def set_nice(self, vm: VmProcess, nice: int) -> None: ...


def _handle(tmp_path: Path) -> VmProcess:
    return VmProcess(paths=VmPaths(tmp_path), pid=0, config=None, qmp=None)  # type: ignore[arg-type]


def test_vm_paths_layout(tmp_path: Path) -> None:
    p = VmPaths(tmp_path)
    assert [p.disk.name, p.ram.name, p.qmp.name, p.channel.name, p.console.name, p.pidfile.name] == [
        "disk.img", "ram", "qmp.sock", "channel.sock", "console.log", "qemu.pid"]
    assert p.disk.parent == tmp_path


async def test_console_marker_counts_without_a_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template, "_channel_client", lambda: None)
    (tmp_path / "console.log").write_text(f"[    1.0] booting\n{GUESTD_CONSOLE_MARKER}\n")
    assert await wait_guest_ready(FakeVmm(), _handle(tmp_path), timeout_s=5) == "console"


async def test_no_marker_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template, "_channel_client", lambda: None)
    (tmp_path / "console.log").write_text("[    1.0] Kernel panic\n")
    with pytest.raises(TimeoutError):
        await wait_guest_ready(FakeVmm(), _handle(tmp_path), timeout_s=0.3)


async def test_dead_qemu_stops_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template, "_channel_client", lambda: None)
    with pytest.raises(RuntimeError, match="exited"):
        await wait_guest_ready(FakeVmm(alive=False), _handle(tmp_path), timeout_s=5)


async def test_ping_through_the_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Channel:
        @classmethod
        async def connect(cls, socket_path: Path, *, timeout_s: float) -> Channel:
            calls.append(f"connect {socket_path.name}")
            if len(calls) == 1:
                raise ConnectionRefusedError("not yet")
            return cls()

        async def ping(self, timeout_s: float = 5.0) -> dict[str, str]:
            calls.append("ping")
            return {"version": "x"}

        async def close(self) -> None:
            calls.append("close")

    monkeypatch.setattr(template, "_channel_client", lambda: Channel)
    assert await wait_guest_ready(FakeVmm(), _handle(tmp_path), timeout_s=5) == "ping"
    assert calls == ["connect channel.sock", "connect channel.sock", "ping", "close"]
