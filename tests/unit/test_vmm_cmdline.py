"""The QEMU command line, the kernel command line and host facts of the VMM driver (vmm.py, accel.py)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from qemu.qmp import ExecuteError
from qemu.qmp.message import Message
from qemu.qmp.models import ErrorResponse

from podbay.config import DEFAULT_TCG_TB_SIZE_MIB, Settings
from podbay_nodeagent.vm.accel import parse_tsc_khz
from podbay_nodeagent.build.template import TemplateSnapshot
from podbay_nodeagent.vm.vmm import (
    GUEST_MAC,
    QemuVmm,
    VmConfig,
    VmProcess,
    VmOperationError,
    VmPaths,
    build_qemu_argv,
    kernel_cmdline,
    reflink_or_copy,
)


def _cfg(**kw: object) -> VmConfig:
    return VmConfig(kernel=Path("k/vmlinuz"), initrd=Path("k/initrd.img"), **kw)  # type: ignore[arg-type]


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_kernel_cmdline_is_the_design_one() -> None:
    assert kernel_cmdline(2100000) == (
        "console=ttyS0 reboot=t panic=-1 lpj=2000000 tsc=reliable no_timer_check tsc_early_khz=2100000 "
        "i8042.noaux i8042.nomux i8042.nopnp quiet"
    )
    assert kernel_cmdline(1, extra="podbay.probe=1").endswith(" quiet podbay.probe=1")


def test_tcg_argv() -> None:
    paths = VmPaths(Path("vm"))
    argv = build_qemu_argv(_cfg(memory_mib=256, vcpus=2), paths, tsc_khz=2445432)
    assert _opt(argv, "-M") == ["microvm,pit=on,pic=on,rtc=on,memory-backend=mem"]
    assert _opt(argv, "-accel") == [f"tcg,tb-size={DEFAULT_TCG_TB_SIZE_MIB}"]
    assert _opt(argv, "-cpu") == ["max"]
    assert _opt(argv, "-smp") == ["2"]
    assert _opt(argv, "-object") == ["memory-backend-file,id=mem,size=256M,mem-path=vm/ram,share=on"]
    assert _opt(argv, "-append") == [kernel_cmdline(2445432)]
    assert {"-nodefaults", "-no-user-config", "-nographic"} <= set(argv)
    devices = _opt(argv, "-device")
    assert "virtio-blk-device,drive=root" in devices
    assert "virtio-serial-device" in devices
    assert "virtserialport,chardev=ch0,name=org.podbay.channel" in devices
    assert "socket,id=ch0,path=vm/run/channel.sock,server=on,wait=off" in _opt(argv, "-chardev")
    assert _opt(argv, "-qmp") == ["unix:vm/run/qmp.sock,server=on,wait=off"]
    assert _opt(argv, "-pidfile") == ["vm/qemu.pid"]
    assert any("file=vm/disk.img,format=raw" in d for d in _opt(argv, "-drive"))
    assert "-incoming" not in argv and "-S" not in argv
    # Without a tap the one NIC hangs off an empty hub: no network at all (never slirp, never -nic).
    assert _opt(argv, "-netdev") == ["hubport,id=net0,hubid=0"]
    assert "-nic" not in argv and not any("user" in n.split(",")[0] for n in _opt(argv, "-netdev"))
    assert f"virtio-net-device,netdev=net0,mac={GUEST_MAC}" in devices


def test_a_tap_descriptor_is_the_nic_backend() -> None:
    argv = build_qemu_argv(_cfg(), VmPaths(Path("vm")), tsc_khz=1, tap_fd=7)
    assert _opt(argv, "-netdev") == ["tap,id=net0,fd=7,vhost=off"]
    assert f"virtio-net-device,netdev=net0,mac={GUEST_MAC}" in _opt(argv, "-device")
    assert "-nic" not in argv


def test_kvm_uses_host_cpu() -> None:
    argv = build_qemu_argv(_cfg(accel="kvm"), VmPaths(Path("vm")), tsc_khz=1)
    assert _opt(argv, "-accel") == ["kvm"]
    assert _opt(argv, "-cpu") == ["host"]


def test_tcg_translation_buffer_is_bounded_by_the_setting() -> None:
    # QEMU 7.2's default buffer is 1 GiB and becomes resident as a guest runs: it is always bounded, unless
    # the setting is 0 (QEMU's default); KVM has no translation buffer.
    assert DEFAULT_TCG_TB_SIZE_MIB == Settings.model_fields["tcg_tb_size_mib"].default
    assert 0 < DEFAULT_TCG_TB_SIZE_MIB < 1024
    assert _opt(build_qemu_argv(_cfg(tcg_tb_size_mib=32), VmPaths(Path("vm")), tsc_khz=1), "-accel") == [
        "tcg,tb-size=32"]
    assert _opt(build_qemu_argv(_cfg(tcg_tb_size_mib=0), VmPaths(Path("vm")), tsc_khz=1), "-accel") == ["tcg"]
    assert _opt(build_qemu_argv(_cfg(accel="kvm", tcg_tb_size_mib=32), VmPaths(Path("vm")), tsc_khz=1),
                "-accel") == ["kvm"]
    for incoming, autostart in ((True, False), (True, True)):  # restores, warm slots, migration targets
        argv = build_qemu_argv(_cfg(tcg_tb_size_mib=32), VmPaths(Path("vm")), tsc_khz=1, incoming=incoming,
                               autostart=autostart)
        assert _opt(argv, "-accel") == ["tcg,tb-size=32"]


def test_template_restores_take_the_translation_buffer_from_the_settings(tmp_path: Path) -> None:
    tpl = TemplateSnapshot(
        name="base", key="k", dir=tmp_path, kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd.img",
        state=tmp_path / "state", ram=tmp_path / "ram", disk=tmp_path / "disk.img", memory_mib=256, vcpus=1,
        tsc_khz=1, image_digest="d", qemu_version="7.2", accel="tcg", boot_s=1.0, paused_ms=1.0, created_at="now",
    )
    assert tpl.vm_config(Settings(tcg_tb_size_mib=24)).tcg_tb_size_mib == 24
    assert tpl.vm_config(Settings(tcg_tb_size_mib=0), memory_mib=512).tcg_tb_size_mib == 0


def test_incoming_waits_paused_for_a_deferred_stream() -> None:
    argv = build_qemu_argv(_cfg(), VmPaths(Path("vm")), incoming=True, tsc_khz=1)
    assert _opt(argv, "-incoming") == ["defer"]
    assert "-S" in argv


def test_a_live_migration_target_runs_the_guest_on_arrival() -> None:
    # Without -S QEMU starts the guest when the stream ends if the source ran it (the downtime then excludes
    # a node-agent round trip); a paused source's guest still arrives paused (QEMU's global state).
    argv = build_qemu_argv(_cfg(), VmPaths(Path("vm")), incoming=True, tsc_khz=1, autostart=True)
    assert _opt(argv, "-incoming") == ["defer"] and "-S" not in argv


def test_tsc_sources_in_order_of_trust() -> None:
    dmesg = "[0.1] tsc: Detected 2445.432 MHz processor\n[1.2] tsc: Refined TSC clocksource calibration: 2445.5 MHz\n"
    assert parse_tsc_khz("2100000\n", dmesg, None) == 2100000
    assert parse_tsc_khz(None, dmesg, None) == 2445500
    assert parse_tsc_khz(None, "[0.1] tsc: Detected 2445.432 MHz processor", None) == 2445432
    assert parse_tsc_khz(None, "", "processor\t: 0\ncpu MHz\t\t: 2100.000\n") == 2100000
    assert parse_tsc_khz(None, None, "nothing") is None


def test_copy_keeps_content_and_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    size = 64 * 1024 * 1024
    with src.open("wb") as f:
        f.truncate(size)
        f.seek(4096)
        f.write(b"a" * 4096)
        f.seek(size - 8192)
        f.write(b"z" * 100)
    dst = tmp_path / "dst"
    mode = reflink_or_copy(src, dst)
    assert mode in ("reflink", "copy")
    assert dst.read_bytes() == src.read_bytes()
    # Either shared extents or a sparse copy: far fewer blocks allocated than the apparent size.
    assert os.stat(dst).st_blocks * 512 < size // 4


def test_copy_across_filesystems_falls_back_to_read_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def exdev(*_a: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", exdev)
    monkeypatch.setattr(fcntl, "ioctl", exdev)
    src = tmp_path / "src"
    with src.open("wb") as f:
        f.truncate(8 * 1024 * 1024)
        f.seek(3 * 1024 * 1024 + 5)
        f.write(os.urandom(3 * 1024 * 1024))
    dst = tmp_path / "dst"
    assert reflink_or_copy(src, dst) == "copy"
    assert dst.read_bytes() == src.read_bytes()


async def test_a_qmp_command_failure_carries_qemus_description() -> None:
    reply = Message({"error": {"class": "GenericError", "desc": "migration is already running"}})

    class RefusingQmp:
        async def execute(self, cmd: str, args: object = None) -> object:
            raise ExecuteError(ErrorResponse(reply), Message({"execute": cmd}), reply)

    vm = VmProcess(paths=VmPaths(Path("/nonexistent")), pid=0, config=None, qmp=RefusingQmp())  # type: ignore[arg-type]
    with pytest.raises(VmOperationError) as info:
        await QemuVmm().execute(vm, "migrate")
    assert "migration is already running" in str(info.value)
    assert info.value.details == {"cmd": "migrate", "qmp_class": "GenericError"}


def test_volume_slots_follow_the_root_disk_with_their_serials() -> None:
    # The root must stay /dev/vda (the initramfs mounts it by name) and guestd finds slot N by its serial.
    argv = build_qemu_argv(_cfg(), VmPaths(Path("vm")), tsc_khz=1)
    devices = _opt(argv, "-device")
    blk = [d for d in devices if d.startswith("virtio-blk-device")]
    assert blk == ["virtio-blk-device,drive=root"] + [
        f"virtio-blk-device,drive=vol{n},serial=podbay-vol{n}" for n in range(4)]
    drives = _opt(argv, "-drive")
    assert [d.split(",")[1] for d in drives] == ["file=vm/disk.img"] + [f"file=vm/vol{n}.img" for n in range(4)]


def test_qemu_runs_under_its_own_seccomp_filter_unless_turned_off(tmp_path: Path) -> None:
    argv = build_qemu_argv(_cfg(), VmPaths(tmp_path), tsc_khz=1)
    assert _opt(argv, "-sandbox") == ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
    assert _opt(build_qemu_argv(_cfg(seccomp=False), VmPaths(tmp_path), tsc_khz=1), "-sandbox") == []


def test_template_configs_take_seccomp_from_the_settings(tmp_path: Path) -> None:
    tpl = TemplateSnapshot(name="t", key="k", dir=tmp_path, kernel=tmp_path / "k", initrd=tmp_path / "i",
                           state=tmp_path / "s", ram=tmp_path / "r", disk=tmp_path / "d", memory_mib=256, vcpus=1,
                           tsc_khz=1, image_digest="x", qemu_version="7.2", accel="tcg", boot_s=1.0,
                           paused_ms=1.0, created_at="2026-01-01T00:00:00Z")
    assert tpl.vm_config(Settings(vmm_seccomp=False)).seccomp is False
    assert tpl.vm_config(Settings()).seccomp is True
