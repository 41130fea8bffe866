"""Writing a whole file so that a reader never sees it half written: a temp file beside it, renamed over it."""

from __future__ import annotations

import os

__all__ = ["write_atomic"]


def write_atomic(path: str, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data``, mode exactly ``mode`` (whatever the umask or the old file's mode).
    Raises ``OSError``; a failed write leaves the old file as it was (and may leave the temp file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)
