"""Guest ASLR per template (services/nodeagent/build/template.py ``guest_aslr``): resolved from the setting and the
accelerator, part of the template's key, applied by ``prime_guest`` before the snapshot. On real VMs:
tests/e2e/test_vmm.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from podbay.config import Settings
from podbay_nodeagent.build import template
from podbay_nodeagent.build.image import BaseImage
from podbay_nodeagent.build.template import ASLR_SYSCTL, guest_aslr, prime_guest, snapshot_key


@pytest.mark.parametrize(("setting", "accel", "expected"), [
    ("auto", "kvm", True), ("auto", "tcg", False), ("on", "tcg", True), ("on", "kvm", True),
    ("off", "kvm", False), ("off", "tcg", False),
])
def test_guest_aslr_is_on_under_kvm_and_off_under_tcg_unless_set(setting: str, accel: str, expected: bool) -> None:
    assert guest_aslr(Settings(guest_aslr=setting), accel) is expected  # type: ignore[arg-type]


def test_the_setting_refuses_other_values() -> None:
    with pytest.raises(ValueError, match="guest_aslr"):
        Settings(guest_aslr="maybe")  # type: ignore[arg-type]


def test_a_template_without_aslr_has_a_key_of_its_own(tmp_path: Path) -> None:
    image = BaseImage(name="base", digest="d" * 64, dir=tmp_path, kernel=tmp_path / "k", initrd=tmp_path / "i",
                      rootfs=tmp_path / "r", kernel_package="linux-image", kernel_version="6.1.0",
                      modules=[], disk_size_mib=1024, built_at="2026-01-01T00:00:00Z")
    with_aslr = snapshot_key(image, "7.2.22", "tcg", 256, 1, 2_000_000)
    assert snapshot_key(image, "7.2.22", "tcg", 256, 1, 2_000_000, aslr=True) == with_aslr
    assert snapshot_key(image, "7.2.22", "tcg", 256, 1, 2_000_000, aslr=False) != with_aslr


class _Exit:
    def __init__(self, code: int) -> None:
        self.exit_code = code


class _Channel:
    """Records what the priming runs in the guest; ``fail`` makes that argv exit 1."""

    def __init__(self, fail: str = "") -> None:
        self.ran: list[list[str]] = []
        self.fail = fail

    async def after_restore(self, **_: Any) -> None:
        self.ran.append(["<hygiene>"])

    async def run(self, spec: Any) -> tuple[bytes, bytes, _Exit]:
        self.ran.append(list(spec.argv))
        return b"", b"no", _Exit(1 if self.fail and self.fail in " ".join(spec.argv) else 0)

    async def close(self) -> None:
        pass


def _prime(monkeypatch: pytest.MonkeyPatch, channel: _Channel, aslr: bool) -> None:
    class Client:
        @staticmethod
        async def connect(_path: Path, timeout_s: float) -> _Channel:
            return channel

    class Vm:
        class paths:  # noqa: N801 - the shape of VmProcess.paths
            channel = Path("/nonexistent/channel")

    monkeypatch.setattr(template, "_channel_client", lambda: Client)
    asyncio.run(prime_guest(Vm(), "base", 5.0, aslr=aslr))  # type: ignore[arg-type]


def test_priming_without_aslr_turns_it_off_before_the_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    ch = _Channel()
    _prime(monkeypatch, ch, aslr=False)
    assert ch.ran == [["<hygiene>"], ["sh", "-c", f"echo 0 > {ASLR_SYSCTL}"], ["true"]]


def test_priming_with_aslr_leaves_the_kernel_default(monkeypatch: pytest.MonkeyPatch) -> None:
    ch = _Channel()
    _prime(monkeypatch, ch, aslr=True)
    assert ch.ran == [["<hygiene>"], ["true"]]


def test_a_guest_that_refuses_is_a_failed_priming(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="ASLR"):
        _prime(monkeypatch, _Channel(fail="randomize_va_space"), aslr=False)


@pytest.mark.parametrize("parent_aslr", [True, False])
def test_a_resized_root_layer_keeps_its_parents_aslr_whatever_the_settings(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          parent_aslr: bool) -> None:
    # The layer's key derives from the parent's, which was made with the parent's ASLR; booting the layer
    # with the current setting instead would store a guest state its key does not say.
    from podbay_nodeagent.build import resources
    from podbay_nodeagent.build.layers import LayerCache
    from podbay_nodeagent.build.template import MACHINE, TemplateSnapshot

    d = tmp_path / "base"
    d.mkdir()
    (d / "disk.img").write_bytes(b"")
    parent = TemplateSnapshot(
        name="base", key="k" * 64, dir=d, kernel=d / "vmlinuz", initrd=d / "initrd.img", state=d / "state",
        ram=d / "ram", disk=d / "disk.img", memory_mib=256, vcpus=1, tsc_khz=1, image_digest="img",
        qemu_version="7.2", accel="tcg", boot_s=1.0, paused_ms=1.0, created_at="2026-01-01T00:00:00Z",
        machine=MACHINE, guest_aslr=parent_aslr)
    seen: dict[str, Any] = {}

    async def fake_boot(*_a: Any, aslr: bool, **_kw: Any) -> None:
        seen["aslr"] = aslr
        raise RuntimeError("stop before the commit")

    async def frozen_copy(dest: Path) -> None:
        dest.write_bytes(b"")

    async def say(_text: str) -> None:
        pass

    monkeypatch.setattr(resources, "boot_and_snapshot", fake_boot)
    monkeypatch.setattr(resources, "grow_disk", lambda _disk, _size: None)
    settings = Settings(guest_aslr="off" if parent_aslr else "on")
    with pytest.raises(RuntimeError, match="stop before"):
        asyncio.run(resources.resized_root(
            LayerCache(tmp_path / "layers"), tmp_path / "work", settings, None, "web",  # type: ignore[arg-type]
            parent, resources.Resources(memory_mib=512, vcpus=1, disk_bytes=4096, boot=True), "l" * 64,
            frozen_copy, say))
    assert seen == {"aslr": parent_aslr}
