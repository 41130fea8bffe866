"""QEMU's exit is noticed without blocking the event loop while bwrap (the Popen of a confined QEMU) is
still on its way out (vmm.QemuVmm._on_exit). Real processes stand in: ``sleep`` as bwrap, ``true`` as QEMU."""

from __future__ import annotations

import subprocess
from pathlib import Path

from podbay_nodeagent.vm.vmm import QemuVmm, VmProcess, VmPaths


async def test_an_exit_waits_for_bwrap_on_a_worker_thread_not_on_the_loop(tmp_path: Path) -> None:
    bwrap = subprocess.Popen(["sleep", "30"])
    qemu = subprocess.Popen(["true"])
    qemu.wait()
    vmm = QemuVmm(confinement=None)
    vm = VmProcess(paths=VmPaths(tmp_path), pid=qemu.pid, config=None, qmp=None, popen=bwrap)  # type: ignore[arg-type]
    try:
        vmm._on_exit(vm)  # noqa: SLF001
        # It returned while bwrap runs: the exit is not reported yet (a blocking wait would have given up
        # after 1 s and reported it without a code).
        assert not vm._exited.is_set()  # noqa: SLF001
        bwrap.terminate()
        await vmm.wait_exit(vm, 10)
        assert vm._exited.is_set() and vm.exit_code == bwrap.returncode  # noqa: SLF001
    finally:
        bwrap.kill()
        bwrap.wait()
