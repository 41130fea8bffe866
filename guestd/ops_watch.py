"""The ``watch`` operation: report changes under a directory until the host cancels the stream.

Frames: STARTED ``{}`` once the first scan is taken (changes after it are reported), then DATA fd 3 with
JSON lines ``{"name", "type", "stat"}`` (``name`` relative to the watched directory; ``type`` one of
create, write, remove, chmod; ``stat`` the FileStat, null for remove). The stream ends with RESULT
``{"events": n}`` when the watched directory itself goes away, or with ERROR cancelled on CANCEL.

The directory is scanned every ``interval_s`` (lstat of each entry; recursively with ``recursive``): the
standard library has no inotify binding and a scan of a small directory costs well under a millisecond.
A rename shows as remove + create. podbay's own temporary files (``*.podbay-tmp``, written beside a
target and renamed over it) are left out, so an atomic write shows as one create or write of its target.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from podbay.channel import frames
from podbay.channel.frames import FrameType

from .errors import OpError, from_oserror
from .ops_files import stat_dict
from .server import Stream

__all__ = ["op_watch", "scan", "diff", "WATCH_OPS", "MAX_ENTRIES"]

DEFAULT_INTERVAL_S = 0.1
# A watch of a huge tree would keep a worker scanning forever; past this many entries it is refused.
MAX_ENTRIES = 20000
_TMP_SUFFIX = ".podbay-tmp"

Key = tuple[int, int, int, int]


def scan(root: str, recursive: bool) -> dict[str, tuple[Key, os.stat_result]]:
    """``{relative name: ((ino, mtime_ns, size, mode), lstat)}`` of the entries under ``root``.
    Raises ``OpError`` invalid when there are more than MAX_ENTRIES."""
    out: dict[str, tuple[Key, os.stat_result]] = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
                entries = list(it)
        except OSError:
            continue  # vanished (or unreadable) while scanning: its entries count as removed
        for entry in entries:
            if entry.name.endswith(_TMP_SUFFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            out[rel] = ((st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode), st)
            if len(out) > MAX_ENTRIES:
                raise OpError("invalid", f"too many entries to watch (more than {MAX_ENTRIES})")
            if recursive and stat.S_ISDIR(st.st_mode):
                stack.append(rel)
    return out


def diff(old: dict[str, tuple[Key, os.stat_result]], new: dict[str, tuple[Key, os.stat_result]]
         ) -> list[tuple[str, str]]:
    """The events from scan ``old`` to scan ``new``: ``[(name, type)]``, removals first, then by name.

    A new regular file that already has bytes gives create then write (it was created and written); a
    changed inode, size or mtime gives write (an atomic replace changes the inode); a mode change alone
    gives chmod. Directories report create, remove and chmod only (their mtime follows their entries)."""
    events: list[tuple[str, str]] = [(name, "remove") for name in sorted(old.keys() - new.keys())]
    for name in sorted(new):
        key, st = new[name]
        if name not in old:
            events.append((name, "create"))
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                events.append((name, "write"))
            continue
        before = old[name][0]
        if before == key:
            continue
        if not stat.S_ISDIR(st.st_mode) and before[:3] != key[:3]:
            events.append((name, "write"))
        elif before[3] != key[3]:
            events.append((name, "chmod"))
    return events


def op_watch(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``watch {path, recursive=False, interval_s=0.1}``: see the module docstring."""
    path = args.get("path")
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise OpError("invalid", "path must be an absolute path")
    root = os.path.normpath(path)
    recursive = args.get("recursive", False)
    if not isinstance(recursive, bool):
        raise OpError("invalid", "recursive must be a boolean")
    interval = args.get("interval_s", DEFAULT_INTERVAL_S)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.01 <= interval <= 10:
        raise OpError("invalid", "interval_s must be a number in 0.01..10")
    try:
        st = os.stat(root)
    except OSError as exc:
        raise from_oserror(exc, root) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise OpError("not_a_directory", f"{root}: not a directory")
    state = scan(root, recursive)
    stream.send_json(FrameType.STARTED, {})
    count = 0
    while not stream.cancelled.wait(interval):
        if not os.path.isdir(root):
            break
        new = scan(root, recursive)
        lines = []
        for name, kind in diff(state, new):
            entry = new.get(name)
            info = stat_dict(os.path.join(root, name), entry[1]) if entry and kind != "remove" else None
            lines.append(json.dumps({"name": name, "type": kind, "stat": info}).encode() + b"\n")
        state = new
        for i in range(0, len(lines), 256):
            if not stream.send_data(frames.FD_FILE, b"".join(lines[i:i + 256])):
                raise OpError("cancelled", "cancelled")
        count += len(lines)
    if stream.cancelled.is_set():
        raise OpError("cancelled", "cancelled")
    return {"events": count}


WATCH_OPS = {"watch": op_watch}
