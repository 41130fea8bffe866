"""Pure logic of vmmigrate.py: when pre-copy is trusted, when the guest is stopped before its RAM moves,
and how an arrival is finished. A fake stands in for QMP; the real migrations are in
tests/e2e/test_vm_live_migration.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from podbay_nodeagent.vm import vmmigrate
from podbay_nodeagent.vm.vmm import VmConfig, VmProcess, VmPaths

MiB = 2**20


class FakeQmp:
    """Answers ``query-migrate`` from a script (one answer per call, the last repeated) and
    ``query-version`` with ``version``; records ``stop``/``cont`` and when they came."""

    def __init__(self, script: list[dict[str, Any]], version: tuple[int, int] = (7, 2)) -> None:
        self.script = script
        self.version = version
        self.calls: list[str] = []
        self.queries = 0

    async def execute(self, vm: Any, cmd: str, args: dict[str, Any] | None = None) -> Any:
        self.calls.append(cmd)
        if cmd == "query-version":
            return {"qemu": {"major": self.version[0], "minor": self.version[1], "micro": 0}}
        assert cmd == "query-migrate"
        answer = self.script[min(self.queries, len(self.script) - 1)]
        self.queries += 1
        return answer

    async def pause(self, vm: Any) -> None:
        self.calls.append(f"stop@{self.queries}")

    async def resume(self, vm: Any) -> None:
        self.calls.append("cont")


def _vm(accel: str = "tcg") -> VmProcess:
    cfg = VmConfig(kernel=Path("k"), initrd=Path("i"), accel=accel)  # type: ignore[arg-type]
    return VmProcess(paths=VmPaths(Path("/nonexistent")), pid=1, config=cfg, qmp=None)  # type: ignore[arg-type]


def _info(disk_remaining: int, disk_sent: int = 0, ram_pages: int = 0, status: str = "active") -> dict[str, Any]:
    return {"status": status, "ram": {"normal": ram_pages, "duplicate": 0, "transferred": ram_pages * 4096},
            "disk": {"remaining": disk_remaining, "transferred": disk_sent, "total": 2048 * MiB}}


async def test_tcg_before_9_0_is_not_trusted_with_pre_copy_and_kvm_or_9_0_is() -> None:
    assert not await vmmigrate.precopy_safe(FakeQmp([], (7, 2)), _vm("tcg"))  # type: ignore[arg-type]
    assert not await vmmigrate.precopy_safe(FakeQmp([], (8, 2)), _vm("tcg"))  # type: ignore[arg-type]
    assert await vmmigrate.precopy_safe(FakeQmp([], (9, 0)), _vm("tcg"))  # type: ignore[arg-type]
    kvm = FakeQmp([], (7, 2))
    assert await vmmigrate.precopy_safe(kvm, _vm("kvm"))  # type: ignore[arg-type]
    assert kvm.calls == []  # KVM needs no version check


async def test_the_guest_runs_through_the_disk_pass_and_stops_before_ram_moves(monkeypatch: Any) -> None:
    monkeypatch.setattr(vmmigrate, "_WATCH_S", 0)
    times = iter(range(10))  # one second between looks: ~900 MiB/s, so 0.25 s of it is ~225 MiB
    monkeypatch.setattr(vmmigrate, "time", SimpleNamespace(monotonic=lambda: float(next(times))))
    script = [_info(1900 * MiB, 100 * MiB), _info(1000 * MiB, 1000 * MiB), _info(60 * MiB, 1940 * MiB),
              _info(0, 2000 * MiB, ram_pages=10)]
    qmp = FakeQmp(script)
    stopped = await vmmigrate.stop_before_ram(qmp, _vm())  # type: ignore[arg-type]
    assert stopped is not None
    assert qmp.calls.count("query-migrate") == 3 and qmp.calls[-1] == "stop@3"  # 60 MiB left, no RAM sent yet


async def test_the_stop_comes_earlier_when_the_disk_pass_is_fast(monkeypatch: Any) -> None:
    monkeypatch.setattr(vmmigrate, "_WATCH_S", 0)
    times = iter([0.0, 0.1, 0.2, 0.3])
    monkeypatch.setattr(vmmigrate, "time", SimpleNamespace(monotonic=lambda: next(times)))
    # 500 MiB per 0.1 s = 5000 MiB/s: 0.25 s of it is 1250 MiB, so 1000 MiB left is already close enough.
    script = [_info(1500 * MiB, 500 * MiB), _info(1000 * MiB, 1000 * MiB)]
    qmp = FakeQmp(script)
    assert await vmmigrate.stop_before_ram(qmp, _vm()) is not None  # type: ignore[arg-type]
    assert qmp.calls[-1] == "stop@2"


async def test_a_migration_that_ends_first_is_not_stopped(monkeypatch: Any) -> None:
    monkeypatch.setattr(vmmigrate, "_WATCH_S", 0)
    qmp = FakeQmp([_info(1900 * MiB), _info(1800 * MiB, status="failed")])
    assert await vmmigrate.stop_before_ram(qmp, _vm()) is None  # type: ignore[arg-type]
    assert not any(c.startswith("stop") for c in qmp.calls)


async def test_without_a_disk_section_the_guest_stops_at_once(monkeypatch: Any) -> None:
    monkeypatch.setattr(vmmigrate, "_WATCH_S", 0)
    qmp = FakeQmp([{"status": "active", "ram": {"normal": 0, "duplicate": 0}}])
    assert await vmmigrate.stop_before_ram(qmp, _vm()) is not None  # type: ignore[arg-type]
    assert qmp.calls == ["query-migrate", "stop@1"]


async def test_an_arrival_is_resumed_only_when_the_source_ran() -> None:
    qmp = FakeQmp([])
    assert await vmmigrate.arrive(qmp, _vm(), "paused", True) == "running"  # type: ignore[arg-type]
    assert qmp.calls == ["cont"]
    qmp = FakeQmp([])
    assert await vmmigrate.arrive(qmp, _vm(), "paused", False) == "paused"  # type: ignore[arg-type]
    assert await vmmigrate.arrive(qmp, _vm(), "running", True) == "running"  # type: ignore[arg-type]
    assert qmp.calls == []
