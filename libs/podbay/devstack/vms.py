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

__all__ = ["find_strays", "kill_strays", "node_stores", "unmount_node_stores"]

_QEMU_NAMES = ("qemu", "bwrap")


def _cmdline(proc_root: Path, pid: int) -> list[str]:
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def _alive(proc_root: Path, pid: int) -> bool:
    try:
        raw = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2 :].split()[:1] != ["Z"]


def _is_vmm(argv: list[str]) -> bool:
    """Whether argv[0] is a QEMU binary or the bubblewrap wrapper (by its base name, not a substring)."""
    return bool(argv) and any(Path(argv[0]).name.startswith(n) for n in _QEMU_NAMES)


def _arg_paths(arg: str) -> list[Path]:
    """Absolute paths an argument names: the argument itself, or a value inside it (``file=/x,mem-path=/y``,
    ``unix:/z``); normalised lexically (``..`` folded) without touching the filesystem."""
    found: list[Path] = []
    for piece in re.split(r"[,=]", arg):
        if piece.startswith("unix:"):
            piece = piece[len("unix:") :]
        if piece.startswith("/"):
            found.append(Path(os.path.normpath(piece)))
    return found


def _within(path: Path, roots: tuple[Path, ...]) -> bool:
    """Whether ``path`` equals or lies below one of ``roots``, compared by whole path components."""
    return any(path == root or root in path.parents for root in roots)


def _roots(directory: Path) -> tuple[Path, ...]:
    """``directory`` as given (absolute) and with symlinks resolved: a command line may use either."""
    given = Path(os.path.normpath(directory.absolute()))
    return (given, directory.resolve()) if directory.resolve() != given else (given,)


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return path


def _names(argv: list[str], roots: tuple[Path, ...]) -> bool:
    """Whether an argument of ``argv`` (not argv[0]) names a path equal to or below one of ``roots``."""
    return any(_within(p, roots) or _within(_resolved(p), roots) for a in argv[1:] for p in _arg_paths(a))


def find_strays(data_dir: Path, *, proc_root: Path = Path("/proc")) -> list[int]:
    """Pids of the QEMU (or bubblewrap-wrapped QEMU) processes of VMs under ``data_dir``, sorted.

    First the ``qemu.pid`` files of the VM directories under ``data_dir``: a pid counts when its command line
    is QEMU's and names that VM directory (a recycled pid does not). Then every process whose ``argv[0]`` is
    QEMU or ``bwrap`` and one of whose arguments (or a path inside one, as in ``mem-path=/x``) is
    ``data_dir`` or lies below it, compared by whole path components: ``/tmp/pb`` does not own ``/tmp/pbch``.
    ``proc_root`` is where the process table is read (``/proc``; a fake one in tests).
    """
    roots = _roots(data_dir)
    me = os.getpid()
    found: set[int] = set()
    for vm_dir, _dirs, files in os.walk(data_dir) if data_dir.is_dir() else ():
        if "qemu.pid" not in files:
            continue
        try:
            pid = int((Path(vm_dir) / "qemu.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        argv = _cmdline(proc_root, pid)
        if pid != me and _is_vmm(argv) and _names(argv, _roots(Path(vm_dir))) and _alive(proc_root, pid):
            found.add(pid)
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) in found or int(entry.name) == me:
            continue
        pid = int(entry.name)
        argv = _cmdline(proc_root, pid)
        if _is_vmm(argv) and _names(argv, roots) and _alive(proc_root, pid):
            found.add(pid)
    return sorted(found)


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
    roots = _roots(data_dir / "nodes")
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
    points = [p for p in _mount_points() if _within(p, tuple(stores))]
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
