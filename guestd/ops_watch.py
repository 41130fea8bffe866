"""The ``watch`` operation: report changes under a directory until the host cancels the stream.

Frames: STARTED ``{}`` once the watch is armed (changes after it are reported), then DATA fd 3 with
JSON lines ``{"name", "type", "stat"}`` (``name`` relative to the watched directory; ``type`` one of
create, write, remove, rename, chmod; ``stat`` the FileStat, null for remove and rename). The stream ends
with RESULT ``{"events": n}`` when the watched directory itself goes away, or with ERROR cancelled on CANCEL.

Changes come from the kernel's inotify (through ctypes on libc: the standard library has no binding), as
envd's fsnotify sees them: a new file is create (then write as bytes arrive), a rename is rename of the old
name paired with create of the new one, a recursive watch follows directories made after it started.
Events are read in batches a few milliseconds apart. Where inotify is not available the directory is
scanned every ``interval_s`` instead (lstat of each entry; a rename then shows as remove + create).
podbay's own temporary files (``*.podbay-tmp``, written beside a target and renamed over it) are left out,
so an atomic write shows as its target's create and write (or write, when it replaced the file).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import stat
import struct
import time
from typing import Any

from podbay.channel import frames
from podbay.channel.frames import FrameType

from .errors import OpError, from_oserror
from .ops_files import stat_dict
from .server import Stream

__all__ = ["op_watch", "scan", "diff", "Inotify", "WATCH_OPS", "MAX_ENTRIES"]

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


# inotify(7)
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_IGNORED, _IN_ISDIR = 0x400, 0x800, 0x8000, 0x40000000
_IN_ONLYDIR, _IN_DONT_FOLLOW = 0x1000000, 0x2000000
_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF
         | _IN_MOVE_SELF | _IN_ONLYDIR | _IN_DONT_FOLLOW)
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len
# Events are read this long after the first of a batch arrives, so a write right after a create is seen
# in the create's stat and a burst costs one read.
_BATCH_S = 0.02
_POLL_S = 0.2  # how often a quiet watch checks for CANCEL


class Inotify:
    """An inotify instance over ``root`` (its subdirectories too with ``recursive``): ``events()`` yields
    ``(name relative to root, type, is_dir)`` in kernel order. Raises OSError when inotify is unavailable."""

    def __init__(self, root: str, recursive: bool) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self.root = root
        self.recursive = recursive
        self.dirs: dict[int, str] = {}  # wd -> directory relative to root ("" for root)
        self.root_gone = False
        self.tmp_cookies: set[int] = set()  # renames of podbay temp files whose target is yet to come
        try:
            self.add_tree("")
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def _watch(self, rel: str) -> None:
        wd = self._add(self.fd, os.fsencode(os.path.join(self.root, rel) if rel else self.root), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if rel:  # vanished, or not a directory any more: nothing to follow
                return
            raise OSError(err, os.strerror(err), self.root)
        self.dirs[wd] = rel
        if len(self.dirs) > MAX_ENTRIES:
            raise OpError("invalid", f"too many directories to watch (more than {MAX_ENTRIES})")

    def add_tree(self, rel: str) -> list[str]:
        """Watch ``rel`` (and, when recursive, the directories below it) -> names found below ``rel``
        while arming (entries made before the watch existed: reported as created)."""
        self._watch(rel)
        found: list[str] = []
        if not self.recursive:
            return found
        stack = [rel]
        while stack:
            d = stack.pop()
            try:
                with os.scandir(os.path.join(self.root, d) if d else self.root) as it:
                    entries = list(it)
            except OSError:
                continue
            for entry in entries:
                name = f"{d}/{entry.name}" if d else entry.name
                found.append(name)
                if entry.is_dir(follow_symlinks=False):
                    self._watch(name)
                    stack.append(name)
        return found if rel else []

    def read(self) -> list[tuple[str, int, int]]:
        """The pending events -> ``[(relative name, mask, cookie)]``; watches of removed directories are
        dropped, and ``root_gone`` is set when the root itself went away."""
        out: list[tuple[str, int, int]] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            off = 0
            while off + _EVENT.size <= len(buf):
                wd, mask, cookie, length = _EVENT.unpack_from(buf, off)
                raw = buf[off + _EVENT.size:off + _EVENT.size + length].split(b"\0", 1)[0]
                off += _EVENT.size + length
                base = self.dirs.get(wd)
                if mask & _IN_IGNORED:
                    self.dirs.pop(wd, None)
                    if base == "":
                        self.root_gone = True
                    continue
                if base is None:
                    continue
                if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF):
                    if base == "":
                        self.root_gone = True
                    continue
                name = os.fsdecode(raw)
                out.append((f"{base}/{name}" if base else name, mask, cookie))


def _inotify_events(ino: Inotify, batch: list[tuple[str, int, int]], known: set[str]
                    ) -> list[tuple[str, str]]:
    """envd's events for a batch of inotify events: ``[(name, type)]``. ``known`` holds the names seen to
    exist (so a temporary file renamed over a known name is a write, over a new one a create)."""
    events: list[tuple[str, str]] = []
    tmp_cookies = ino.tmp_cookies
    for name, mask, cookie in batch:
        is_dir = bool(mask & _IN_ISDIR)
        tmp = name.endswith(_TMP_SUFFIX)
        if mask & _IN_MOVED_FROM:
            if tmp:
                tmp_cookies.add(cookie)
                continue
            known.discard(name)
            events.append((name, "rename"))
        elif mask & _IN_MOVED_TO:
            if tmp:
                continue
            if cookie in tmp_cookies:  # podbay's atomic write landing on its target
                tmp_cookies.discard(cookie)
                events.append((name, "write") if name in known else (name, "create"))
                if name not in known:
                    events.append((name, "write"))
            else:
                events.append((name, "create"))
            known.add(name)
            if is_dir and ino.recursive:
                events += [(n, "create") for n in ino.add_tree(name)]
        elif tmp:
            continue
        elif mask & _IN_CREATE:
            known.add(name)
            events.append((name, "create"))
            if is_dir and ino.recursive:
                events += [(n, "create") for n in ino.add_tree(name)]
        elif mask & _IN_DELETE:
            known.discard(name)
            events.append((name, "remove"))
        elif mask & _IN_MODIFY:
            if not is_dir:
                events.append((name, "write"))
        elif mask & _IN_ATTRIB:
            events.append((name, "chmod"))
    # A burst of writes to one file reads as one write (fsnotify coalesces them the same way).
    out: list[tuple[str, str]] = []
    for ev in events:
        if ev[1] == "write" and out and out[-1] == ev:
            continue
        out.append(ev)
    return out


def _send(stream: Stream, root: str, events: list[tuple[str, str]]) -> int:
    lines = []
    for name, kind in events:
        info = None
        if kind not in ("remove", "rename"):
            full = os.path.join(root, name)
            try:
                info = stat_dict(full, os.lstat(full))
            except OSError:
                info = None
        lines.append(json.dumps({"name": name, "type": kind, "stat": info}).encode() + b"\n")
    for i in range(0, len(lines), 256):
        if not stream.send_data(frames.FD_FILE, b"".join(lines[i:i + 256])):
            raise OpError("cancelled", "cancelled")
    return len(lines)


def _watch_inotify(stream: Stream, ino: Inotify) -> int:
    """Report inotify events until the root goes away (-> the count) or CANCEL (OpError cancelled)."""
    known = set(scan(ino.root, ino.recursive)) if ino.recursive else set(os.listdir(ino.root))
    stream.send_json(FrameType.STARTED, {})
    count = 0
    while not stream.cancelled.is_set():
        ready, _, _ = select.select([ino.fd], [], [], _POLL_S)
        if ready:
            time.sleep(_BATCH_S)
            count += _send(stream, ino.root, _inotify_events(ino, ino.read(), known))
        if ino.root_gone or not os.path.isdir(ino.root):
            return count
    raise OpError("cancelled", "cancelled")


def op_watch(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``watch {path, recursive=False, interval_s=0.1}``: see the module docstring (``interval_s`` only
    matters where inotify is unavailable)."""
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
    try:
        ino = Inotify(root, recursive)
    except OSError:
        ino = None  # no inotify here (or out of watches): scan instead
    if ino is not None:
        try:
            return {"events": _watch_inotify(stream, ino)}
        finally:
            ino.close()
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
