"""Errors of guestd operations: each becomes one ERROR frame ``{"code", "message"}`` on its stream.

Codes (docs/channel.md): not_found, exists, permission_denied, invalid, is_a_directory, not_a_directory,
no_space, io_error, cancelled, internal.
"""

from __future__ import annotations

import errno

__all__ = ["OpError", "from_oserror"]

_ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.ESRCH: "not_found",
    errno.EEXIST: "exists",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EISDIR: "is_a_directory",
    errno.ENOTDIR: "not_a_directory",
    errno.EINVAL: "invalid",
    errno.ENAMETOOLONG: "invalid",
    errno.ENOTEMPTY: "invalid",
    errno.ELOOP: "invalid",
    errno.ENOEXEC: "invalid",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
}


class OpError(Exception):
    """An operation failed with a channel error ``code`` and a human ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def from_oserror(exc: OSError, what: str = "") -> OpError:
    """Map an ``OSError`` to an ``OpError`` by errno (unknown errnos become io_error)."""
    code = _ERRNO_CODES.get(exc.errno or 0, "io_error")
    detail = exc.strerror or str(exc)
    target = what or exc.filename or ""
    return OpError(code, f"{target}: {detail}" if target else detail)
