"""This data dir's sandbox VMs and node stores, for ``podbay down --purge`` and the test fixtures.

The node agent runs each sandbox's QEMU in its own session (it outlives the agent) with its files in a VM
directory ``DATA_DIR/nodes/<node>/store/sandboxes/<id>/`` holding ``qemu.pid``; the store is a btrfs
filesystem, loop-mounted from ``DATA_DIR/nodes/<node>/store.btrfs`` when the data dir is not on btrfs (see
the node agent's ``store`` module). Several stacks may share a machine, so a process belongs to a data dir
only when a path in its command line lies below it by whole path components, never by string prefix.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from podbay.devstack.procs import pid_alive
from podbay.vmprocs import path_roots, vm_processes, within

__all__ = ["find_strays", "kill_strays", "node_stores", "unmount_node_stores"]

#: Kept under its old name for the stack's callers.
find_strays = vm_processes


def kill_strays(data_dir: Path) -> list[int]:
    """SIGKILL the VM processes :func:`find_strays` finds for ``data_dir``; returns the pids signalled.

    Only this data dir's VMs: a sibling directory sharing a name prefix (``/tmp/pb`` vs ``/tmp/pbch``) is
    another stack's and is never touched.
    """
    killed: list[int] = []
    for pid in find_strays(data_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(pid)
    # Wait for them to be gone, so that their files (and the store holding them) are no longer in use.
    deadline = time.monotonic() + 10.0
    while any(pid_alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def _mount_points() -> list[Path]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    # Field 5 is the mount point, with space, tab, newline and backslash as octal escapes.
    unescape = functools.partial(re.sub, r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)))
    return [Path(unescape(f[4])) for f in (line.split() for line in lines) if len(f) > 4]


def node_stores(data_dir: Path) -> list[Path]:
    """The mounted node stores of ``data_dir`` (``DATA_DIR/nodes/*/store``, as the node agent mounts them)."""
    roots = path_roots(data_dir / "nodes")
    return sorted(
        {p for p in _mount_points() if p.name == "store" and len(p.parts) >= 2 and p.parent.parent in roots}
    )


def unmount_node_stores(data_dir: Path) -> list[Path]:
    """Unmount every node store of ``data_dir`` (and anything mounted below one, deepest first), then detach
    the loop devices still backed by ``DATA_DIR/nodes/*/store.btrfs``. Returns the stores unmounted.

    Call only once no VM uses them (after :func:`kill_strays`). A busy mount is detached lazily
    (``umount -l``). Needs root, as mounting did.
    """
    stores = node_stores(data_dir)
    points = [p for p in _mount_points() if within(p, tuple(stores))]
    for point in sorted(set(points), key=lambda p: len(p.parts), reverse=True):
        if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
    for image in (data_dir / "nodes").glob("*/store.btrfs") if (data_dir / "nodes").is_dir() else ():
        try:
            out = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            break
        for line in out.stdout.splitlines():
            device = line.split(":", 1)[0].strip()
            if device.startswith("/dev/"):
                subprocess.run(["losetup", "-d", device], capture_output=True, check=False)
    return stores
