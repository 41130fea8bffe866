"""QEMU runs unprivileged and confined (issue 6 item 8; confine.py), checked on real microVMs.

From the host: the QEMU process's uid and gid are the VMM user's, it has no capability and no_new_privs,
it lives in its own mount, pid, net, ipc and uts namespaces, and its mount namespace (read through
``/proc/<pid>/root``) holds only ``/usr``, a few devices, its own VM directory and its kernel and initramfs.
Through the stack: a sandbox's QEMU is confined, the VMM user cannot enter the node store, and the sandbox
still snapshots, pauses past the RAM-release grace (6 s in the test stack), resumes and answers.

Needs root, QEMU, bubblewrap and the base template (built on first use).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from podbay.config import Settings
from podbay_nodeagent.ops.lease import cpu_ticks
from podbay_nodeagent.build.template import TemplateSnapshot, prepare_template
from podbay_nodeagent.vm.vmm import QemuVmm, VmProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None or shutil.which("bwrap") is None
                       or os.geteuid() != 0, reason="needs root, bwrap and qemu-system-x86_64"),
]

VMM_USER = Settings().vmm_user


@pytest.fixture(scope="module")
async def template() -> TemplateSnapshot:
    return await prepare_template("base", Settings())


@pytest.fixture
def vmm() -> QemuVmm:
    return QemuVmm()  # confinement from the settings: on by default


@pytest.fixture
async def two_vms(vmm: QemuVmm, template: TemplateSnapshot, tmp_path: Path) -> AsyncIterator[list[VmProcess]]:
    vms: list[VmProcess] = []
    try:
        for name in ("a", "b"):
            vms.append(await vmm.restore(template.dir, tmp_path / name / "vm", template.vm_config()))
        yield vms
    finally:
        for vm in vms:
            await vmm.kill(vm)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


def assert_confined(pid: int) -> None:
    """``pid`` is a QEMU running as the VMM user with no capability, in namespaces of its own."""
    assert Path(f"/proc/{pid}/comm").read_text().startswith("qemu"), "the recorded pid must be QEMU, not bwrap"
    user = pwd.getpwnam(VMM_USER)
    st = _status(pid)
    assert st["Uid"].split() == [str(user.pw_uid)] * 4
    assert st["Gid"].split() == [str(user.pw_gid)] * 4
    assert st["Groups"] == ""
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, cap
    assert st["NoNewPrivs"] == "1"
    for ns in ("mnt", "pid", "net", "ipc", "uts"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    # Inside its pid namespace QEMU is pid 1: it sees no other process.
    assert st["NSpid"].split()[-1] == "1"
    # Under QEMU's own seccomp filter (-sandbox: no exec, fork, setuid, scheduler calls; vmm.SECCOMP).
    assert st["Seccomp"] == "2"
    assert b"-sandbox" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def _inside(pid: int, path: Path | str) -> Path:
    """``path`` as QEMU's mount namespace resolves it."""
    return Path(f"/proc/{pid}/root") / str(path).lstrip("/")


def _listing(pid: int, path: Path | str) -> set[str]:
    return set(os.listdir(_inside(pid, path)))


async def test_qemu_runs_as_the_vmm_user_without_capabilities(two_vms: list[VmProcess]) -> None:
    for vm in two_vms:
        assert_confined(vm.pid)
        assert int(vm.paths.pidfile.read_text()) == vm.pid
        # The lease's idle check reads this pid's CPU time: it is QEMU's, and it ran.
        assert (cpu_ticks(vm.pid) or 0) > 0


async def test_mount_namespace_shows_only_its_own_files(two_vms: list[VmProcess], template: TemplateSnapshot) -> None:
    a, b = two_vms
    pid = a.pid
    root = _listing(pid, "/")
    assert root <= {"usr", "bin", "sbin", "lib", "lib64", "etc", "dev", "tmp", "root"}, root
    assert not _inside(pid, "/proc/self").exists() and not _inside(pid, "/sys/kernel").exists()
    assert _listing(pid, "/dev") == {"null", "urandom"}
    assert _listing(pid, "/etc") == {"ld.so.cache"}
    # Its own directory is there, read-write for it; the other VM's is not, nor anything beside its own.
    assert {"ram", "disk.img", "console.log", "run"} <= _listing(pid, a.dir)
    assert {"qmp.sock", "channel.sock", "console.sock"} <= _listing(pid, a.paths.run)
    assert not _inside(pid, b.dir).exists()
    assert _listing(pid, a.dir.parent) == {a.dir.name}
    # Of the template it sees the kernel and initramfs, not the snapshot it was restored from.
    assert _listing(pid, template.dir) == {template.kernel.name, template.initrd.name}
    # No host home, no data dir, no passwd.
    home = Path.home()
    assert not _inside(pid, home / ".ssh").exists()
    assert not _inside(pid, Settings().data_dir).exists() or not _listing(pid, Settings().data_dir)
    assert not _inside(pid, "/etc/passwd").exists()
    if _inside(pid, home).exists():  # only as the way to the template's kernel (a cache under the home)
        assert template.dir.is_relative_to(home)
        assert _listing(pid, home) == {template.dir.relative_to(home).parts[0]}


async def test_qemu_writes_its_files_but_cannot_rename_or_replace_them(two_vms: list[VmProcess]) -> None:
    user = pwd.getpwnam(VMM_USER)
    vm = two_vms[0]
    for p in (vm.paths.ram, vm.paths.disk, vm.paths.qmp, vm.paths.channel, vm.paths.console_sock):
        assert p.stat().st_uid == user.pw_uid, p
    # The console log is the node agent's (console.py): QEMU only has the console socket.
    assert vm.paths.console.stat().st_uid == 0
    # The directories stay root's (QEMU may traverse, not write), so the node agent never meets a name
    # QEMU swapped for a symlink; the socket directory was taken back once QMP answered.
    st = vm.dir.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, user.pw_gid, 0o750)
    assert vm.paths.run.stat().st_uid == 0
    # Seen from QEMU's mount namespace with QEMU's credentials:
    assert _in_qemu_view(vm.pid, ["test", "-w", str(vm.paths.ram)]) == 0
    assert _in_qemu_view(vm.pid, ["test", "-w", str(vm.paths.disk)]) == 0
    assert _in_qemu_view(vm.pid, ["test", "-w", str(vm.paths.console)]) != 0
    assert _in_qemu_view(vm.pid, ["touch", str(vm.dir / "planted")]) != 0
    assert _in_qemu_view(vm.pid, ["ln", "-s", "/usr", str(vm.paths.run / "planted")]) != 0
    assert _in_qemu_view(vm.pid, ["rm", "-f", str(vm.paths.console)]) != 0
    assert vm.paths.console.exists()


def _in_qemu_view(pid: int, argv: list[str]) -> int:
    """Exit code of ``argv`` run in QEMU ``pid``'s mount namespace as the VMM user, without capabilities."""
    user = pwd.getpwnam(VMM_USER)
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-m", "--", "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
         "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--", *argv],
        capture_output=True, check=False,
    ).returncode


async def test_confined_vm_snapshots_restores_and_reattaches(
    vmm: QemuVmm, two_vms: list[VmProcess], tmp_path: Path, template: TemplateSnapshot,
) -> None:
    vm = two_vms[0]
    snap = await vmm.snapshot_full(vm, tmp_path / "snap")
    assert snap.state.stat().st_size > 0
    copy = await vmm.restore(snap.dir, tmp_path / "copy" / "vm", template.vm_config())
    try:
        assert_confined(copy.pid)
        assert await vmm.query_status(copy) == "running"
        # A new driver (a restarted node agent) finds the same QEMU through qemu.pid.
        await copy.qmp.disconnect()
        other = QemuVmm()
        again = await other.attach(copy.dir, copy.config)
        assert again.pid == copy.pid
        assert await other.query_status(again) == "running"
        await other.kill(again)
        assert not other.is_alive(again)
        assert not copy.paths.pidfile.exists()
    finally:
        await vmm.kill(copy)


async def test_confined_fresh_boot_reaches_guestd(vmm: QemuVmm, template: TemplateSnapshot, tmp_path: Path) -> None:
    """A boot (template build, rollback to a disk snapshot): QEMU creates its RAM file in a directory it
    cannot write, so the node agent makes it for it."""
    from podbay_nodeagent.build.template import wait_guest_ready
    from podbay.reflink import reflink_or_copy

    vm_dir = tmp_path / "boot"
    vm_dir.mkdir()
    reflink_or_copy(template.disk, vm_dir / "disk.img")
    vm = await vmm.boot(template.vm_config(), vm_dir)
    try:
        assert_confined(vm.pid)
        assert await wait_guest_ready(vmm, vm, 180.0) == "ping"
        assert vm.paths.ram.stat().st_size == template.memory_mib << 20
    finally:
        await vmm.kill(vm)


# ------------------------------------------------------------------------------------------------- stack


def _as_vmm_user(argv: list[str]) -> int:
    user = pwd.getpwnam(VMM_USER)
    return subprocess.run(argv, user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
                          capture_output=True, check=False).returncode


def test_stack_sandbox_is_confined_and_survives_ram_release(stack: Any) -> None:
    from e2e_http import api_client, sh

    with api_client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code in (200, 201), r.text
        sid = r.json()["id"]
        try:
            vm_dir = next(Path(stack.data_dir).glob(f"nodes/*/store/sandboxes/{sid}"))
            store = vm_dir.parent.parent
            pid = int((vm_dir / "qemu.pid").read_text())
            assert_confined(pid)
            # The VMM user cannot enter the node store (other VMs, templates, snapshots) nor the data dir's
            # servers (PostgreSQL's cluster among them), even from the host's mount namespace.
            assert _as_vmm_user(["test", "-x", str(store)]) != 0
            assert _as_vmm_user(["ls", str(vm_dir.parent)]) != 0
            assert not _inside(pid, Path(stack.data_dir) / "servers").exists()
            for pg_version in Path(stack.data_dir).rglob("PG_VERSION"):
                assert not _inside(pid, pg_version).exists()
            assert _listing(pid, vm_dir.parent) == {sid}

            sh(c, sid, "echo kept > /root/kept.txt")
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code in (200, 201, 202), r.text
            assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (vm_dir / "hib" / "state").exists():
                time.sleep(0.5)
            assert (vm_dir / "hib" / "state").exists(), "the paused sandbox's RAM was not released"
            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            new_pid = int((vm_dir / "qemu.pid").read_text())
            assert new_pid != pid
            assert_confined(new_pid)
            assert sh(c, sid, "cat /root/kept.txt").strip() == "kept"
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def _cgroup_v2_root() -> Path | None:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists():
            return root
    return None


@pytest.mark.skipif(_cgroup_v2_root() is None, reason="needs a cgroup v2 mount")
async def test_qemu_sits_in_a_cgroup_of_its_own_with_its_limits_under_seccomp(template: TemplateSnapshot,
                                                                              tmp_path: Path) -> None:
    """cgroups.py: the QEMU of a guest in ``podbay.slice/<vm dir>-<pid>``, with the limits of every
    controller this host delegates (a hybrid host's v2 mount may have none: then membership alone), gone with
    QEMU; and ``-sandbox`` on its command line."""
    from podbay_nodeagent.vm.cgroups import SLICE, VmCgroups, cgroup_values
    from podbay_nodeagent.vm.vmm import SECCOMP

    root = _cgroup_v2_root()
    assert root is not None
    s = Settings()
    params: dict[str, Any] = {"cpu_headroom_percent": s.vmm_cpu_headroom_percent,
                              "memory_overhead_mib": s.vmm_memory_overhead_mib, "pids_max": s.vmm_pids_max,
                              "io_max": ""}
    slice_ = VmCgroups(root)
    vmm = QemuVmm(vm_cgroups=(slice_, params))
    config = template.vm_config(vcpus=template.vcpus)
    vm = await vmm.restore(template.dir, tmp_path / "vm", config)
    cg = root / SLICE / f"vm-{vm.pid}"
    try:
        assert_confined(vm.pid)
        argv = Path(f"/proc/{vm.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"-sandbox") + 1] == SECCOMP.encode()
        assert Path(f"/proc/{vm.pid}/cgroup").read_text().strip().endswith(f"/{SLICE}/vm-{vm.pid}")
        assert cg.is_dir()
        want = cgroup_values(vcpus=config.vcpus, memory_mib=config.memory_mib, tb_mib=config.tcg_tb_size_mib
                             if config.accel == "tcg" else 0, **params)
        applied = {f: v for f, v in want.items() if f.split(".")[0] in slice_.controllers}
        for file, value in applied.items():
            got = (cg / file).read_text().strip()
            assert got == value or (file == "io.weight" and got.endswith(" 100")), (file, got)
        print(f"controllers delegated at {root}: {sorted(slice_.controllers) or 'none'}; checked {sorted(applied)}")
        assert await vmm.query_status(vm) == "running"
    finally:
        await vmm.kill(vm)
    assert not cg.exists()


async def test_with_a_uid_range_each_qemu_runs_as_a_uid_of_its_own(template: TemplateSnapshot,
                                                                  tmp_path: Path) -> None:
    """PODBAY_VMM_UID_RANGE (confine.UidPool): two guests' QEMUs run as two uids of the range, each owning only
    its own files (0600, its directory's group its own gid), still confined and under seccomp; a snapshot
    restored next to them gets a third."""
    from dataclasses import replace

    from podbay_nodeagent.vm import confine

    pool = confine.UidPool(confine.UidRange(210000, 16), registry=tmp_path / "uids")
    vmm = QemuVmm(confinement=replace(confine.Confinement.prepare(VMM_USER), uids=pool))
    vms: list[VmProcess] = []
    try:
        for name in ("a", "b"):
            vms.append(await vmm.restore(template.dir, tmp_path / name / "vm", template.vm_config()))
        snap = await vmm.snapshot_full(vms[0], tmp_path / "snap")
        vms.append(await vmm.restore(snap.dir, tmp_path / "c" / "vm", template.vm_config()))
        uids = [int(_status(vm.pid)["Uid"].split()[0]) for vm in vms]
        assert len(set(uids)) == 3 and all(210000 <= u < 210016 for u in uids), uids
        for vm, uid in zip(vms, uids, strict=True):
            st = _status(vm.pid)
            assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4
            assert st["Groups"] == "" and int(st["CapEff"], 16) == 0 and st["Seccomp"] == "2"
            for p in (vm.paths.ram, vm.paths.disk):
                assert (p.stat().st_uid, p.stat().st_mode & 0o777) == (uid, 0o600), p
            assert (vm.dir.stat().st_uid, vm.dir.stat().st_gid, vm.dir.stat().st_mode & 0o777) == (0, uid, 0o750)
            assert (tmp_path / "uids" / str(uid)).read_text().split()[0] == str(vm.pid)
            assert await vmm.query_status(vm) == "running"
    finally:
        for vm in vms:
            await vmm.kill(vm)
