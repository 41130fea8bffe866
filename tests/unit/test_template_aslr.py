"""Guest ASLR per template (services/nodeagent/template.py ``guest_aslr``): resolved from the setting and the
accelerator, part of the template's key, applied by ``prime_guest`` before the snapshot. On real VMs:
tests/e2e/test_vmm.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from podbay.config import Settings
from podbay_nodeagent import template
from podbay_nodeagent.image import BaseImage
from podbay_nodeagent.template import ASLR_SYSCTL, guest_aslr, prime_guest, snapshot_key


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
