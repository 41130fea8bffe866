"""An OCI image's layers applied to a root filesystem on the host, each layer taken as hostile.

The node agent runs as root, so a layer that says ``etc -> /etc`` and then ``etc/passwd`` would, unpacked
naively, rewrite the host's account files. Here every layer is read from its tar stream by podbay itself (no
unpacking tool, nothing of the image ever run) and every member is made through
:class:`~podbay_nodeagent.build.rootfs.Root`: paths are resolved with ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS)`` and the last component is created, linked, chowned, chmodded or removed relative to
its parent's descriptor without following it. Therefore:

- member names are normalised inside the root (``../../x`` and ``/x`` are ``/x`` of the image);
- symlinks are stored as written (their target is the guest's business) and, when later members or podbay's
  own files go through them, resolve inside the root as they would in the guest;
- hard links name a file of the root (``/etc/shadow`` is the image's own), never a directory;
- whiteouts (``.wh.<name>``) and opaque whiteouts (``.wh..wh..opq``) remove entries inside the root only;
- FIFOs are made as FIFOs (harmless: podbay never opens an image's file but regular ones, see ``Root``);
- device nodes (character, block) are refused unless ``UnpackPolicy.allow_device_nodes``: the guest kernel's
  devtmpfs populates ``/dev``, so an image's own device nodes are useless in a guest and dangerous on the host
  that holds the tree;
- setuid/setgid bits (and ``security.capability`` extended attributes) are kept by default: ``sudo``,
  ``ping`` and ``su`` need them inside the guest, which is a VM of its own, and the host never executes an
  image's file. ``UnpackPolicy.allow_setuid = False`` refuses images with any. The tree is built in a
  folder only root may enter (the build's temporary directory, mode 0700), so no host user can run them;
- an image that unpacks to more than ``UnpackPolicy.max_bytes`` of file contents or ``max_members`` members
  (all layers together) is refused before it fills the node's disk.

Layers are tar, gzip, bzip2, xz or zstd streams (the OCI layer media types); the layout is what ``skopeo
copy`` wrote (``index.json``, one manifest, blobs named by sha256 digest, each checked against
``^sha256:[0-9a-f]{64}$`` before it becomes a path). Ownership is applied when the process may (root);
without privileges files keep the caller's.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from podbay.errors import Unprocessable

from .rootfs import Root, _remove_at, guest_path

__all__ = ["UnpackPolicy", "UnsafeImage", "blob_path", "layer_paths", "apply_layer", "unpack_layout"]

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_XATTR = "SCHILY.xattr."


class UnsafeImage(Unprocessable):
    """An image's layer holds what podbay does not unpack: a device node, or a setuid/setgid file or file
    capability where the node's policy refuses them, or a member that cannot be made inside the root (a hard
    link to a directory or to nothing). ``details``: ``from`` (the image), ``member``, ``reason``."""

    code = "unsafe_image"


@dataclass(frozen=True)
class UnpackPolicy:
    """What an image may contain beyond plain files, directories, symlinks, hard links and FIFOs (module
    docstring). Settings: ``oci_allow_device_nodes``, ``oci_allow_setuid``."""

    allow_device_nodes: bool = False
    allow_setuid: bool = True
    #: Bytes of file contents and number of members all layers together may unpack (a decompression bomb
    #: would otherwise fill the node's disk): 64 GiB, a million (images reach a few GiB and 100k files).
    max_bytes: int = 64 << 30
    max_members: int = 1_000_000


@dataclass
class _Budget:
    bytes_left: int
    members_left: int


def blob_path(layout: Path, digest: str) -> Path:
    """The file of blob ``digest`` in OCI layout ``layout``. Raises ``ValueError`` for a digest that is not
    ``sha256:`` and 64 lowercase hex digits (it becomes a path)."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def layer_paths(layout: Path) -> list[Path]:
    """The layer blobs of the layout's first manifest, lowest first. Raises ``ValueError``/``KeyError``/
    ``OSError`` for an unreadable layout."""
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads(blob_path(layout, index["manifests"][0]["digest"]).read_bytes())
    return [blob_path(layout, layer["digest"]) for layer in manifest["layers"]]


def _open_tar(fh: IO[bytes]) -> tarfile.TarFile:
    head = fh.read(4)
    fh.seek(0)
    if head == _ZSTD_MAGIC:
        reader: Any = zstandard.ZstdDecompressor().stream_reader(fh)
        return tarfile.open(fileobj=reader, mode="r|")
    return tarfile.open(fileobj=fh, mode="r|*")


def _refuse(ref: str, member: str, reason: str) -> UnsafeImage:
    return UnsafeImage(f"FROM {ref}: layer member {member!r}: {reason}",
                       details={"from": ref, "member": member, "reason": reason})


def _chown(fd: int | None, dirfd: int, name: str, m: tarfile.TarInfo) -> None:
    try:
        if fd is not None:
            os.fchown(fd, m.uid, m.gid)
        else:
            os.chown(name, m.uid, m.gid, dir_fd=dirfd, follow_symlinks=False)
    except PermissionError:
        pass  # unprivileged (a developer's test run): the files keep the caller's owner


def _finish_fd(fd: int, m: tarfile.TarInfo, xattrs: dict[str, bytes]) -> None:
    """Owner, then mode (a chown clears setuid bits), extended attributes and mtime of an open file or dir."""
    try:
        os.fchown(fd, m.uid, m.gid)
    except PermissionError:
        pass
    os.fchmod(fd, stat.S_IMODE(m.mode))
    for key, value in xattrs.items():
        try:
            os.setxattr(fd, key, value)
        except OSError:
            pass  # a name this file system or kernel does not take (e.g. security.selinux): not needed to boot
    os.utime(fd, (m.mtime, m.mtime))


def _xattrs(m: tarfile.TarInfo) -> dict[str, bytes]:
    return {k[len(_XATTR):]: v.encode("utf-8", "surrogateescape")
            for k, v in m.pax_headers.items() if k.startswith(_XATTR)}


def _check(ref: str, m: tarfile.TarInfo, xattrs: dict[str, bytes], policy: UnpackPolicy) -> None:
    if (m.ischr() or m.isblk()) and not policy.allow_device_nodes:
        raise _refuse(ref, m.name, "device nodes are not unpacked (the guest's devtmpfs provides /dev)")
    if not policy.allow_setuid and (m.mode & (stat.S_ISUID | stat.S_ISGID) or "security.capability" in xattrs):
        raise _refuse(ref, m.name, "setuid/setgid files and file capabilities are refused by this node's policy")


def _make(root: Root, ref: str, path: str, m: tarfile.TarInfo, tar: tarfile.TarFile, xattrs: dict[str, bytes]) -> None:
    """Member ``m`` made at guest ``path`` (its parent exists)."""
    src_fd = -1
    if m.islnk():
        # Opened before anything at ``path`` is removed: a member that links to itself keeps its file.
        src_fd = root.open(guest_path(m.linkname), os.O_PATH | os.O_NOFOLLOW)
        if stat.S_ISDIR(os.fstat(src_fd).st_mode):
            os.close(src_fd)
            raise _refuse(ref, m.name, "a hard link to a directory")
    try:
        pfd, name = root.parent(path)
    except BaseException:
        if src_fd >= 0:
            os.close(src_fd)
        raise
    try:
        old = None
        try:
            old = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        if m.isdir():
            if old is not None and not stat.S_ISDIR(old.st_mode):
                _remove_at(pfd, name)
                old = None
            if old is None:
                os.mkdir(name, 0o700, dir_fd=pfd)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                _finish_fd(fd, m, xattrs)
            finally:
                os.close(fd)
            return
        if m.islnk():
            if old is not None and os.path.samestat(old, os.fstat(src_fd)):
                return
            if old is not None:
                _remove_at(pfd, name)
            os.link(f"/proc/self/fd/{src_fd}", name, dst_dir_fd=pfd, follow_symlinks=True)
            return
        if old is not None:
            _remove_at(pfd, name)
        if m.isreg():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=pfd)
            try:
                data = tar.extractfile(m)
                assert data is not None  # a regular member always has a reader
                while chunk := data.read(1 << 20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                _finish_fd(fd, m, xattrs)
            finally:
                os.close(fd)
        elif m.issym():
            os.symlink(m.linkname, name, dir_fd=pfd)
            _chown(None, pfd, name, m)
            os.utime(name, (m.mtime, m.mtime), dir_fd=pfd, follow_symlinks=False)
        elif m.isfifo() or m.ischr() or m.isblk():
            kind = stat.S_IFIFO if m.isfifo() else stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(name, 0o600 | kind, os.makedev(m.devmajor, m.devminor) if kind != stat.S_IFIFO else 0,
                     dir_fd=pfd)
            _chown(None, pfd, name, m)
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(m.mode))  # never opens the node itself
            finally:
                os.close(fd)
        # other types (GNU volume headers and the like) carry no file
    finally:
        os.close(pfd)
        if src_fd >= 0:
            os.close(src_fd)


def apply_layer(root: Root, fh: IO[bytes], policy: UnpackPolicy, ref: str = "image",
                budget: _Budget | None = None) -> int:
    """Apply one layer (a tar stream, compressed or not, in ``fh``) to ``root``; returns the members applied.
    ``budget``: what the image's earlier layers left of ``policy.max_bytes``/``max_members`` (None: all).
    Raises :class:`UnsafeImage` (module docstring, or over the budget), ``OSError`` (a member that cannot be
    made: a hard link to nothing, a parent that is a file) or ``tarfile.TarError``."""
    left = budget or _Budget(policy.max_bytes, policy.max_members)
    created: set[str] = set()
    n = 0
    with _open_tar(fh) as tar:
        for m in tar:
            left.members_left -= 1
            left.bytes_left -= m.size if m.isreg() else 0
            if left.members_left < 0 or left.bytes_left < 0:
                raise _refuse(ref, m.name, f"the image unpacks to more than {policy.max_bytes} bytes or "
                              f"{policy.max_members} members")
            path = guest_path(m.name)
            head, base = posixpath.split(path)
            if base == _OPAQUE:
                if root.is_dir(head):
                    keep = {posixpath.basename(p) for p in created if posixpath.dirname(p) == head}
                    root.clear_dir(head, keep)
                continue
            if base.startswith(_WHITEOUT):
                target = posixpath.join(head, base[len(_WHITEOUT):])
                if guest_path(target) != "/":
                    root.remove(target)
                continue
            xattrs = _xattrs(m)
            _check(ref, m, xattrs, policy)
            if path == "/":
                if m.isdir():
                    _finish_fd(root.fd, m, xattrs)
                continue
            try:
                _make(root, ref, path, m, tar, xattrs)
            except (FileNotFoundError, NotADirectoryError):
                # A parent the layer does not list (tars usually do): made, then the member once more. Trying
                # first saves walking every parent of every member.
                root.makedirs(head)
                _make(root, ref, path, m, tar, xattrs)
            created.add(path)
            n += 1
    return n


def unpack_layout(layout: Path, rootfs: Path, policy: UnpackPolicy, ref: str = "image") -> None:
    """Make ``rootfs`` (a new directory) and apply every layer of OCI layout ``layout`` to it in order.
    Raises :class:`UnsafeImage`, ``OSError``, ``ValueError``/``KeyError`` (an unreadable layout) or
    ``tarfile.TarError``."""
    layers = layer_paths(layout)
    rootfs.mkdir(mode=0o755)
    budget = _Budget(policy.max_bytes, policy.max_members)
    with Root(rootfs) as root:
        for blob in layers:
            with blob.open("rb") as fh:
                try:
                    apply_layer(root, fh, policy, ref, budget)
                except OSError as exc:
                    if exc.errno == errno.ENOSYS:
                        raise OSError(exc.errno, "openat2 is missing: unpacking images needs Linux >= 5.6") from exc
                    raise
