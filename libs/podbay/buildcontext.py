"""A template build's context: a tar archive of the directory a Dockerfile's COPY/ADD read from.

The API checks an upload with :func:`check_context` before a node starts anything (size, readable tar,
every COPY source present); the builder unpacks it with :func:`unpack_context` (tar's ``data`` filter: no
absolute paths, no ``..``, no devices, no links out of the tree) and keys each COPY step by
:func:`sources_digest`. The SDK and CLI make the archive with :func:`pack_context`, leaving out what the
context's ``.dockerignore`` excludes, as Docker's CLI does (:class:`DockerIgnore`).

Errors: :class:`ContextError` (HTTP 400, code ``invalid_context``), :class:`ContextTooLarge` (413,
``context_too_large``), :class:`MissingSource` (400, ``missing_copy_source``, details ``line``, ``source``).
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import re
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
    "DockerIgnore",
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
    except tarfile.AbsoluteLinkError as exc:
        raise ContextError(f"cannot unpack the build context: {exc} (leave it out with the context's "
                           ".dockerignore, e.g. a virtualenv's directory)") from exc
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


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """One ``.dockerignore`` pattern as a regular expression over slash-separated relative paths: ``**`` any
    number of path segments, ``*`` and ``?`` within one segment, ``[...]`` a class, ``\\`` an escape (Go's
    ``filepath.Match`` plus ``**``, as Docker's pattern matcher reads them)."""
    out, i = ["^"], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ContextError(f".dockerignore: {pattern!r} has an unclosed '['")
            body = pattern[i + 1:end]
            negate = body.startswith("^")
            inner = (body[1:] if negate else body).replace("\\", "\\\\").replace("[", "\\[")
            out.append("[" + ("^" if negate else "") + inner + "]")
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + "$")


class DockerIgnore:
    """The exclusions of a build context's ``.dockerignore``, read as Docker's CLI reads them (Docker's
    documentation, "Dockerfile reference: .dockerignore file"): one pattern per line, ``#`` comments and blank
    lines skipped, paths relative to the context root (a leading ``/`` is dropped, ``..`` and ``.`` cleaned),
    ``!`` re-includes, the last matching line wins, and a pattern that matches a directory excludes
    everything below it. Raises :class:`ContextError` for a malformed pattern."""

    def __init__(self, text: str) -> None:
        self.patterns: list[tuple[bool, re.Pattern[str]]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            line = posixpath.normpath(line[1:].strip() if exclusion else line).lstrip("/")
            if line in ("", "."):
                continue
            self.patterns.append((exclusion, _pattern_regex(line)))

    @classmethod
    def of(cls, directory: Path) -> DockerIgnore:
        """``directory/.dockerignore``'s rules; none when there is no such file."""
        path = directory / ".dockerignore"
        try:
            return cls(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls("")
        except (OSError, UnicodeDecodeError) as exc:
            raise ContextError(f"cannot read {path}: {exc}") from exc

    @property
    def has_exclusions(self) -> bool:
        """Whether a ``!`` line may re-include something below an excluded directory."""
        return any(exclusion for exclusion, _ in self.patterns)

    def excludes(self, rel: str) -> bool:
        """Whether the slash-separated relative path ``rel`` is left out of the context."""
        parents = rel.split("/")[:-1]
        excluded = False
        for exclusion, regex in self.patterns:
            if exclusion != excluded:
                continue  # an exclusion matters only once excluded, an inclusion only while included
            match = regex.match(rel) is not None or any(
                regex.match("/".join(parents[: i + 1])) for i in range(len(parents)))
            if match:
                excluded = not exclusion
        return excluded


def pack_context(directory: Path, *, max_bytes: int = MAX_CONTEXT_BYTES) -> bytes:
    """A gzip tar of ``directory``'s contents (paths relative to it), without what its ``.dockerignore``
    excludes (:class:`DockerIgnore`); symlinks are stored as links, never followed. Raises
    :class:`ContextTooLarge`, :class:`ContextError` (a malformed ``.dockerignore``)."""
    ignore = DockerIgnore.of(directory)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for top, dirs, files in os.walk(directory):
            rel_top = Path(top).relative_to(directory).as_posix()
            prefix = "" if rel_top == "." else rel_top + "/"
            kept_dirs = []
            for name in sorted(dirs):
                rel = prefix + name
                if ignore.excludes(rel):
                    if ignore.has_exclusions and not os.path.islink(os.path.join(top, name)):
                        kept_dirs.append(name)  # a '!' line may bring back something below it
                    continue
                tar.add(os.path.join(top, name), arcname=rel, recursive=False)
                if not os.path.islink(os.path.join(top, name)):
                    kept_dirs.append(name)
            dirs[:] = kept_dirs
            for name in sorted(files):
                rel = prefix + name
                if not ignore.excludes(rel):
                    tar.add(os.path.join(top, name), arcname=rel, recursive=False)
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise ContextTooLarge(f"the build context {directory} is {len(data)} bytes packed; the limit is {max_bytes}",
                              details={"limit_bytes": max_bytes, "size_bytes": len(data)})
    return data
