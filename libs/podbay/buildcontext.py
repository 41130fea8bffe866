"""A template build's context: a tar archive of the directory a Dockerfile's COPY/ADD read from.

The API checks an upload with :func:`check_context` before a node starts anything (size, readable tar,
every COPY source present); the builder unpacks it with :func:`unpack_context` (tar's ``data`` filter: no
absolute paths, no ``..``, no devices, no links out of the tree) and keys each COPY step by
:func:`sources_digest`. The SDK and CLI make the archive with :func:`pack_context`.

Errors: :class:`ContextError` (HTTP 400, code ``invalid_context``), :class:`ContextTooLarge` (413,
``context_too_large``), :class:`MissingSource` (400, ``missing_copy_source``, details ``line``, ``source``).
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import stat
import tarfile
from pathlib import Path

from podbay.contracts.templates import BuildSpec, CopyStep
from podbay.errors import InvalidRequest, PodbayError

__all__ = [
    "MAX_CONTEXT_BYTES",
    "ContextError",
    "ContextTooLarge",
    "MissingSource",
    "check_context",
    "unpack_context",
    "sources_digest",
    "pack_context",
]

#: The largest context tarball a build accepts, bytes.
MAX_CONTEXT_BYTES = 256 << 20


class ContextError(InvalidRequest):
    code = "invalid_context"


class ContextTooLarge(PodbayError):
    code = "context_too_large"
    http_status = 413


class MissingSource(InvalidRequest):
    code = "missing_copy_source"


def _members(data: bytes) -> set[str]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            return {posixpath.normpath(m.name.lstrip("./") or ".").lstrip("/") for m in tar.getmembers()}
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ContextError(f"the build context is not a readable tar archive: {exc}") from exc


def check_context(spec: BuildSpec, data: bytes, max_bytes: int = MAX_CONTEXT_BYTES) -> None:
    """Refuse a context over ``max_bytes``, an unreadable archive, or a COPY/ADD source it lacks (a source
    is present when it is a member or a directory above members)."""
    if len(data) > max_bytes:
        raise ContextTooLarge(f"the build context is {len(data)} bytes; the limit is {max_bytes}",
                              details={"limit_bytes": max_bytes, "size_bytes": len(data)})
    names = _members(data) if data else set()
    dirs = {posixpath.dirname(n) for n in names}
    while True:  # every ancestor of a member is a directory of the context
        more = {posixpath.dirname(d) for d in dirs if d} - dirs
        if not more:
            break
        dirs |= more
    for step in spec.steps:
        if not isinstance(step, CopyStep):
            continue
        for src in step.sources:
            if src != "." and src not in names and src not in dirs:
                raise MissingSource(f"Dockerfile line {step.line}: {'ADD' if step.add else 'COPY'} source "
                                    f"{src!r} is not in the build context",
                                    details={"line": step.line, "source": src})


def unpack_context(data: bytes, dest: Path) -> None:
    """Unpack the archive into ``dest`` with tar's ``data`` filter. Raises :class:`ContextError`."""
    dest.mkdir(parents=True, exist_ok=True)
    if not data:
        return
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ContextError(f"cannot unpack the build context: {exc}") from exc


def sources_digest(root: Path, sources: list[str]) -> str:
    """sha256 hex over every file and directory under ``sources`` (paths relative to ``root``): relative
    path, type, permission bits and content, in sorted order; symlinks by their target. What a COPY step's
    cache key holds, so a changed byte or mode rebuilds the step."""
    h = hashlib.sha256()
    for src in sources:
        top = root / src
        h.update(f"src {src}\n".encode())
        paths = [top] if not top.is_dir() or top.is_symlink() else [top, *sorted(top.rglob("*"))]
        for p in paths:
            rel = p.relative_to(root).as_posix()
            st = p.lstat()
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                h.update(f"l {rel} {os.readlink(p)}\n".encode())
            elif stat.S_ISDIR(st.st_mode):
                h.update(f"d {rel} {mode:o}\n".encode())
            elif stat.S_ISREG(st.st_mode):
                fh = hashlib.sha256()
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        fh.update(chunk)
                h.update(f"f {rel} {mode:o} {fh.hexdigest()}\n".encode())
    return h.hexdigest()


def pack_context(directory: Path, *, max_bytes: int = MAX_CONTEXT_BYTES) -> bytes:
    """A gzip tar of ``directory``'s contents (paths relative to it); raises :class:`ContextTooLarge`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for entry in sorted(directory.iterdir()):
            tar.add(entry, arcname=entry.name)
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise ContextTooLarge(f"the build context {directory} is {len(data)} bytes packed; the limit is {max_bytes}",
                              details={"limit_bytes": max_bytes, "size_bytes": len(data)})
    return data
