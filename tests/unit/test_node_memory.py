"""Measured memory (libs/podbay/vmmem.py) and the node's release order under pressure
(services/nodeagent/ops/memory.py): pure logic, and real files and processes of this machine."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from podbay.vmmem import HostMemory, available_for_vms, file_cached_bytes, host_memory, vm_memory
from podbay_nodeagent.ops.memory import Candidate, NodeMemory, release_order, to_release


def _c(sid: str, kind: str, since: float, cost: float = 100.0) -> Candidate:
    return Candidate(sid, kind, since, cost)  # type: ignore[arg-type]


def test_paused_sandboxes_go_first_longest_paused_first_then_idle_running_longest_idle_first() -> None:
    cands = [_c("idle-new", "idle", 50.0), _c("paused-new", "paused", 40.0), _c("idle-old", "idle", 10.0),
             _c("paused-old", "paused", 20.0)]
    assert [c.sandbox_id for c in release_order(cands)] == ["paused-old", "paused-new", "idle-old", "idle-new"]


def test_warm_slots_go_before_any_sandbox() -> None:
    cands = [_c("idle-old", "idle", 1.0), _c("paused-old", "paused", 2.0), _c("slot-b", "warm", 0.0),
             _c("slot-a", "warm", 0.0)]
    assert [c.sandbox_id for c in release_order(cands)] == ["slot-a", "slot-b", "paused-old", "idle-old"]
    assert [c.sandbox_id for c in to_release(cands, 150)] == ["slot-a", "slot-b"]


def test_a_refill_fits_only_above_the_low_water_mark() -> None:
    """MemoryWatch.fits: one more VM must leave the room at or above twice the expected cost, the mark below
    which pressure releases (so a refill never undoes a release); unknown before the first measurement."""
    from types import SimpleNamespace

    from podbay_nodeagent.ops.memory import MemoryWatch

    manager = SimpleNamespace(settings=SimpleNamespace(sandbox_memory_mib=256))
    watch = MemoryWatch(manager)  # type: ignore[arg-type]
    assert watch.fits(256) is None
    watch.latest = _mem(available=100_000, sandboxes=200, limit=600)  # room 400, cost 130: 400 - 130 >= 260
    assert watch.fits(256) is True
    watch.latest = _mem(available=100_000, sandboxes=250, limit=600)  # room 350: 350 - 130 < 260
    assert watch.fits(256) is False


def test_to_release_takes_the_shortest_prefix_that_frees_enough() -> None:
    cands = [_c("p1", "paused", 1.0, 120.0), _c("p2", "paused", 2.0, 120.0), _c("i1", "idle", 0.0, 150.0)]
    assert to_release(cands, 0) == []
    assert [c.sandbox_id for c in to_release(cands, 100)] == ["p1"]
    assert [c.sandbox_id for c in to_release(cands, 121)] == ["p1", "p2"]
    # A running sandbox is paused only when the paused ones do not free enough.
    assert [c.sandbox_id for c in to_release(cands, 241)] == ["p1", "p2", "i1"]
    assert [c.sandbox_id for c in to_release(cands, 10_000)] == ["p1", "p2", "i1"]


def _mem(available: float, sandboxes: float, limit: int | None, headroom: int = 1024) -> NodeMemory:
    return NodeMemory(host=HostMemory(24000, available, 0), available_mib=available, sandboxes_mib=sandboxes,
                      reclaimable_mib=0, cost_mib=130, limit_mib=limit, headroom_mib=headroom, candidates=[],
                      per_vm={}, measured_at=datetime.now(UTC))


def test_room_is_available_less_headroom_and_under_a_set_limit_the_limit_less_use() -> None:
    assert _mem(5000, 1000, None).room_mib == 5000 - 1024
    assert _mem(5000, 1000, 1500).room_mib == 500
    assert _mem(900, 0, None).room_mib < 0


def test_guest_ram_that_meminfo_calls_available_is_not_available() -> None:
    host = HostMemory(total_mib=24000, available_mib=20000, mapped_mib=3000)
    assert available_for_vms(host) == 17000
    assert available_for_vms(HostMemory(1000, 100, 200)) == 0.0


def test_cached_pages_of_a_real_file(tmp_path: Path) -> None:
    f = tmp_path / "ram"
    f.write_bytes(os.urandom(8 << 20))
    with open(f, "rb") as fh:
        os.fsync(fh.fileno())
        assert file_cached_bytes(f) >= 4 << 20  # just written: in the page cache
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert file_cached_bytes(f) < 1 << 20
    (tmp_path / "empty").touch()
    assert file_cached_bytes(tmp_path / "empty") == 0


def test_a_process_costs_its_pss_and_the_cached_pages_it_has_not_mapped_are_reported(tmp_path: Path) -> None:
    f = tmp_path / "ram"
    f.write_bytes(os.urandom(16 << 20))  # cached, and not mapped by the measured process
    # A small process stands for QEMU: its own file-backed PSS (a few libraries) is far below the file's 16 MiB,
    # whereas this test process's (every module the suite imported) can exceed it.
    proc = subprocess.Popen(["sleep", "60"])
    try:
        f.read_bytes()  # read back just before measuring, so a busy host has not evicted the pages meanwhile
        me = vm_memory(proc.pid, f)
        assert me is not None and me.pss_mib > 0
        assert me.ram_cached_mib >= 8 and me.unmapped_mib > 0
        assert me.cost_mib == me.pss_mib
        assert vm_memory(proc.pid, None).ram_cached_mib == 0  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()
    assert vm_memory(2**22 + 12345, f) is None  # no such process


def test_host_memory_reads_meminfo() -> None:
    h = host_memory()
    assert 0 < h.available_mib <= h.total_mib and h.mapped_mib >= 0


def test_a_vm_is_measured_when_it_appears_then_a_share_of_them_each_tick() -> None:
    from types import SimpleNamespace

    from podbay_nodeagent.ops.memory import VM_REMEASURE_S, MemoryWatch

    watch = MemoryWatch(SimpleNamespace(settings=SimpleNamespace(node_heartbeat_s=VM_REMEASURE_S / 4)))  # type: ignore[arg-type]
    me = os.getpid()
    _, per = watch._take({"a": me, "b": me}, now=0.0)
    assert set(per) == {"a", "b"} and {t for _, t, _ in watch._vm_cache.values()} == {0.0}
    _, per = watch._take({"a": me, "b": me}, now=1.0)  # neither is due: nothing read again
    assert {t for _, t, _ in watch._vm_cache.values()} == {0.0}
    # Both due, a share of one per tick (ceil(3 VMs x tick / VM_REMEASURE_S)), the oldest first; a new one at once.
    _, per = watch._take({"a": me, "b": me, "c": me}, now=VM_REMEASURE_S)
    assert sorted(t for _, t, _ in watch._vm_cache.values()) == [0.0, VM_REMEASURE_S, VM_REMEASURE_S]
    _, per = watch._take({"c": me}, now=VM_REMEASURE_S + 1)  # gone ones are forgotten
    assert set(per) == {"c"} and set(watch._vm_cache) == {"c"}


def test_an_idle_vm_is_read_again_only_once_its_cpu_moved_or_after_the_longest_interval() -> None:
    from types import SimpleNamespace

    from podbay_nodeagent.ops.memory import _CLK_TCK, VM_REMEASURE_CPU_S, VM_REMEASURE_MAX_S, VM_REMEASURE_S, MemoryWatch

    # A share of two per tick: every VM that is due is read, so what is read is what is due.
    watch = MemoryWatch(SimpleNamespace(settings=SimpleNamespace(node_heartbeat_s=VM_REMEASURE_S)))
    me = os.getpid()
    busy = int(VM_REMEASURE_CPU_S * _CLK_TCK)
    watch._take({"idle": me, "busy": me}, now=0.0, ticks={"idle": 100, "busy": 100})
    # Past VM_REMEASURE_S: the QEMU that ran a second of CPU is read again, the idle one (a few ticks) is not.
    watch._take({"idle": me, "busy": me}, now=VM_REMEASURE_S, ticks={"idle": 103, "busy": 100 + busy})
    assert watch._vm_cache["busy"][1] == VM_REMEASURE_S and watch._vm_cache["idle"][1] == 0.0
    # The idle one's ticks add up across the ticks it was skipped: read once they reach the threshold.
    watch._take({"idle": me, "busy": me}, now=VM_REMEASURE_S + 1, ticks={"idle": 100 + busy, "busy": 100 + busy})
    assert watch._vm_cache["idle"][1] == VM_REMEASURE_S + 1 and watch._vm_cache["busy"][1] == VM_REMEASURE_S
    # Without CPU it is read after VM_REMEASURE_MAX_S all the same; without ticks (unknown) as before.
    t = VM_REMEASURE_S + 1 + VM_REMEASURE_MAX_S
    watch._take({"idle": me, "busy": me}, now=t, ticks={"idle": 100 + busy, "busy": 100 + busy})
    assert watch._vm_cache["idle"][1] == t
    watch._take({"idle": me, "busy": me}, now=t + VM_REMEASURE_S)
    assert {k: v[1] for k, v in watch._vm_cache.items()} == {"idle": t + VM_REMEASURE_S, "busy": t + VM_REMEASURE_S}
