"""Prepare a template: build (or reuse) its image, boot it once, wait for guestd, take a full snapshot.

Every later sandbox of the template is a restore of that snapshot (docs/DESIGN.md §3: boot once per template,
restore afterwards). The snapshot is cached under ``CACHE/templates/<name>-<key16>/`` with ``template.json``
(:class:`TemplateSnapshot`), keyed by (image digest, QEMU version, accel, memory_mib, vcpus, host TSC kHz), and
is self-contained (kernel and initrd are copied in), so it can be promoted or moved as one directory.

Progress goes to a callback ``(step, fraction)``; steps: ``kernel``, ``initramfs``, ``debootstrap``,
``rootfs`` (image.py), then ``accel``, ``boot``, ``guestd``, ``prime`` (:func:`prime_guest`), ``snapshot``. Errors: :class:`TemplateError`
(an :class:`~podbay_nodeagent.build.image.ImageBuildError` naming the step and the kept log).

CLI: ``template_main(["build", "base", "--force"])`` (wired as ``podbay-nodeagent template build base``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import fcntl
import hashlib
import importlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from podbay.config import Settings, get_settings
from podbay.contracts.templates import ImageConfig
from podbay.stacknet import builder_tap
from ..vm import confine
from ..vm.accel import Accel, host_tsc_khz, qemu_version, resolve_accel
from .image import BaseImage, ImageBuildError, ProgressFn, build_base_image
from ..net.network import create_tap
from ..vm.vmm import QemuVmm, VmConfig, VmProcess, Vmm, reflink_or_copy

# Boots in one process at once (an OCI root and a resized root of two builds) each need a tap of their own:
# a tap that another QEMU still holds cannot be created again (EBUSY).
_BOOT_SEQ = itertools.count()

__all__ = [
    "TemplateSnapshot",
    "TemplateError",
    "prepare_template",
    "guest_aslr",
    "wait_guest_ready",
    "template_main",
    "GUESTD_CONSOLE_MARKER",
    "TEMPLATES",
    "MACHINE",
    "PRIME",
    "prime_guest",
]

TEMPLATES = ("base",)
GUESTD_CONSOLE_MARKER = "podbay-init: starting guestd"
"""Printed by ``/sbin/podbay-init`` just before it execs guestd (assets/podbay-init.sh)."""


class TemplateError(ImageBuildError):
    """Preparing a template failed at ``step`` (``accel``, ``boot``, ``guestd``, ``prime``, ``snapshot`` or an
    image step)."""

    code = "template_failed"


class TemplateSnapshot(BaseModel):
    """A booted template's full snapshot (``template.json`` in ``dir``). Paths are absolute."""

    name: str
    key: str = Field(description="sha256 hex of (image digest, qemu version, accel, memory, vcpus, tsc).")
    dir: Path
    kernel: Path
    initrd: Path
    state: Path
    ram: Path
    disk: Path
    memory_mib: int
    vcpus: int
    tsc_khz: int = Field(description="The tsc_early_khz the template booted with; restores reuse it.")
    image_digest: str
    qemu_version: str
    accel: Accel
    boot_s: float = Field(description="Fresh boot to guestd answering, in seconds.")
    paused_ms: float = Field(description="Guest pause for the snapshot, in ms.")
    created_at: str
    machine: str = Field("", description="The device set it was booted with (MACHINE); '' before NICs.")
    parent: str | None = Field(None, description="The template a build made this one FROM (build/); None for base.")
    config: ImageConfig | None = Field(None, description="Defaults of exec in its sandboxes (ENV, WORKDIR, USER).")
    guest_aslr: bool = Field(True, description="Whether its guest randomises process address spaces "
                             "(``kernel.randomize_va_space`` 2, the kernel's default) or not (0; see guest_aslr()).")

    @classmethod
    def load(cls, directory: Path) -> TemplateSnapshot:
        """Read ``directory/template.json``, with every path rebased onto ``directory`` (so a template
        directory can be copied elsewhere, e.g. into the node's btrfs store, and loaded from there)."""
        tpl = cls.model_validate_json((directory / "template.json").read_text())
        return tpl.model_copy(update={
            "dir": directory, "kernel": directory / "vmlinuz", "initrd": directory / "initrd.img",
            "state": directory / "state", "ram": directory / "ram", "disk": directory / "disk.img",
        })

    def vm_config(self, settings: Settings | None = None, **overrides: Any) -> VmConfig:
        """The :class:`VmConfig` that restores this snapshot (timeouts from ``settings``)."""
        s = settings or get_settings()
        fields: dict[str, Any] = dict(
            kernel=self.kernel, initrd=self.initrd, memory_mib=self.memory_mib, vcpus=self.vcpus,
            accel=self.accel, tsc_khz=self.tsc_khz, qemu_binary=s.qemu_binary, boot_timeout_s=s.boot_timeout_s,
            restore_timeout_s=s.restore_timeout_s, restore_retries=s.restore_retries,
            tcg_tb_size_mib=s.tcg_tb_size_mib, seccomp=s.vmm_seccomp,
        )
        fields.update(overrides)
        return VmConfig(**fields)


def _channel_client() -> Any | None:
    """``podbay.channel.client.GuestChannel`` when that module exists, else None."""
    try:
        return importlib.import_module("podbay.channel.client").GuestChannel
    except (ImportError, AttributeError):
        return None


async def wait_guest_ready(vmm: Vmm, vm: VmProcess, timeout_s: float) -> str:
    """Wait until guestd answers a ping on the VM's channel; returns how readiness was seen.

    Uses ``GuestChannel.connect(socket, timeout_s=...)`` + ``ping()`` when the channel client exists
    (``"ping"``), else the console marker :data:`GUESTD_CONSOLE_MARKER` (``"console"``). Raises
    ``TimeoutError`` after ``timeout_s`` and ``RuntimeError`` when QEMU exits first.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    client = _channel_client()
    last: BaseException | None = None
    while loop.time() < deadline:
        if not vmm.is_alive(vm):
            raise RuntimeError(f"QEMU exited while booting (code {vm.exit_code})")
        if client is None:
            with contextlib.suppress(OSError):
                if GUESTD_CONSOLE_MARKER in vm.paths.console.read_text(errors="replace"):
                    return "console"
            await asyncio.sleep(0.05)
            continue
        try:
            left = max(0.5, deadline - loop.time())
            ch = await client.connect(vm.paths.channel, timeout_s=min(left, 10.0))
            try:
                await ch.ping(timeout_s=min(left, 5.0))
            finally:
                await ch.close()
            return "ping"
        except Exception as exc:  # the client's error tree is not ours to enumerate; retry until the bound
            last = exc
            await asyncio.sleep(0.1)
    raise TimeoutError(f"guestd did not answer within {timeout_s} s (last error: {last!r})")


#: What :func:`prime_guest` does before the snapshot; part of the key, so a change rebuilds the snapshot.
PRIME = "prime1"

#: The guest kernel's ASLR switch (Documentation/admin-guide/sysctl/kernel.rst, ``randomize_va_space``).
ASLR_SYSCTL = "/proc/sys/kernel/randomize_va_space"

#: The placeholder network a template is primed with (RFC 5737 TEST-NET-1: never routed); every restore's
#: hygiene replaces it with the sandbox's own.
_PRIME_ADDRESS, _PRIME_GATEWAY = "192.0.2.2", "192.0.2.1"


def guest_aslr(settings: Settings, accel: Accel) -> bool:
    """Whether guests of templates built with ``settings`` under ``accel`` randomise their processes' address
    spaces (``Settings.guest_aslr``; ``auto``: under KVM only).

    Why not under TCG: QEMU 7.2 looks translated code up by the guest's virtual address as well as the physical
    one (x86 system emulation has no position-independent translation blocks before QEMU 8), so with ASLR every
    exec maps the loader and libc somewhere new and translates their start-up code again. The trade is defence
    in depth inside the guest (a process's layout is predictable to an exploit of that process); the sandbox's
    boundary is the VM, which this does not touch, and root in a guest can turn it back on."""
    if settings.guest_aslr == "auto":
        return accel == "kvm"
    return settings.guest_aslr == "on"


async def prime_guest(vm: VmProcess, name: str, timeout_s: float, *, aslr: bool = True) -> None:
    """Run the after-restore hygiene once in the template's guest before it is snapshotted, with throwaway
    values (hostname ``name``, a seed, the clock, the placeholder network, a CA whose key is dropped at
    once) and one exec of ``true``. What that leaves in guest memory is then in every restore: the NIC up
    (virtio-net's receive ring filled), the trust store's pristine copy made and its files in the page
    cache, the exec path's files cached. Measured under TCG (``create.py --phases cold``, 100 creates, two
    runs each): cold creates p50 404-434 ms against 500-519 ms from an unprimed template. Every restore sets
    all of these again (``after_restore``), so no placeholder survives into a sandbox. With ``aslr`` False
    the guest's ``kernel.randomize_va_space`` becomes 0 (:func:`guest_aslr`), before the exec, so that
    every sandbox's processes start at the same addresses. No-op without the channel client.
    """
    client = _channel_client()
    if client is None:
        return
    from podbay.contracts.channel import ExecSpec, GuestNet
    from podbay.sandbox_ca import new_sandbox_ca

    _key_pem, cert_pem = new_sandbox_ca(f"template {name}", 0)
    ch = await client.connect(vm.paths.channel, timeout_s=timeout_s)
    try:
        await ch.after_restore(hostname=name, seed=os.urandom(64), time_ns=time.time_ns(),
                               net=GuestNet(address=_PRIME_ADDRESS, prefix_len=30, gateway=_PRIME_GATEWAY,
                                            dns=[_PRIME_GATEWAY], ca_cert_pem=cert_pem.decode()))
        if not aslr:
            _out, err, exit_ = await ch.run(ExecSpec(argv=["sh", "-c", f"echo 0 > {ASLR_SYSCTL}"]))
            if exit_.exit_code != 0:
                raise RuntimeError(f"turning the guest's ASLR off exited {exit_.exit_code}: {err[-200:]!r}")
        _out, err, exit_ = await ch.run(ExecSpec(argv=["true"]))
        if exit_.exit_code != 0:
            raise RuntimeError(f"priming exec of `true` exited {exit_.exit_code}: {err[-200:]!r}")
    finally:
        await ch.close()


#: Bumped when the machine's devices change (the snapshot's device state must match every restore's):
#: "net1" = one virtio-net NIC; "net2" = the same with the tap's vnet_hdr off (restores on any backend);
#: "net2-vol4" = plus four virtio-blk volume slots (vmm.py "Volume slots": no hot-plug on microvm, so the
#: template reserves them). Part of the key, and recorded in template.json so that a node agent never
#: imports a build made for another device set (e.g. by an older agent sharing the build cache).
MACHINE = "net2-vol4"


def snapshot_key(image: BaseImage, qver: str, accel: str, memory_mib: int, vcpus: int, tsc_khz: int, *,
                 aslr: bool = True) -> str:
    """The key (sha256 hex) of ``image``'s booted snapshot: every input its device and guest state depend on
    (``aslr``: :func:`guest_aslr`)."""
    src = json.dumps([image.digest, qver, accel, memory_mib, vcpus, tsc_khz, MACHINE, PRIME,
                      *([] if aslr else ["aslr0"])])
    return hashlib.sha256(src.encode()).hexdigest()


@contextlib.asynccontextmanager
async def locked(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on ``path``, so two processes never prepare the same cache at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


async def prepare_template(
    name: str,
    settings: Settings,
    progress: ProgressFn | None = None,
    *,
    force: bool = False,
    vmm: Vmm | None = None,
) -> TemplateSnapshot:
    """Build or reuse template ``name``'s image and booted snapshot; see the module docstring.

    ``force`` rebuilds the image's final step and the snapshot. Minutes on a cold cache, ~10 s under TCG
    when only the snapshot is missing, milliseconds when cached. Raises :class:`TemplateError` or
    :class:`~podbay_nodeagent.build.image.ImageBuildError`.
    """
    if name not in TEMPLATES:
        raise TemplateError("template", f"unknown template {name!r} (known: {', '.join(TEMPLATES)})")
    report: ProgressFn = progress or (lambda _s, _f: None)
    root = settings.cache_dir / "templates"
    async with locked(root / f".{name}.lock"):
        image = await build_base_image(settings, report, force=force, name=name)
        report("accel", 0.0)
        try:
            accel = await resolve_accel(settings, image.kernel, image.initrd)
            qver = qemu_version(settings.qemu_binary)
            tsc = host_tsc_khz()
        except (OSError, RuntimeError) as exc:
            raise TemplateError("accel", str(exc)) from exc
        report("accel", 1.0)
        mem, cpus = settings.sandbox_memory_mib, settings.sandbox_vcpus
        aslr = guest_aslr(settings, accel)
        key = snapshot_key(image, qver, accel, mem, cpus, tsc, aslr=aslr)
        final = root / f"{name}-{key[:16]}"
        meta = final / "template.json"
        if meta.exists() and not force:
            for step in ("boot", "guestd", "prime", "snapshot"):
                report(step, 1.0)
            return TemplateSnapshot.load(final)
        if vmm is None:
            try:
                vmm = QemuVmm(confinement=confine.from_settings(settings))
            except confine.ConfinementError as exc:
                raise TemplateError("boot", exc.message) from exc
        return await boot_and_snapshot(name, settings, image, accel, qver, tsc, key, final, report, vmm,
                                       aslr=aslr)


async def boot_and_snapshot(
    name: str, settings: Settings, image: BaseImage, accel: Accel, qver: str, tsc: int, key: str,
    final: Path, report: ProgressFn, vmm: Vmm, *, aslr: bool, memory_mib: int | None = None,
    vcpus: int | None = None,
) -> TemplateSnapshot:
    """Boot ``image`` once, wait for guestd, prime the guest (:func:`prime_guest`) and take its full snapshot
    into ``final`` (created whole by rename). ``aslr``: the guest's ASLR, as ``key`` was made with
    (:func:`guest_aslr` for a new template, the parent's for a layer on one). ``memory_mib``/``vcpus``: the
    guest's (default: the settings' sandbox defaults). Raises :class:`TemplateError` naming the step that failed, with the console's tail in
    its log."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    log_path = settings.cache_dir / "logs" / f"template-{name}-{stamp}-{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # A short prefix: QEMU's unix socket paths below it must stay under 108 bytes (template names reach 63).
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name[:8]}-", dir=final.parent))
    vm_dir = tmp / "vm"
    snap_dir = tmp / "snap"
    vm: VmProcess | None = None
    step = "boot"
    try:
        vm_dir.mkdir()
        report(step, 0.0)
        await asyncio.to_thread(reflink_or_copy, image.rootfs, vm_dir / "disk.img")
        shutil.copy2(image.kernel, tmp / "vmlinuz")
        shutil.copy2(image.initrd, tmp / "initrd.img")
        config = VmConfig(
            kernel=tmp / "vmlinuz", initrd=tmp / "initrd.img", memory_mib=memory_mib or settings.sandbox_memory_mib,
            vcpus=vcpus or settings.sandbox_vcpus, accel=accel, tsc_khz=tsc, qemu_binary=settings.qemu_binary,
            boot_timeout_s=settings.boot_timeout_s, tcg_tb_size_mib=settings.tcg_tb_size_mib,
        )
        t0 = time.monotonic()
        # The NIC needs a backend while the template boots; a tap of its own (the stack's ruleset covers it),
        # gone with QEMU. No address: the template never talks to the network.
        tap_fd = create_tap(builder_tap(settings.data_dir, os.getpid() * 10 + next(_BOOT_SEQ) % 10))
        try:
            vm = await vmm.boot(config, vm_dir, tap_fd=tap_fd)
        finally:
            os.close(tap_fd)
        report(step, 1.0)
        step = "guestd"
        report(step, 0.0)
        how = await wait_guest_ready(vmm, vm, settings.boot_timeout_s)
        boot_s = time.monotonic() - t0
        report(step, 1.0)
        step = "prime"
        report(step, 0.0)
        await prime_guest(vm, name, settings.boot_timeout_s, aslr=aslr)
        report(step, 1.0)
        step = "snapshot"
        report(step, 0.0)
        snap = await vmm.snapshot_full(vm, snap_dir, leave_stopped=True)
        await vmm.stop(vm)
        vm = None
        for f in ("state", "ram", "disk.img"):
            os.replace(snap_dir / f, tmp / f)
        shutil.rmtree(vm_dir)
        shutil.rmtree(snap_dir)
        tpl = TemplateSnapshot(
            name=name, key=key, dir=final, kernel=final / "vmlinuz", initrd=final / "initrd.img",
            state=final / "state", ram=final / "ram", disk=final / "disk.img", memory_mib=config.memory_mib,
            vcpus=config.vcpus, tsc_khz=tsc, image_digest=image.digest, qemu_version=qver, accel=accel,
            boot_s=round(boot_s, 3), paused_ms=round(snap.paused_ms, 3),
            created_at=_dt.datetime.now(_dt.UTC).isoformat(), machine=MACHINE, guest_aslr=aslr,
        )
        (tmp / "template.json").write_text(tpl.model_dump_json(indent=2))
        log_path.write_text(f"template {name} ready via {how} in {boot_s:.2f} s; snapshot paused "
                            f"{snap.paused_ms:.1f} ms ({snap.copy_mode})\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        report(step, 1.0)
        return tpl
    except BaseException as exc:
        console = ""
        with contextlib.suppress(OSError):
            console = (vm_dir / "console.log").read_text(errors="replace")[-20000:]
            console += "\n--- qemu.log ---\n" + (vm_dir / "qemu.log").read_text(errors="replace")[-5000:]
        log_path.write_text(f"step {step} failed: {exc!r}\n--- console ---\n{console}\n")
        if vm is not None:
            with contextlib.suppress(Exception):
                await vmm.kill(vm)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, ImageBuildError):
            raise TemplateError(step, str(exc) or repr(exc), log_path=log_path) from exc
        raise


# ------------------------------------------------------------------------------------------------- CLI


def template_main(argv: list[str]) -> int:
    """``template build <name> [--force]``: prepare the template with a rich progress display (on stderr),
    print its ``template.json`` on stdout; returns 0, or 1 with the failed step and log path on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    parser = argparse.ArgumentParser(prog="podbay-nodeagent template")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the image and the booted snapshot of a template")
    b.add_argument("name", choices=TEMPLATES)
    b.add_argument("--force", action="store_true", help="rebuild the root image and the snapshot")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    settings = get_settings()
    steps = ("kernel", "initramfs", "debootstrap", "rootfs", "accel", "boot", "guestd", "prime", "snapshot")
    with Progress(TextColumn("{task.description:<12}"), BarColumn(), TextColumn("{task.percentage:>5.0f}%"),
                  TimeElapsedColumn(), console=console) as bar:
        tasks = {s: bar.add_task(s, total=1.0, start=False) for s in steps}

        def progress(step: str, fraction: float) -> None:
            task = tasks.get(step)
            if task is None:
                return
            bar.start_task(task)
            bar.update(task, completed=fraction)
            if fraction >= 1.0:
                bar.stop_task(task)

        try:
            tpl = asyncio.run(prepare_template(args.name, settings, progress, force=args.force))
        except ImageBuildError as exc:
            bar.stop()
            console.print(f"[red]error:[/red] {exc.message}")
            return 1
    print(tpl.model_dump_json(indent=2))
    return 0
