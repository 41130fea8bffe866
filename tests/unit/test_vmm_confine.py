"""The bubblewrap + setpriv wrapper that confines QEMU (confine.py) and how the driver reads its pid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from podbay.config import Settings
from podbay_nodeagent.vm import confine
from podbay_nodeagent.vm.confine import (
    Confinement,
    ConfinementError,
    VmmUser,
    confine_argv,
    own_vm_files,
    read_child_pid,
    strip_pidfile,
)
from podbay_nodeagent.vm.vmm import VmConfig, VmPaths, build_qemu_argv

USER = VmmUser("podbay-vm", 995, 994)
VM = Path("/data/nodes/n1/store/sandboxes/sb-1")
KERNEL = Path("/cache/templates/base-1/vmlinuz")
INITRD = Path("/cache/templates/base-1/initrd.img")


def _qemu(accel: str = "tcg") -> list[str]:
    cfg = VmConfig(kernel=KERNEL, initrd=INITRD, accel=accel)  # type: ignore[arg-type]
    return build_qemu_argv(cfg, VmPaths(VM), tsc_khz=2100000)


def _wrap(**kw: object) -> list[str]:
    args: dict[str, object] = {"user": USER, "vm_dir": VM, "read_only": [KERNEL, INITRD], "info_fd": 7, "kvm": False}
    args.update(kw)
    return confine_argv(_qemu(), **args)  # type: ignore[arg-type]


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def _bwrap_part(argv: list[str]) -> list[str]:
    return argv[: argv.index("--")]


def test_bwrap_namespaces_and_session() -> None:
    argv = _wrap()
    bw = _bwrap_part(argv)
    assert bw[0] == "bwrap"
    for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--new-session",
                 "--as-pid-1", "--clearenv"):
        assert flag in bw, flag
    # QEMU must outlive a node-agent restart, and the user switch is setpriv's, not a user namespace's.
    assert "--die-with-parent" not in bw
    assert "--unshare-user" not in bw and "--unshare-all" not in bw
    assert bw[bw.index("--info-fd") + 1] == "7"


def test_filesystem_view_is_minimal() -> None:
    bw = _bwrap_part(_wrap())
    assert _pairs(bw, "--bind") == [(str(VM), str(VM))]
    assert _pairs(bw, "--ro-bind") == [("/usr", "/usr"), (str(KERNEL), str(KERNEL)), (str(INITRD), str(INITRD))]
    assert _pairs(bw, "--dev-bind") == [("/dev/null", "/dev/null"), ("/dev/urandom", "/dev/urandom")]
    assert ("/etc/ld.so.cache", "/etc/ld.so.cache") in _pairs(bw, "--ro-bind-try")
    assert ("usr/lib", "/lib") in _pairs(bw, "--symlink")
    # No host /, /proc, /sys, /dev or /root; the root tmpfs ends read-only.
    for flag in ("--proc", "--dev", "--dev-bind-try", "--bind-try"):
        assert flag not in bw, flag
    assert all(src not in ("/", "/proc", "/sys", "/root", "/etc") for src, _ in _pairs(bw, "--ro-bind"))
    assert bw[bw.index("--remount-ro") + 1] == "/"
    assert bw[bw.index("--chdir") + 1] == str(VM)


def test_parents_of_bound_paths_are_traversable_and_created_before_the_binds() -> None:
    bw = _bwrap_part(_wrap())
    made = [bw[i + 3] for i, a in enumerate(bw) if a == "--perms" and bw[i + 1] == "0755" and bw[i + 2] == "--dir"]
    assert made == ["/data", "/data/nodes", "/data/nodes/n1", "/data/nodes/n1/store", "/data/nodes/n1/store/sandboxes",
                    "/cache", "/cache/templates", "/cache/templates/base-1"]
    assert bw.index("--perms") < bw.index("--bind")


def test_kvm_device_and_group_only_under_kvm() -> None:
    tcg = _wrap()
    assert "/dev/kvm" not in tcg
    kvm = _wrap(kvm=True, kvm_gid=104)
    assert ("/dev/kvm", "/dev/kvm") in _pairs(_bwrap_part(kvm), "--dev-bind")
    assert "--groups=104" in kvm and "--clear-groups" not in kvm
    assert "--clear-groups" in _wrap(kvm=True, kvm_gid=None)


def test_setpriv_drops_to_the_user_without_capabilities() -> None:
    argv = _wrap(setpriv="/usr/bin/setpriv")
    sp = argv[argv.index("--") + 1:]
    assert sp[0] == "/usr/bin/setpriv"
    tail = sp[: sp.index("--")]
    assert {"--reuid=995", "--regid=994", "--clear-groups", "--inh-caps=-all", "--ambient-caps=-all",
            "--bounding-set=-all", "--no-new-privs"} <= set(tail)


def test_qemu_argv_follows_unchanged_but_for_the_pidfile() -> None:
    argv = _wrap()
    qemu = argv[len(argv) - len(strip_pidfile(_qemu())):]
    assert qemu == strip_pidfile(_qemu())
    assert qemu[0] == "qemu-system-x86_64"
    assert "-pidfile" not in argv
    # Same paths inside as outside: the node agent's cmdline checks still find the VM's QMP socket.
    assert f"unix:{VM}/run/qmp.sock,server=on,wait=off" in qemu


def test_strip_pidfile() -> None:
    assert strip_pidfile(["q", "-pidfile", "/x/qemu.pid", "-S"]) == ["q", "-S"]
    assert strip_pidfile(["q", "-S"]) == ["q", "-S"]


def test_unmerged_usr_binds_the_host_dirs() -> None:
    bw = _bwrap_part(_wrap(merged_usr=False))
    assert "--symlink" not in bw
    assert ("/lib", "/lib") in _pairs(bw, "--ro-bind-try")


def test_relative_paths_are_refused() -> None:
    with pytest.raises(ValueError):
        _wrap(vm_dir=Path("vm"))


def test_confinement_off_by_setting() -> None:
    assert confine.from_settings(Settings(vmm_confine=False)) is None


def test_missing_bwrap_is_a_clear_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which
    monkeypatch.setattr(confine.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    with pytest.raises(ConfinementError, match="bwrap not found.*bubblewrap.*PODBAY_VMM_CONFINE=false"):
        Confinement.prepare("podbay-vm")
    with pytest.raises(ConfinementError, match="bwrap not found"):
        confine.from_settings(Settings(vmm_confine=True))


def test_read_child_pid_from_info_fd() -> None:
    r, w = os.pipe()
    os.write(w, json.dumps({"child-pid": 4242, "pid-namespace": 1}).encode())
    try:
        assert read_child_pid(r, 5.0) == 4242
    finally:
        os.close(r)
        os.close(w)


def test_read_child_pid_when_bwrap_failed() -> None:
    r, w = os.pipe()
    os.close(w)
    try:
        with pytest.raises(ConfinementError, match="exited before starting QEMU"):
            read_child_pid(r, 5.0)
    finally:
        os.close(r)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to another user")
OTHER = VmmUser("nobody", 65534, 65534)


@needs_root
def test_vm_dir_stays_roots_and_only_the_files_qemu_writes_are_the_users(tmp_path: Path) -> None:
    vm = tmp_path / "vm"
    vm.mkdir()
    (vm / "disk.img").write_bytes(b"disk")
    (vm / "run").mkdir()
    (vm / "run" / "qmp.sock").write_bytes(b"stale")
    own_vm_files(vm, vm / "run", confine.VM_WRITABLE_FILES, OTHER)
    st = vm.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, OTHER.gid, 0o750)
    for name in confine.VM_WRITABLE_FILES:  # ram and the slots did not exist: made, since QEMU cannot
        f = (vm / name).stat()
        assert (f.st_uid, f.st_mode & 0o777) == (OTHER.uid, 0o600), name
    assert (vm / "disk.img").read_bytes() == b"disk"
    assert (vm / "run").stat().st_uid == OTHER.uid and os.listdir(vm / "run") == []
    assert "console.log" not in confine.VM_WRITABLE_FILES  # the node agent writes it (console.py), not QEMU


@needs_root
def test_a_planted_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    vm = tmp_path / "vm"
    vm.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("x")
    (vm / "ram").symlink_to(secret)
    with pytest.raises(OSError):
        own_vm_files(vm, vm / "run", confine.VM_WRITABLE_FILES, OTHER)
    assert secret.stat().st_uid == 0


@needs_root
def test_lock_run_dir_takes_it_back_and_checks_the_sockets(tmp_path: Path) -> None:
    import socket

    run = tmp_path / "run"
    run.mkdir()
    os.chown(run, OTHER.uid, OTHER.gid)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(run / "qmp.sock"))
        confine.lock_run_dir(run, (run / "qmp.sock", run / "channel.sock"))
    assert run.stat().st_uid == 0
    (run / "channel.sock").symlink_to("/run/some-host.sock")
    with pytest.raises(ConfinementError, match="not a socket"):
        confine.lock_run_dir(run, (run / "qmp.sock", run / "channel.sock"))


def test_uid_ranges_parse() -> None:
    assert confine.UidRange.parse("") is None
    assert confine.UidRange.parse("200000-200063") == confine.UidRange(200000, 64)
    for bad in ("5-10", "200000", "300-200", "a-b", "200000-100000"):
        with pytest.raises(ValueError):
            confine.UidRange.parse(bad)


@needs_root
def test_each_qemu_gets_its_own_uid_and_a_gone_ones_comes_back(tmp_path: Path) -> None:
    pool = confine.UidPool(confine.UidRange(200000, 3), registry=tmp_path / "uids")
    assert (pool.take(tmp_path / "a"), pool.take(tmp_path / "b")) == (200000, 200001)  # both starting
    qemu = subprocess.Popen(["sleep", "60"], user=200000, group=200000, extra_groups=[])  # a's QEMU
    other = subprocess.Popen(["sleep", "60"])  # runs as root: a pid reused by something else
    try:
        pool.bind(200000, qemu.pid, tmp_path / "a")
        pool.bind(200001, other.pid, tmp_path / "b")
        old = time.time() - 600
        os.utime(tmp_path / "uids" / "200000", (old, old))  # age does not matter once a pid is recorded
        assert pool.take(tmp_path / "c") == 200001  # b's record names a process of another uid: free
        assert pool.take(tmp_path / "d") == 200002
        with pytest.raises(confine.ConfinementError):
            pool.take(tmp_path / "e")  # a runs, c and d are starting
        pool.release(200002)  # d did not start
        assert pool.take(tmp_path / "f") == 200002
    finally:
        for p in (qemu, other):
            p.kill()
            p.wait()
    assert pool.take(tmp_path / "g") == 200000  # a's QEMU is gone
    # A start that never recorded its pid frees its uid after two minutes.
    old = time.time() - 600
    os.utime(tmp_path / "uids" / "200001", (old, old))
    assert pool.take(tmp_path / "h") == 200001


def test_a_uid_range_in_the_settings_gives_a_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(confine.Confinement, "prepare",
                        classmethod(lambda cls, name="x": cls(OTHER, "/usr/bin/bwrap", "/usr/bin/setpriv")))
    conf = confine.from_settings(Settings(data_dir=tmp_path, vmm_uid_range="300000-300009"))
    assert conf is not None and conf.uids is not None and conf.uids.uids == confine.UidRange(300000, 10)
    assert confine.from_settings(Settings(data_dir=tmp_path)).uids is None  # type: ignore[union-attr]
    with pytest.raises(confine.ConfinementError):
        confine.from_settings(Settings(data_dir=tmp_path, vmm_uid_range="1-2"))
