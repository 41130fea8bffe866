"""Host facts the VMM needs: which accelerator works, the host TSC frequency, the QEMU version, and the guest
kernel command line that depends on them (``kernel_cmdline``; the VMM and the KVM probe both boot with it).

``accel=auto`` boots a probe guest (the template kernel and initramfs with ``podbay.probe=1``, no disk) under
KVM with a short timeout (``Settings.kvm_probe_timeout_s``) and falls back to TCG when it does not print its
marker. Why: on hosts whose ``/dev/kvm`` is ``kvm_pvm`` a stock kernel hangs in its decompressor
(docs/DESIGN.md §3), so the presence of ``/dev/kvm`` proves nothing. The result is cached per host in
``CACHE/accel-<host key>.json``; the key covers the host name, host kernel, QEMU version and guest kernel.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Literal

from podbay.config import Settings

__all__ = [
    "Accel",
    "resolve_accel",
    "probe_kvm",
    "host_tsc_khz",
    "parse_tsc_khz",
    "qemu_version",
    "kernel_cmdline",
    "PROBE_MARKER",
]

Accel = Literal["kvm", "tcg"]
PROBE_MARKER = "PODBAY-PROBE-OK"


def kernel_cmdline(tsc_khz: int, extra: str = "") -> str:
    """The guest kernel command line of docs/DESIGN.md §3; ``tsc_khz`` is the host TSC in kHz."""
    base = (
        "console=ttyS0 reboot=t panic=-1 lpj=2000000 tsc=reliable no_timer_check "
        f"tsc_early_khz={tsc_khz} i8042.noaux i8042.nomux i8042.nopnp quiet"
    )
    return f"{base} {extra}".strip()


def parse_tsc_khz(sysfs: str | None, dmesg: str | None, cpuinfo: str | None) -> int | None:
    """The host TSC in kHz from (in order of trust) sysfs ``tsc_freq_khz``, dmesg, ``/proc/cpuinfo``.

    dmesg's "Refined TSC clocksource calibration: X MHz" wins over "tsc: Detected X MHz processor";
    ``cpu MHz`` from cpuinfo is the last resort. Returns None when no source gives a value.
    """
    if sysfs and sysfs.strip().isdigit():
        return int(sysfs.strip())
    if dmesg:
        for pattern in (r"Refined TSC clocksource calibration:\s*([\d.]+)\s*MHz", r"tsc: Detected\s*([\d.]+)\s*MHz"):
            found = re.findall(pattern, dmesg)
            if found:
                return round(float(found[-1]) * 1000)
    if cpuinfo:
        m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.M)
        if m:
            return round(float(m.group(1)) * 1000)
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


@lru_cache(maxsize=1)
def host_tsc_khz() -> int:
    """The host TSC frequency in kHz, for the guest's ``tsc_early_khz=`` (docs/DESIGN.md §3: without it a third
    to a half of TCG boots hang). Raises ``RuntimeError`` when no source gives it."""
    dmesg: str | None = None
    sysfs = _read("/sys/devices/system/cpu/cpu0/tsc_freq_khz")
    if sysfs is None:
        try:
            dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            dmesg = None
    khz = parse_tsc_khz(sysfs, dmesg, _read("/proc/cpuinfo"))
    if khz is None:
        raise RuntimeError("cannot read the host TSC frequency (sysfs, dmesg, /proc/cpuinfo)")
    return khz


@lru_cache(maxsize=8)
def qemu_version(binary: str = "qemu-system-x86_64") -> str:
    """``X.Y.Z`` of the QEMU binary (first line of ``--version``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True, timeout=10).stdout
    m = re.search(r"version\s+(\S+)", out)
    return m.group(1) if m else out.splitlines()[0].strip()


def _kvm_usable() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


async def probe_kvm(kernel: Path, initrd: Path, *, timeout_s: float, qemu_binary: str = "qemu-system-x86_64",
                    tsc_khz: int | None = None) -> tuple[bool, str]:
    """Boot the probe guest under KVM; ``(works, reason)``. The QEMU process is always killed afterwards."""
    if not _kvm_usable():
        return False, "/dev/kvm missing or not accessible"
    with tempfile.TemporaryDirectory(prefix="podbay-kvm-probe-") as d:
        console = Path(d) / "console.log"
        argv = [
            qemu_binary, "-M", "microvm,pit=on,pic=on,rtc=on", "-accel", "kvm", "-cpu", "host", "-m", "128M",
            "-kernel", str(kernel), "-initrd", str(initrd),
            "-append", kernel_cmdline(tsc_khz or host_tsc_khz(), extra="podbay.probe=1"),
            "-nodefaults", "-no-user-config", "-nographic", "-serial", f"file:{console}", "-no-reboot",
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while loop.time() < deadline:
                if console.exists() and PROBE_MARKER in console.read_text(errors="replace"):
                    return True, "probe guest reached its initramfs under KVM"
                if proc.returncode is not None:
                    err = (await proc.stderr.read()).decode(errors="replace") if proc.stderr else ""
                    return False, f"QEMU exited with {proc.returncode} under KVM: {err.strip()[-300:]}"
                await asyncio.sleep(0.05)
            return False, f"probe guest did not reach its initramfs within {timeout_s} s under KVM"
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def resolve_accel(settings: Settings, kernel: Path, initrd: Path) -> Accel:
    """The accelerator to use: ``settings.accel`` unless it is ``auto``, else the (cached) probe result."""
    if settings.accel != "auto":
        return settings.accel
    key_src = json.dumps([
        socket.gethostname(), os.uname().release, qemu_version(settings.qemu_binary), str(kernel),
        kernel.stat().st_size, _kvm_usable(),
    ])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = settings.cache_dir / f"accel-{key}.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("accel") in ("kvm", "tcg"):
            return cached["accel"]  # type: ignore[no-any-return]  # read from JSON; checked to be kvm or tcg just above
    except (OSError, ValueError):
        pass
    works, reason = await probe_kvm(
        kernel, initrd, timeout_s=settings.kvm_probe_timeout_s, qemu_binary=settings.qemu_binary
    )
    accel: Accel = "kvm" if works else "tcg"
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"accel": accel, "reason": reason, "key": key_src}))
    os.replace(tmp, cache)
    return accel
