"""A sandbox's root disk made larger than its template's (``POST /v1/sandboxes`` with ``disk_mib``).

A sandbox starts as a restore of its template's full snapshot, whose guest kernel holds the template's disk
capacity and whose mounted ext4 filesystem fills it. The capacity of a virtio-blk device is not migrated
state, but the guest reads it only at probe or on a config-change interrupt, so growing the file before QEMU
starts would leave the guest unaware of it. Hence, with the guest running:

1. QMP ``block_resize`` of the root drive to the wanted size: QEMU extends ``disk.img`` (sparse: the new
   space costs nothing until written) and raises the config-change interrupt (``VmHandle.resize_root``);
2. through the guest channel, as root, wait until the kernel shows the new size (``/sys/block/vda/size``,
   512-byte sectors; the interrupt is handled asynchronously) and grow the mounted filesystem online with
   ``resize2fs /dev/vda`` (ext4's online resize: no unmount, no pause).

The grown disk file is then the sandbox's own: its snapshots, forks, suspend and wake, and migrations copy
the file with its size and filesystem, so they keep it with nothing more to do. Runs once, at create; a
disk is only ever grown. The guest needs ``resize2fs`` (e2fsprogs: Debian-based templates have it; an image
without it fails the create with the guest's message).

Errors::

    DiskGrowError(PodbayError)   disk_grow_failed   the resize or the guest's resize2fs failed (``details.output``)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from podbay.channel.client import GuestChannel
from podbay.contracts.channel import ExecSpec
from podbay.errors import PodbayError

from ..vm.vmdriver import VmHandle

__all__ = ["DiskGrowError", "grow_root", "GROW_SCRIPT"]

log = logging.getLogger("podbay.nodeagent.diskgrow")

#: Run by ``/bin/sh`` as root with ``$1`` the wanted size in 512-byte sectors: up to 10 s for the guest
#: kernel to see the new capacity, then an online resize of the root filesystem. POSIX sh and coreutils or
#: busybox only.
GROW_SCRIPT = (
    'i=0; while [ "$(cat /sys/block/vda/size)" -lt "$1" ]; do '
    'i=$((i+1)); [ "$i" -le 200 ] || { echo "vda still has $(cat /sys/block/vda/size) sectors" >&2; exit 3; }; '
    "sleep 0.05; done; "
    "exec resize2fs /dev/vda 2>&1"
)

_GROW_TIMEOUT_S = 120.0


class DiskGrowError(PodbayError):
    """Growing a sandbox's root disk failed (``details.output``: what the guest said)."""

    code = "disk_grow_failed"
    http_status = 500


async def grow_root(handle: VmHandle, channel: GuestChannel, disk: Path, size: int) -> float | None:
    """Grow the running guest's root disk (``disk``, its ``disk.img``) to ``size`` bytes and its filesystem
    to fill it (module docstring). Nothing to do, returning None, when the disk is already that large (a
    restore of the sandbox's own snapshot). Returns the milliseconds it took. Raises :class:`DiskGrowError`
    (also for a ``size`` smaller than the disk: a disk only grows), ``VmOperationError``, ``GuestError``."""
    have = disk.stat().st_size
    if size == have:
        return None
    if size < have:
        raise DiskGrowError(f"the disk is {have // (1 << 20)} MiB; it cannot shrink to {size // (1 << 20)} MiB",
                            details={"disk_bytes": have, "want_bytes": size})
    t = time.perf_counter()
    await handle.resize_root(size)
    out, err, ex = await channel.run(ExecSpec(argv=["/bin/sh", "-c", GROW_SCRIPT, "grow", str(size // 512)],
                                              user="root", timeout_s=_GROW_TIMEOUT_S))
    text = (out + err).decode(errors="replace")[-2000:]
    if ex.exit_code != 0:
        raise DiskGrowError(f"growing the root filesystem failed (exit {ex.exit_code}): {text.strip()}",
                            details={"output": text, "exit_code": ex.exit_code})
    ms = (time.perf_counter() - t) * 1000
    log.info("root disk grown from %d to %d MiB in %.0f ms", have >> 20, size >> 20, ms)
    return ms
