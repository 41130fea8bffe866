"""The QEMU driver against real microVMs restored from the base template's snapshot (vmm.py, template.py).

Needs root, QEMU and the template (built on first use, minutes on a cold cache).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from podbay.config import Settings
from podbay_nodeagent.build.template import TemplateSnapshot, guest_aslr, prepare_template
from podbay_nodeagent.vm.vmm import QemuVmm, VmGone, VmProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None or os.geteuid() != 0,
                       reason="needs root and qemu-system-x86_64"),
]


@pytest.fixture(scope="module")
async def template() -> TemplateSnapshot:
    return await prepare_template("base", Settings())


@pytest.fixture
def vmm() -> QemuVmm:
    return QemuVmm()


@pytest.fixture
async def vm(vmm: QemuVmm, template: TemplateSnapshot, tmp_path: Path) -> AsyncIterator[VmProcess]:
    handle = await vmm.restore(template.dir, tmp_path / "vm", template.vm_config())
    yield handle
    await vmm.kill(handle)


def _client() -> Any:
    return pytest.importorskip("podbay.channel.client").GuestChannel


async def _run(vm: VmProcess, argv: list[str]) -> tuple[bytes, int]:
    from podbay.contracts.channel import ExecSpec

    ch = await _client().connect(vm.paths.channel, timeout_s=30)
    try:
        out, _err, exit_ = await ch.run(ExecSpec(argv=argv))
        return out, exit_.exit_code
    finally:
        await ch.close()


async def test_restore_then_ping_and_exec(vmm: QemuVmm, vm: VmProcess) -> None:
    assert await vmm.query_status(vm) == "running"
    ch = await _client().connect(vm.paths.channel, timeout_s=30)
    try:
        assert isinstance(await ch.ping(), dict)
    finally:
        await ch.close()
    out, code = await _run(vm, ["sh", "-c", "echo $((6*7)); id -u user"])
    assert (out, code) == (b"42\n1000\n", 0)


async def test_the_template_snapshot_is_primed(vm: VmProcess) -> None:
    """``template.prime_guest`` ran before the snapshot: a bare restore (no hygiene of its own) already has the
    NIC up on the placeholder address, the trust store's pristine copy and the template's name as hostname
    (every sandbox's hygiene replaces them: tests/e2e/test_sandbox_network.py)."""
    out, code = await _run(vm, ["sh", "-c", "grep -c '192[.]0[.]2[.]2' /proc/net/fib_trie;"
                                            " test -f /etc/ssl/certs/ca-certificates.crt.podbay-orig && echo orig;"
                                            " hostname"])
    assert code == 0, out
    count, *rest = out.decode().split()
    assert int(count) >= 1 and rest == ["orig", "base"], out


async def test_the_guest_randomises_process_layouts_as_its_template_says(template: TemplateSnapshot,
                                                                         vm: VmProcess) -> None:
    """``Settings.guest_aslr`` (``auto``: off under TCG, on under KVM) reached the snapshot: without ASLR every
    process maps libc at the same address, which is what lets TCG reuse its translations across execs."""
    assert template.guest_aslr is guest_aslr(Settings(), template.accel)
    out, code = await _run(vm, ["cat", "/proc/sys/kernel/randomize_va_space"])
    assert (out.decode().strip(), code) == ("2" if template.guest_aslr else "0", 0)
    maps = [(await _run(vm, ["grep", "-m1", "libc", "/proc/self/maps"]))[0] for _ in range(2)]
    assert maps[0] and (maps[0] == maps[1]) is (not template.guest_aslr), maps


async def test_full_snapshot_then_restore_the_copy(vmm: QemuVmm, vm: VmProcess, tmp_path: Path) -> None:
    out, code = await _run(vm, ["sh", "-c", "echo kept > /home/user/mark && sync && cat /home/user/mark"])
    assert (out, code) == (b"kept\n", 0)
    snap = await vmm.snapshot_full(vm, tmp_path / "snap")
    assert snap.paused_ms > 0
    assert {p.name for p in snap.dir.iterdir()} >= {"state", "ram", "disk.img"}
    assert await vmm.query_status(vm) == "running"  # the source resumes after the snapshot
    copy = await vmm.restore(snap.dir, tmp_path / "copy", vm.config)  # type: ignore[arg-type]
    try:
        assert await vmm.query_status(copy) == "running"
        out, code = await _run(copy, ["cat", "/home/user/mark"])
        assert (out, code) == (b"kept\n", 0)
        # The copy is independent of its source.
        await _run(copy, ["sh", "-c", "echo changed > /home/user/mark"])
        out, _ = await _run(vm, ["cat", "/home/user/mark"])
        assert out == b"kept\n"
    finally:
        await vmm.kill(copy)


async def test_snapshot_can_leave_the_guest_stopped(vmm: QemuVmm, vm: VmProcess, tmp_path: Path) -> None:
    await vmm.snapshot_full(vm, tmp_path / "snap", leave_stopped=True)
    assert await vmm.query_status(vm) in ("paused", "postmigrate")
    await vmm.resume(vm)
    assert await vmm.query_status(vm) == "running"


async def test_a_stopped_guest_can_be_snapshotted_again(vmm: QemuVmm, vm: VmProcess, tmp_path: Path) -> None:
    """A full snapshot of a paused guest leaves QEMU in ``postmigrate``; the next snapshot (a second one, a
    suspend, a fork, a RAM release) must still work, and the guest carries on after both."""
    await vmm.pause(vm)
    await vmm.snapshot_full(vm, tmp_path / "one")
    second = await vmm.snapshot_full(vm, tmp_path / "two")
    assert (second.dir / "state").stat().st_size > 0
    assert await vmm.query_status(vm) in ("paused", "postmigrate")  # a paused guest stays stopped
    await vmm.resume(vm)
    out, code = await _run(vm, ["echo", "on"])
    assert (out, code) == (b"on\n", 0)


async def test_restore_paused(vmm: QemuVmm, template: TemplateSnapshot, tmp_path: Path) -> None:
    vm = await vmm.restore(template.dir, tmp_path / "vm", template.vm_config(), paused=True)
    try:
        assert await vmm.query_status(vm) == "paused"
        await vmm.resume(vm)
        assert await vmm.query_status(vm) == "running"
    finally:
        await vmm.kill(vm)


def _thread_nices(pid: int) -> set[int]:
    return {int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in Path(f"/proc/{pid}/task").iterdir()}


async def test_restore_at_a_nice_value_and_back(vmm: QemuVmm, template: TemplateSnapshot, tmp_path: Path) -> None:
    """``VmConfig.nice`` starts every QEMU thread at that value (confined or not); ``set_nice`` moves them."""
    config = template.vm_config().model_copy(update={"nice": 10})
    vm = await vmm.restore(template.dir, tmp_path / "vm", config)
    try:
        assert _thread_nices(vm.pid) == {10}
        out, code = await _run(vm, ["true"])
        assert code == 0
        await vmm.set_nice(vm, 0)
        assert _thread_nices(vm.pid) == {0}
    finally:
        await vmm.kill(vm)


async def test_pause_and_resume(vmm: QemuVmm, vm: VmProcess) -> None:
    await vmm.pause(vm)
    assert await vmm.query_status(vm) == "paused"
    await vmm.resume(vm)
    assert await vmm.query_status(vm) == "running"


async def test_external_kill_is_noticed(vmm: QemuVmm, vm: VmProcess) -> None:
    assert vmm.is_alive(vm)
    os.kill(vm.pid, signal.SIGKILL)
    code = await vmm.wait_exit(vm, timeout_s=10)
    assert code == -signal.SIGKILL
    assert not vmm.is_alive(vm)


async def test_attach_after_driver_restart(vmm: QemuVmm, vm: VmProcess) -> None:
    other = QemuVmm()
    # QEMU's QMP socket serves one client at a time: the first driver lets go, as a dead node agent would.
    await vm.qmp.disconnect()
    again = await other.attach(vm.dir, vm.config)
    assert again.pid == vm.pid
    assert await other.query_status(again) == "running"
    await other.stop(again, timeout_s=10)
    assert not other.is_alive(again)
    with pytest.raises(VmGone):
        await other.attach(vm.dir)


async def test_stop_ends_qemu(vmm: QemuVmm, vm: VmProcess) -> None:
    await vmm.stop(vm, timeout_s=10)
    assert not vmm.is_alive(vm)
    assert not vm.paths.pidfile.exists()
