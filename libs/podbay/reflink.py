"""Copies that cost nothing on btrfs: a reflink (``FICLONE``) where the filesystem allows it, else a sparse copy.

Used by the node agent (templates, sandboxes, snapshots) and by snapshot fetch (:mod:`podbay.promotion`).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Literal

__all__ = ["reflink_or_copy"]

_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data extents of ``src`` (SEEK_DATA/SEEK_HOLE), so holes stay holes."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        os.ftruncate(fout.fileno(), size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole remains
                    break
                raise
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            _copy_range(fin.fileno(), fout.fileno(), start, end)
            pos = end


def _copy_range(fin: int, fout: int, start: int, end: int) -> None:
    """Copy bytes [start, end) at the same offsets: ``copy_file_range`` where the kernel allows it (not across
    filesystems of different types), else read and write."""
    off = start
    while off < end:
        try:
            n = os.copy_file_range(fin, fout, end - off, off, off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            break
        if n == 0:
            return
        off += n
    while off < end:
        chunk = os.pread(fin, min(end - off, 1 << 20), off)
        if not chunk:
            return
        os.pwrite(fout, chunk, off)
        off += len(chunk)


def reflink_or_copy(src: Path, dst: Path) -> Literal["reflink", "copy"]:
    """Copy ``src`` to ``dst``: a reflink (``FICLONE``, what ``cp --reflink=always`` does) when the filesystem
    supports it, else a sparse copy. Returns which. Blocking: call it in a thread for large files."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return "reflink"
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY):
                raise
    _sparse_copy(src, dst)
    return "copy"
