"""The QEMU processes (and the bubblewrap wrapping each) that belong to a directory: a data dir, a node store,
or one VM directory.

QEMU runs in its own session and outlives whoever started it, and a start cut short by a crash may leave it
running before its ``qemu.pid`` was written; so besides the pid files, a process belongs to a directory
when a path in its command line lies below it by whole path components, never by string prefix (several
stacks, or sandboxes, may share a machine: ``/tmp/pb`` does not own ``/tmp/pbch``). Used by the node agent
to clean a VM directory and by the dev stack's ``podbay down --purge``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["vm_processes", "path_roots", "within"]

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


def within(path: Path, roots: tuple[Path, ...]) -> bool:
    """Whether ``path`` equals or lies below one of ``roots``, compared by whole path components."""
    return any(path == root or root in path.parents for root in roots)


def path_roots(directory: Path) -> tuple[Path, ...]:
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
    return any(within(p, roots) or within(_resolved(p), roots) for a in argv[1:] for p in _arg_paths(a))


def vm_processes(data_dir: Path, *, proc_root: Path = Path("/proc"), qemu_only: bool = False) -> list[int]:
    """Pids of the QEMU (or bubblewrap-wrapped QEMU) processes of VMs under ``data_dir``, sorted.

    First the ``qemu.pid`` files of the VM directories under ``data_dir``: a pid counts when its command line
    is QEMU's and names that VM directory (a recycled pid does not). Then every process whose ``argv[0]`` is
    QEMU or ``bwrap`` and one of whose arguments (or a path inside one, as in ``mem-path=/x``) is
    ``data_dir`` or lies below it, compared by whole path components: ``/tmp/pb`` does not own ``/tmp/pbch``.
    ``proc_root`` is where the process table is read (``/proc``; a fake one in tests). ``qemu_only``: leave
    the bubblewrap processes out (one pid per VM, for counting).
    """
    roots = path_roots(data_dir)
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
        if pid != me and _is_vmm(argv) and _names(argv, path_roots(Path(vm_dir))) and _alive(proc_root, pid):
            found.add(pid)
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) in found or int(entry.name) == me:
            continue
        pid = int(entry.name)
        argv = _cmdline(proc_root, pid)
        if _is_vmm(argv) and _names(argv, roots) and _alive(proc_root, pid):
            found.add(pid)
    if qemu_only:
        found = {pid for pid in found if Path((_cmdline(proc_root, pid) or ["?"])[0]).name.startswith("qemu")}
    return sorted(found)
