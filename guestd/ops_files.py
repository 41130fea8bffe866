"""File operations: stat, list, read, write, mkdir, move, remove. Paths must be absolute.

``read`` streams DATA fd 3 chunks (within the host's credit) then RESULT ``{"size"}``; ``list`` streams its
entries as JSON lines in DATA fd 3 chunks then RESULT ``{"count"}``; ``write`` takes DATA fd 3 chunks and
an EOF, writes a temporary file beside the target and renames it into place (``append`` writes in place),
then answers with the file's stat. Every error is an ``OpError`` with a channel code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from typing import Any

from podbay.channel import frames
from podbay.channel.frames import FrameType

from .errors import OpError, from_oserror
from .ops_exec import resolve_user
from .server import Stream

__all__ = ["stat_dict", "op_stat", "op_list", "op_read", "op_write", "op_mkdir", "op_move", "op_remove", "FILE_OPS"]


def _path(args: dict[str, Any], key: str = "path") -> str:
    path = args.get(key)
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise OpError("invalid", f"{key} must be an absolute path")
    return os.path.normpath(path)


def _flag(args: dict[str, Any], key: str, default: bool) -> bool:
    value = args.get(key, default)
    if not isinstance(value, bool):
        raise OpError("invalid", f"{key} must be a boolean")
    return value


def _mode(args: dict[str, Any], default: int) -> int:
    mode = args.get("mode", default)
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise OpError("invalid", "mode must be an integer in 0..0o7777")
    return mode


def _xattrs(path: str, prefix: str) -> dict[str, str]:
    """The extended attributes of ``path`` (not following a symlink) whose names start with ``prefix``;
    {} where the filesystem has none. Values are read as UTF-8 (undecodable bytes replaced)."""
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(OSError):
                out[name] = os.getxattr(path, name, follow_symlinks=False).decode(errors="replace")
    return out


def stat_dict(path: str, st: os.stat_result, xattrs: str | None = None) -> dict[str, Any]:
    """The ``FileStat`` shape for ``path`` from an lstat result; with ``xattrs`` (a name prefix such as
    ``user.``) also the extended attributes whose names start with it."""
    if stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return {
        "path": path,
        "name": os.path.basename(path) or "/",
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "uid": st.st_uid,
        "gid": st.st_gid,
        **({"xattrs": _xattrs(path, xattrs)} if xattrs is not None else {}),
    }


def _lstat(path: str, xattrs: str | None = None) -> dict[str, Any]:
    try:
        return stat_dict(path, os.lstat(path), xattrs)
    except OSError as exc:
        raise from_oserror(exc, path) from exc


def _xattr_prefix(args: dict[str, Any]) -> str | None:
    prefix = args.get("xattrs")
    if prefix is not None and not isinstance(prefix, str):
        raise OpError("invalid", "xattrs must be a name prefix")
    return prefix


def op_stat(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``stat {path, xattrs=null}`` -> FileStat (symlinks not followed; with ``xattrs``, a name prefix, the
    extended attributes whose names start with it)."""
    return _lstat(_path(args), _xattr_prefix(args))


def op_list(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``list {path, xattrs=null}``: one level, sorted by name, as JSON lines in DATA fd 3 (with ``xattrs``
    as for ``stat``); RESULT ``{"count"}``."""
    path = _path(args)
    prefix = _xattr_prefix(args)
    try:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise from_oserror(exc, path) from exc
    batch: list[bytes] = []
    size = count = 0
    for entry in entries:
        try:
            line = json.dumps(stat_dict(entry.path, entry.stat(follow_symlinks=False), prefix)).encode() + b"\n"
        except OSError:
            continue  # vanished while listing
        if size + len(line) > frames.CHUNK_SIZE and batch:
            if not stream.send_data(frames.FD_FILE, b"".join(batch)):
                raise OpError("cancelled", "cancelled")
            batch, size = [], 0
        batch.append(line)
        size += len(line)
        count += 1
    if batch and not stream.send_data(frames.FD_FILE, b"".join(batch)):
        raise OpError("cancelled", "cancelled")
    return {"count": count}


def op_read(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``read {path, offset=0, length=None}``: DATA fd 3 chunks; RESULT ``{"size": bytes sent}``."""
    path = _path(args)
    offset, length = args.get("offset", 0), args.get("length")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise OpError("invalid", "offset must be a non-negative integer")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise OpError("invalid", "length must be a non-negative integer")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise from_oserror(exc, path) from exc
    sent = 0
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise OpError("is_a_directory", f"{path}: is a directory")
        os.set_blocking(fd, True)
        pos = offset
        while length is None or sent < length:
            want = stream.wait_window(frames.CHUNK_SIZE)
            if want == 0:
                raise OpError("cancelled", "cancelled")
            if length is not None:
                want = min(want, length - sent)
            try:
                chunk = os.pread(fd, want, pos) if stat.S_ISREG(st.st_mode) else os.read(fd, want)
            except OSError as exc:
                raise from_oserror(exc, path) from exc
            if not chunk:
                break
            pos += len(chunk)
            sent += len(chunk)
            with stream.cond:
                stream.send_window -= len(chunk)
            stream.send(frames.encode_data(stream.id, frames.FD_FILE, chunk))
    finally:
        os.close(fd)
    return {"size": sent}


def _check_write_target(path: str, st: os.stat_result | None = None) -> None:
    """Refuse to write over anything but a regular file (symlinks followed): a device, FIFO or socket
    would be replaced by the rename (or written to in place by ``append``). A missing path is fine.
    Raises ``OpError`` is_a_directory or invalid."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return  # missing (or unreachable): the open or rename reports it
    if stat.S_ISDIR(st.st_mode):
        raise OpError("is_a_directory", f"{path}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise OpError("invalid", f"not a regular file: {path}")


def op_write(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``write {path, mode=0o644, append=False, user=None, parents=False, xattrs=null}`` then DATA fd 3 ...
    EOF -> FileStat.

    An existing ``path`` must be a regular file or a symlink to one (else ERROR invalid, or
    is_a_directory for a directory). With ``parents`` missing parent directories are made first (as
    ``mkdir``, belonging to ``user`` when given). ``xattrs`` (``{name: value}``, names in the ``user.``
    namespace) are set on the file before it takes its place."""
    path = _path(args)
    xattrs = args.get("xattrs") or {}
    if not isinstance(xattrs, dict) or not all(
            isinstance(k, str) and k.startswith("user.") and isinstance(v, str) for k, v in xattrs.items()):
        raise OpError("invalid", "xattrs must map user.* names to strings")
    mode = _mode(args, 0o644)
    append = _flag(args, "append", False)
    owner = resolve_user(args["user"]) if args.get("user") is not None else None
    _check_write_target(path)
    parent = os.path.dirname(path)
    if _flag(args, "parents", False) and not os.path.isdir(parent):
        op_mkdir(stream, {"path": parent, "user": args.get("user")})
    tmp: str | None = None
    try:
        if append:
            # O_NONBLOCK: a FIFO swapped in after the check must fail (ENXIO), not block this worker.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, mode)
            try:
                _check_write_target(path, os.fstat(fd))
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
        else:
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".podbay-tmp")
            os.fchmod(fd, mode)
    except OSError as exc:
        raise from_oserror(exc, path) from exc
    done = False
    try:
        while True:
            frame = stream.next_frame()
            if frame is None:
                raise OpError("cancelled", "cancelled")
            if frame.type is FrameType.EOF:
                break
            fdnum, data = frames.parse_data(frame.payload)
            if fdnum != frames.FD_FILE:
                raise OpError("invalid", f"write takes DATA on fd 3, not {fdnum}")
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                raise from_oserror(exc, path) from exc
            stream.consumed(len(data))
        try:
            if owner is not None:
                os.fchown(fd, owner[0], owner[1])
            for name, value in xattrs.items():
                os.setxattr(fd, name, value.encode())
            os.fsync(fd)
            os.close(fd)
            fd = -1
            if tmp is not None:
                os.replace(tmp, path)
        except OSError as exc:
            raise from_oserror(exc, path) from exc
        done = True
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None and not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return _lstat(path, "user." if xattrs else None)


def op_mkdir(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``mkdir {path, parents=True, exist_ok=True, mode=0o755, user=None}`` -> FileStat of the directory.
    With ``user`` the directories this call creates belong to that user (and its group)."""
    path = _path(args)
    parents, exist_ok = _flag(args, "parents", True), _flag(args, "exist_ok", True)
    mode = _mode(args, 0o755)
    owner = resolve_user(args["user"]) if args.get("user") is not None else None
    created: list[str] = []
    if owner is not None:
        d = path
        while d != "/" and not os.path.lexists(d):
            created.append(d)
            d = os.path.dirname(d)
    try:
        if parents:
            os.makedirs(path, mode, exist_ok=exist_ok)
        else:
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                if not (exist_ok and os.path.isdir(path)):
                    raise
        if owner is not None:
            for d in created:
                with contextlib.suppress(FileNotFoundError):  # without parents only the leaf was made
                    os.lchown(d, owner[0], owner[1])
    except OSError as exc:
        raise from_oserror(exc, path) from exc
    return _lstat(path)


def op_move(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``move {source, destination}`` -> FileStat of ``destination`` (rename(2): same filesystem only).

    An existing destination file is replaced, as rename does; a non-empty destination directory is
    ``invalid``; a missing source or destination parent ``not_found``."""
    source, destination = _path(args, "source"), _path(args, "destination")
    if source == "/":
        raise OpError("invalid", "refusing to move /")
    try:
        os.rename(source, destination)
    except OSError as exc:
        raise from_oserror(exc, f"{source} -> {destination}") from exc
    return _lstat(destination)


def op_remove(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``remove {path, recursive=False}`` -> ``{"removed": true}``. Refuses ``/``."""
    path = _path(args)
    recursive = _flag(args, "recursive", False)
    if path == "/":
        raise OpError("invalid", "refusing to remove /")
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise from_oserror(exc, path) from exc
    return {"removed": True}


FILE_OPS = {
    "stat": op_stat,
    "list": op_list,
    "read": op_read,
    "write": op_write,
    "mkdir": op_mkdir,
    "move": op_move,
    "remove": op_remove,
}
