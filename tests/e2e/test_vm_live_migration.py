"""Live migration between two real QEMUs over a TCP connection the host opened (vmmigrate.py).

The source guest runs a python3 process that counts in memory and writes the count to a file; after the
migration the same process (same pid) keeps counting on the destination from where it was, the disk came
along (block migration), and a failed migration leaves the source running. Needs root, QEMU and the base
template. Downtime figures are printed (``-s``), never asserted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
import pytest

from podbay.config import Settings
from podbay.errors import Timeout
from podbay_nodeagent.vm import vmmigrate
from podbay_nodeagent.build.template import TemplateSnapshot, prepare_template
from podbay_nodeagent.vm.vmm import QemuVmm, VmProcess, VmOperationError

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None or os.geteuid() != 0,
                       reason="needs root and qemu-system-x86_64"),
]

COUNTER = ("import os,time\n"
           "open('/home/user/counter.pid','w').write(str(os.getpid()))\n"
           "n=0\n"
           "while True:\n"
           "    n+=1\n"
           "    open('/home/user/count.tmp','w').write(str(n)); os.replace('/home/user/count.tmp','/home/user/count')\n"
           "    time.sleep(0.05)\n")


@pytest.fixture(scope="module")
async def template() -> TemplateSnapshot:
    return await prepare_template("base", Settings())


@pytest.fixture
def vmm() -> QemuVmm:
    return QemuVmm()


@pytest.fixture
async def vm(vmm: QemuVmm, template: TemplateSnapshot, tmp_path: Path) -> AsyncIterator[VmProcess]:
    handle = await vmm.restore(template.dir, tmp_path / "src", template.vm_config())
    yield handle
    await vmm.kill(handle)


async def _run(vm: VmProcess, argv: list[str]) -> tuple[bytes, int]:
    from podbay.channel.client import GuestChannel
    from podbay.contracts.channel import ExecSpec

    ch = await GuestChannel.connect(vm.paths.channel, timeout_s=30)
    try:
        out, _err, exit_ = await ch.run(ExecSpec(argv=argv))
        return out, exit_.exit_code
    finally:
        await ch.close()


async def _start_counter(vm: VmProcess) -> int:
    out, code = await _run(vm, ["sh", "-c", _detached("counter", COUNTER)])
    assert (out, code) == (b"ok\n", 0)
    for _ in range(200):
        out, code = await _run(vm, ["sh", "-c", "cat /home/user/counter.pid 2>/dev/null; echo; cat /home/user/count 2>/dev/null"])
        lines = out.decode().split()
        if code == 0 and len(lines) == 2 and int(lines[1]) >= 3:
            return int(lines[0])
        await asyncio.sleep(0.1)
    raise AssertionError("the counter did not start")


def _detached(name: str, source: str) -> str:
    """A shell line that writes ``source`` to /home/user/NAME.py, starts it detached and prints ``ok``."""
    import base64

    b64 = base64.b64encode(source.encode()).decode()
    return (f"echo {b64} | base64 -d > /home/user/{name}.py && (setsid python3 /home/user/{name}.py "
            ">/dev/null 2>&1 </dev/null &) && echo ok")


async def _count(vm: VmProcess) -> tuple[int, int]:
    out, code = await _run(vm, ["sh", "-c", "cat /home/user/counter.pid; echo; cat /home/user/count; echo;"
                                            " kill -0 $(cat /home/user/counter.pid) && echo alive"])
    pid, count, alive = out.decode().split()
    assert code == 0 and alive == "alive"
    return int(pid), int(count)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair over loopback, as two node agents would have (source, destination)."""
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        src = socket.create_connection(srv.getsockname())
        dst, _ = srv.accept()
    finally:
        srv.close()
    return src, dst


async def _migrate(vmm: QemuVmm, vm: VmProcess, dest_dir: Path) -> tuple[VmProcess, vmmigrate.MigrationStats, str]:
    assert vm.config is not None
    dest = await vmmigrate.start_incoming(vmm, vm.config, dest_dir, disk_size=vmmigrate.disk_size(vm.dir))
    src_sock, dst_sock = _tcp_pair()
    try:
        with vmm.events(dest, "MIGRATION") as listener:
            await vmmigrate.accept_incoming(vmm, dest, dst_sock)
            dst_sock.close()
            out_task = asyncio.ensure_future(vmmigrate.migrate_out(vmm, vm, src_sock, timeout_s=300))
            state = await vmmigrate.wait_incoming(vmm, dest, listener, 300)
            stats = await out_task
            state = await vmmigrate.arrive(vmm, dest, state, stats.was_running)
    except BaseException:
        await vmm.kill(dest)
        raise
    finally:
        src_sock.close()
    return dest, stats, state


async def test_running_guest_moves_with_its_process_memory_and_disk(vmm: QemuVmm, vm: VmProcess,
                                                                   tmp_path: Path) -> None:
    out, code = await _run(vm, ["sh", "-c", "echo kept > /home/user/mark && sync && echo ok"])
    assert (out, code) == (b"ok\n", 0)
    pid = await _start_counter(vm)
    _, before = await _count(vm)
    dest, stats, state = await _migrate(vmm, vm, tmp_path / "dst")
    try:
        print(f"\nlive migration: total {stats.total_ms:.0f} ms, downtime {stats.downtime_ms:.1f} ms, "
              f"RAM {stats.ram_bytes / 2**20:.1f} MiB")
        assert state == "running"
        assert stats.was_running
        assert await vmm.query_status(vm) == "postmigrate"  # the source gave the guest up
        pid_after, after = await _count(dest)
        assert pid_after == pid
        assert after >= before  # carried on from memory, not reset
        await asyncio.sleep(0.5)
        _, later = await _count(dest)
        assert later > after  # still counting on the destination
        out, code = await _run(dest, ["cat", "/home/user/mark"])
        assert (out, code) == (b"kept\n", 0)
    finally:
        await vmm.kill(dest)


async def test_paused_guest_arrives_paused(vmm: QemuVmm, vm: VmProcess, tmp_path: Path) -> None:
    pid = await _start_counter(vm)
    await vmm.pause(vm)
    dest, stats, state = await _migrate(vmm, vm, tmp_path / "dst")
    try:
        print(f"\npaused migration: total {stats.total_ms:.0f} ms")
        assert state == "paused"
        assert not stats.was_running and stats.downtime_ms == 0
        await vmm.resume(dest)
        pid_after, _ = await _count(dest)
        assert pid_after == pid
    finally:
        await vmm.kill(dest)


async def test_failed_migration_leaves_the_source_running(vmm: QemuVmm, vm: VmProcess) -> None:
    pid = await _start_counter(vm)
    src_sock, dst_sock = _tcp_pair()
    dst_sock.close()  # nobody reads the stream: QEMU's writes fail
    try:
        with pytest.raises(VmOperationError):
            await vmmigrate.migrate_out(vmm, vm, src_sock, timeout_s=120)
    finally:
        src_sock.close()
    assert await vmm.query_status(vm) == "running"
    pid_after, _ = await _count(vm)
    assert pid_after == pid


# Sweeps one byte into every page of a 16 MiB buffer, round after round, and checks each page still holds
# the previous round's value before overwriting it: a store that did not reach the destination shows up as
# a page one round behind. The process stays on its vCPU (no syscalls between sweeps), so its TLB entries
# live long: the case where a TCG source that misses stores through a cached TLB entry loses them.
SWEEPER = ("import os\n"
           "open('/home/user/sweeper.pid','w').write(str(os.getpid()))\n"
           "N=4096\n"
           "buf=bytearray(N*4096)\n"
           "r=0\n"
           "while True:\n"
           "    prev=r%251; r+=1; cur=r%251\n"
           "    for p in range(0,N*4096,4096):\n"
           "        if buf[p]!=prev:\n"
           "            open('/home/user/sweeper.bad','w').write(f'round {r} page {p//4096}: {buf[p]} != {prev}')\n"
           "            raise SystemExit(1)\n"
           "        buf[p]=cur\n"
           "    if r%50==0:\n"
           "        open('/home/user/sweeper.tmp','w').write(str(r))\n"
           "        os.replace('/home/user/sweeper.tmp','/home/user/sweeper.round')\n")


async def test_memory_written_during_the_migration_arrives_intact(vmm: QemuVmm, vm: VmProcess,
                                                                 tmp_path: Path) -> None:
    out, code = await _run(vm, ["sh", "-c", _detached("sweeper", SWEEPER)])
    assert (out, code) == (b"ok\n", 0)
    for _ in range(300):
        out, _code = await _run(vm, ["sh", "-c", "cat /home/user/sweeper.round 2>/dev/null || echo 0"])
        if int(out.split()[0]) >= 50:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the sweeper did not get going")
    dest, stats, state = await _migrate(vmm, vm, tmp_path / "dst")
    try:
        print(f"\nlive migration under writes: total {stats.total_ms:.0f} ms, downtime {stats.downtime_ms:.1f} ms")
        assert state == "running"
        try:
            out, _ = await _run(dest, ["sh", "-c", "cat /home/user/sweeper.round"])
        except Timeout:
            console = dest.paths.console.read_text(errors="replace")[-1500:]
            raise AssertionError(f"the destination guest stopped answering; its console ends:\n{console}") from None
        arrived = int(out)
        for _ in range(300):  # the sweeper must check every page again on the destination
            out, _ = await _run(dest, ["sh", "-c", "cat /home/user/sweeper.bad 2>/dev/null; cat /home/user/sweeper.round"])
            if b"page" in out or int(out.split()[-1]) >= arrived + 100:
                break
            await asyncio.sleep(0.1)
        assert b"page" not in out, f"a page lost a store in the migration: {out.decode()}"
        out, code = await _run(dest, ["sh", "-c", "kill -0 $(cat /home/user/sweeper.pid) && echo alive"])
        assert (out, code) == (b"alive\n", 0)
    finally:
        await vmm.kill(dest)
