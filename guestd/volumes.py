"""Volumes in the guest: mount the host's volume slots at the paths ``after_restore.volumes`` names.

The host attaches a volume by backing one of the guest's virtio-blk volume slots with the volume's ext4 file
(services/nodeagent/vmm.py "Volume slots"); slot N's device is the ``/dev/vd*`` whose
``/sys/block/vd*/serial`` reads ``podbay-vol<N>``. Mounting a slot: drop the device's buffer cache first
(ioctl BLKFLSBUF: the template's snapshot may hold cached blocks of the empty placeholder the slot had),
create the path, ``mount -t ext4`` it (``ro,noload`` when read-only: the device is read-only in QEMU, so the
journal cannot be replayed). A slot already mounted at its path (a restore of the sandbox's own snapshot,
whose memory has it mounted) is left as it is. Errors are ``OSError`` naming the slot and the path.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from typing import Any

__all__ = ["mount_volumes", "slot_device", "BLKFLSBUF", "SERIAL_PREFIX"]

#: <linux/fs.h> _IO(0x12, 97): flush the device's buffer cache.
BLKFLSBUF = 0x1261
SERIAL_PREFIX = "podbay-vol"


def slot_device(slot: int, sys_block: str = "/sys/block") -> str:
    """``/dev/vdX`` of volume slot ``slot``; raises ``FileNotFoundError`` when no device has its serial."""
    want = f"{SERIAL_PREFIX}{slot}"
    for name in sorted(os.listdir(sys_block)):
        try:
            with open(os.path.join(sys_block, name, "serial")) as f:
                if f.read().strip() == want:
                    return f"/dev/{name}"
        except OSError:
            continue
    raise FileNotFoundError(f"no block device with serial {want}")


def _mounted_at(path: str) -> str | None:
    """The source mounted at ``path`` (from /proc/self/mounts), or None."""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[1] == path:
                return parts[0]
    return None


def mount_volumes(volumes: list[dict[str, Any]]) -> list[str]:
    """Mount each ``{slot, path, readonly}``; returns the paths mounted now or already. Raises ``OSError``."""
    done: list[str] = []
    for vol in volumes:
        slot, path, ro = int(vol["slot"]), str(vol["path"]), bool(vol.get("readonly", False))
        dev = slot_device(slot)
        if _mounted_at(path) == dev:
            done.append(path)
            continue
        fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, BLKFLSBUF)
        finally:
            os.close(fd)
        os.makedirs(path, exist_ok=True)
        opts = "ro,noload" if ro else "rw"
        proc = subprocess.run(["mount", "-t", "ext4", "-o", opts, dev, path], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"mount of volume slot {slot} ({dev}) at {path} failed: "
                          f"{(proc.stderr or proc.stdout).strip()}")
        done.append(path)
    return done
