"""File operations confined to one directory tree (a guest's root filesystem being built on the host).

An image's files are hostile: a symlink ``etc -> /etc`` in it must not turn the host's ``/etc/passwd`` into
the file podbay writes. Every operation here resolves its path with ``openat2(2)`` and ``RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS`` (Linux >= 5.6): the kernel treats the tree's top as ``/`` for the whole lookup, so an
absolute symlink, a ``..`` or a symlink chain ends inside the tree, as it would in the guest, and a
``/proc/self/...`` magic link is refused. The last component of a path is never followed by an operation that
changes it (create, remove, chown, chmod, link): it is made or changed relative to its parent directory's
descriptor with ``*at`` calls and ``AT_SYMLINK_NOFOLLOW``/``O_NOFOLLOW``. Reads follow symlinks (inside the
tree) and open regular files only, so a FIFO planted at ``/etc/passwd`` cannot stall the node.

Paths are the guest's (``/etc/passwd``; relative ones are taken from the top); they are normalised lexically
first (``a/../../b`` is ``/b``), so no operation names anything above the tree. Errors are ``OSError`` (for
instance ``ENOENT`` for a missing parent, ``ELOOP`` for a symlink loop, ``EXDEV`` for a magic link).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

__all__ = ["Root", "openat2", "guest_path"]

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall table unification)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    """``openat2(2)``: a new descriptor (close-on-exec) for ``path`` looked up from ``dirfd`` with ``resolve``
    flags. Raises ``OSError`` (``ENOSYS`` on kernels older than 5.6)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    while True:
        fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), os.fsencode(path),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):  # EAGAIN: a concurrent rename raced the lookup; retry
            raise OSError(err, os.strerror(err), path)


def guest_path(path: str) -> str:
    """``path`` as an absolute, normalised guest path: ``a/../../b`` -> ``/b``, ``//x/./y/`` -> ``/x/y``."""
    return posixpath.normpath("/" + path.lstrip("/"))


class Root:
    """A directory tree opened as a root (a context manager closing its descriptor). ``path`` stays open by
    descriptor: renaming it meanwhile does not redirect the operations."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- lookups ---------------------------------------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0) -> int:
        """A descriptor for guest ``path`` (symlinks followed inside the tree unless ``flags`` has
        ``O_NOFOLLOW``); the caller closes it."""
        rel = guest_path(path).lstrip("/") or "."
        return openat2(self.fd, rel, flags, mode)

    def parent(self, path: str) -> tuple[int, str]:
        """``(descriptor of the parent directory, last component)`` of guest ``path``; the caller closes the
        descriptor. Raises ``IsADirectoryError`` for ``/`` (it has no parent)."""
        norm = guest_path(path)
        if norm == "/":
            raise IsADirectoryError(errno.EISDIR, "the root has no parent", path)
        head, name = posixpath.split(norm)
        return self.open(head, os.O_RDONLY | os.O_DIRECTORY), name

    def lstat(self, path: str) -> os.stat_result | None:
        """``lstat`` of guest ``path`` (its last component not followed), None when it does not exist."""
        if guest_path(path) == "/":
            return os.fstat(self.fd)
        try:
            pfd, name = self.parent(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(pfd)

    def stat(self, path: str) -> os.stat_result | None:
        """``stat`` of guest ``path`` following symlinks inside the tree; None when it does not resolve."""
        try:
            fd = self.open(path, os.O_PATH)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                return None
            raise
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def is_dir(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def is_file(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISREG(st.st_mode)

    def read_bytes(self, path: str, limit: int = 16 << 20) -> bytes:
        """The contents of regular file guest ``path`` (symlinks followed inside the tree), at most ``limit``
        bytes. Raises ``OSError`` (``EINVAL`` for anything but a regular file, ``EFBIG`` over the limit)."""
        fd = self.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            if st.st_size > limit:
                raise OSError(errno.EFBIG, f"over {limit} bytes", path)
            chunks, left = [], limit + 1
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            if len(data) > limit:
                raise OSError(errno.EFBIG, f"over {limit} bytes", path)
            return data
        finally:
            os.close(fd)

    # -- changes (the last component never followed) ---------------------------------------------------------

    def remove(self, path: str) -> bool:
        """Remove guest ``path`` (a whole directory tree, or a file or link itself); True when something was
        there. The root itself is never removed."""
        if guest_path(path) == "/":
            raise IsADirectoryError(errno.EISDIR, "the root is not removed", path)
        try:
            pfd, name = self.parent(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            return _remove_at(pfd, name)
        finally:
            os.close(pfd)

    def clear_dir(self, path: str, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Remove every entry of directory guest ``path`` but the names in ``keep`` (an opaque whiteout)."""
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in os.listdir(fd):
                if name not in keep:
                    _remove_at(fd, name)
        finally:
            os.close(fd)

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """Guest directory ``path`` and its missing parents (existing components, or symlinks to directories
        inside the tree, are kept). Raises ``NotADirectoryError`` when a component is something else."""
        cur = "/"
        for part in guest_path(path).strip("/").split("/"):
            if not part:
                continue
            fd = self.open(cur, os.O_RDONLY | os.O_DIRECTORY)
            try:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
            finally:
                os.close(fd)
            cur = posixpath.join(cur, part)
            os.close(self.open(cur, os.O_PATH | os.O_DIRECTORY))  # exists as a directory (or a link to one)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644, uid: int | None = None,
                    gid: int | None = None) -> None:
        """Guest ``path`` replaced by a new regular file holding ``data`` (whatever was there, a symlink
        included, is removed first, never written through)."""
        pfd, name = self.parent(path)
        try:
            _remove_at(pfd, name)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=pfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if uid is not None or gid is not None:
                    os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        finally:
            os.close(pfd)

    def chown(self, path: str, uid: int, gid: int) -> None:
        """``lchown`` of guest ``path`` (a symlink itself, never its target)."""
        if guest_path(path) == "/":
            os.fchown(self.fd, uid, gid)
            return
        pfd, name = self.parent(path)
        try:
            os.chown(name, uid, gid, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)

    def chmod(self, path: str, mode: int) -> None:
        """``chmod`` of guest ``path`` itself; a symlink is left alone (its mode means nothing)."""
        fd = self.open(path, os.O_PATH | os.O_NOFOLLOW)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return
            # An O_PATH descriptor takes no fchmod; its /proc entry names exactly that inode.
            os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)

    def symlink(self, target: str, path: str) -> None:
        """Guest ``path`` replaced by a symlink to ``target`` (any text: it is the guest's to follow)."""
        pfd, name = self.parent(path)
        try:
            _remove_at(pfd, name)
            os.symlink(target, name, dir_fd=pfd)
        finally:
            os.close(pfd)

    def copy_in(self, src: Path, path: str, ignore: Callable[[str, list[str]], Iterable[str]] | None = None) -> None:
        """Host file or tree ``src`` (podbay's own files, trusted) copied to guest ``path``, which is removed
        first and made anew, so nothing of the image's is inside it when the copy writes there. ``ignore``:
        as ``shutil.copytree``'s."""
        self.remove(path)
        head, name = posixpath.split(guest_path(path))
        self.makedirs(head)
        pfd, name = self.parent(path)
        try:
            if src.is_dir():
                os.mkdir(name, 0o755, dir_fd=pfd)
                dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                try:
                    # The directory was just made here and is reached through its descriptor: a fresh tree
                    # of ours, so copying by path beneath it follows nothing of the image's.
                    shutil.copystat(src, f"/proc/self/fd/{dfd}")
                    names = os.listdir(src)
                    skip = set(ignore(str(src), names)) if ignore else set()
                    for entry in names:
                        if entry in skip:
                            continue
                        s, d = src / entry, f"/proc/self/fd/{dfd}/{entry}"
                        if s.is_dir() and not s.is_symlink():
                            shutil.copytree(s, d, symlinks=True, ignore=ignore)
                        elif s.is_symlink():
                            os.symlink(os.readlink(s), d)
                        else:
                            shutil.copy2(s, d)
                finally:
                    os.close(dfd)
            else:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=pfd)
                try:
                    with src.open("rb") as fh, os.fdopen(os.dup(fd), "wb") as out:
                        shutil.copyfileobj(fh, out)
                    os.fchmod(fd, stat.S_IMODE(src.stat().st_mode))
                finally:
                    os.close(fd)
        finally:
            os.close(pfd)


def _remove_at(dirfd: int, name: str) -> bool:
    """Remove ``name`` in directory ``dirfd`` (a directory whole, a symlink itself); True when it was there."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISDIR(st.st_mode):
        # shutil.rmtree with dir_fd walks by descriptors and never follows a symlink (Python >= 3.11).
        shutil.rmtree(name, dir_fd=dirfd)
    else:
        os.unlink(name, dir_fd=dirfd)
    return True
