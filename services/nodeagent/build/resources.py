"""A build's resources (memory, vCPUs, disk size) and the one boot that changes them.

A template's memory and vCPUs are part of its full snapshot (the RAM file's size, the CPUs' device state),
which a restore cannot change. So a build whose resources are its ``FROM`` template's restores the parent
as every build does (builder.py), and a build that asks for others makes a *resized root* first:

1. the parent's snapshot is restored with its own resources, its filesystems are frozen (FIFREEZE writes
   everything back and leaves the journal clean) and its disk is reflinked, then the VM is killed: a full
   snapshot's disk alone misses what was still in the guest's page cache, a frozen copy does not;
2. when the disk is to grow, the image file is extended and its ext4 filesystem grown offline
   (``e2fsck -f``, ``resize2fs``), which works for every root filesystem podbay makes (base's and an OCI
   image's are both ext4 on the whole device);
3. that disk is booted cold with the new memory and vCPUs, primed and snapshotted, exactly as a root
   template is (``template.boot_and_snapshot``).

The result is a layer like any other (``layers.LayerCache``), keyed by :func:`resize_key` (the parent's
build key and the resources), and the build's steps chain their keys from it: a build with other resources
never reuses a layer made with the parent's, and two builds asking the same resources of the same parent
share the boot. Costs seconds under TCG (a Debian guest boots in about 5 s) once per parent and resources.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from podbay.contracts.templates import BuildResources
from podbay.errors import PodbayError, Unprocessable

from podbay.config import Settings
from podbay.reflink import reflink_or_copy

from .image import BaseImage
from .template import TemplateSnapshot, boot_and_snapshot
from ..vm.vmm import Vmm
from .layers import LAYER_FILES, LayerCache

__all__ = ["Resources", "resolve", "resize_key", "grow_disk", "root_image", "resized_root", "ResizeError",
           "leftover_vm_dirs"]

MIB = 1 << 20


class ResizeError(PodbayError):
    """Growing a root filesystem failed (``details.output``: the tool's output)."""

    code = "build_resize_failed"
    http_status = 422


@dataclass(frozen=True)
class Resources:
    """What a build's template gets: ``memory_mib``, ``vcpus``, ``disk_bytes`` (its disk image's size), and
    whether they differ from the parent's so that the parent's disk is booted with them (``boot``)."""

    memory_mib: int
    vcpus: int
    disk_bytes: int
    boot: bool


def resolve(parent: TemplateSnapshot, want: BuildResources) -> Resources:
    """The build's resources: each one asked for, else the parent's. Raises ``Unprocessable`` (422) for a
    disk smaller than the parent's (a filesystem is only grown)."""
    have = parent.disk.stat().st_size
    mem = want.memory_mib if want.memory_mib is not None else parent.memory_mib
    cpus = want.vcpus if want.vcpus is not None else parent.vcpus
    disk = have
    if want.disk_mib is not None:
        if want.disk_mib * MIB < have:
            raise Unprocessable(
                f"disk_mib {want.disk_mib} is smaller than the disk of FROM template {parent.name!r} "
                f"({-(-have // MIB)} MiB); a template's disk can only grow",
                details={"disk_mib": want.disk_mib, "from_disk_mib": -(-have // MIB)})
        disk = want.disk_mib * MIB
    return Resources(memory_mib=mem, vcpus=cpus, disk_bytes=disk,
                     boot=(mem, cpus, disk) != (parent.memory_mib, parent.vcpus, have))


def resize_key(parent_key: str, res: Resources) -> str:
    """The key (sha256 hex) of the resized root of ``parent_key`` with ``res``; the first step's parent."""
    return hashlib.sha256(f"resize1\n{parent_key}\n{res.memory_mib}\n{res.vcpus}\n{res.disk_bytes}".encode()
                          ).hexdigest()


def _run(argv: list[str], ok: tuple[int, ...] = (0,)) -> None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ResizeError(f"{argv[0]} could not run: {exc}") from exc
    if out.returncode not in ok:
        text = (out.stdout + out.stderr)[-2000:]
        raise ResizeError(f"{' '.join(argv[:2])} exited {out.returncode}: {text.strip()}",
                          details={"output": text})


def grow_disk(disk: Path, size: int) -> None:
    """Extend the ext4 image ``disk`` to ``size`` bytes and grow its filesystem to fill it (blocking; the
    image must not be in use). ``e2fsck`` exit 1 means it corrected something, which a frozen copy may need
    (orphan inodes of files still open when it was frozen). Raises :class:`ResizeError`."""
    if disk.stat().st_size >= size:
        return
    _run(["e2fsck", "-f", "-y", str(disk)], ok=(0, 1))
    with disk.open("r+b") as f:
        f.truncate(size)
    _run(["resize2fs", str(disk)])


def root_image(parent: TemplateSnapshot, key: str, rootfs: Path, work: Path) -> BaseImage:
    """The parent's kernel and initrd with ``rootfs`` as an image to boot (``template.boot_and_snapshot``)."""
    return BaseImage(name=parent.name, digest=key, dir=work, kernel=parent.kernel, initrd=parent.initrd,
                     rootfs=rootfs, kernel_package="", kernel_version="", modules=[],
                     disk_size_mib=rootfs.stat().st_size // MIB,
                     built_at=_dt.datetime.now(_dt.UTC).isoformat())


def _commit(layers: LayerCache, snap_dir: Path, key: str, meta: dict[str, object], took_s: float) -> None:
    """Make ``snap_dir``'s snapshot layer ``key``: reflinks into a temporary layer committed whole (the work
    directory may be another btrfs subvolume, which a rename cannot cross)."""
    tmp = layers.tmp_dir(key)
    try:
        for f in LAYER_FILES:
            reflink_or_copy(snap_dir / f, tmp / f)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    layers.commit(tmp, key, meta, took_s)


async def resized_root(layers: LayerCache, work_root: Path, settings: Settings, vmm: Vmm, name: str,
                       parent: TemplateSnapshot, res: Resources, key: str,
                       frozen_copy: Callable[[Path], Awaitable[None]], say: Callable[[str], Awaitable[None]]) -> Path:
    """The layer ``key`` (the build of template ``name`` has its steps on it): ``parent``'s disk, as
    ``frozen_copy(dest)`` writes it (step 1 of the module docstring), grown to ``res.disk_bytes``, booted with
    ``res``'s memory and vCPUs and snapshotted; or the cached layer. ``work_root``: a directory on the layers'
    filesystem that the node agent empties at start (the builds' own), with short paths (QEMU's socket paths
    must stay under 108 bytes). ``say`` reports progress (the build log). Returns the layer's directory in
    this store. Raises ``TemplateError`` (the boot failed) or :class:`ResizeError`; either way no layer is
    left."""
    if await asyncio.to_thread(layers.has, key):
        await asyncio.to_thread(layers.touch, key)
        await say(f"resized root {key[:12]} cached")
        return await asyncio.to_thread(layers.local, key)
    t = time.monotonic()
    work_root.mkdir(parents=True, exist_ok=True)
    disk, snap_dir = work_root / f"r{key[:10]}.img", work_root / f"r{key[:10]}"
    try:
        await frozen_copy(disk)
        await asyncio.to_thread(grow_disk, disk, res.disk_bytes)
        await say(f"booting {parent.name}'s disk with {res.memory_mib} MiB and {res.vcpus} vCPUs")
        await boot_and_snapshot(name, settings, root_image(parent, key, disk, work_root), parent.accel,
                                parent.qemu_version, parent.tsc_khz, key, snap_dir, lambda _s, _f: None, vmm,
                                aslr=parent.guest_aslr, memory_mib=res.memory_mib, vcpus=res.vcpus)
        took = time.monotonic() - t
        await asyncio.to_thread(_commit, layers, snap_dir, key,
                                {"step": f"RESIZE {res.memory_mib} MiB {res.vcpus} vCPUs {res.disk_bytes // MIB} MiB",
                                 "template": name}, took)
    finally:
        await asyncio.to_thread(disk.unlink, True)
        await asyncio.to_thread(shutil.rmtree, snap_dir, True)
    await say(f"resized root {key[:12]} made in {took * 1000:.0f} ms")
    return layers.path(key)


def leftover_vm_dirs(work_root: Path) -> list[Path]:
    """The VM directories under a node's build directory (``work_root``) where an interrupted build may have
    left a QEMU running: each builder's (``<build id>``) and each resized root's boot
    (``.tmp-<name>-*/vm``, made by ``template.boot_and_snapshot``); not the build contexts (``*.ctx``)."""
    if not work_root.exists():
        return []
    return [d / "vm" if d.name.startswith(".tmp-") else d for d in sorted(work_root.iterdir())
            if d.is_dir() and not d.name.endswith(".ctx")]
