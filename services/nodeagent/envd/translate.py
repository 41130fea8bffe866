"""Pure translation between the envd protocol and podbay's guest channel: entries, errors, users, events.

No I/O here, so every rule is unit-tested without a VM (tests/unit/test_envd_translate.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import signal
import stat as stat_mod
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from podbay.contracts.channel import FileStat, WatchEvent
from podbay.errors import (
    Conflict,
    GuestError,
    InvalidRequest,
    InvalidState,
    NotFound,
    PodbayError,
    StaleGeneration,
    Timeout,
    Unauthorized,
    Unavailable,
)

from .proto.filesystem import filesystem_pb as fs_pb

# E2B's file metadata: sent as X-Metadata-<key> upload headers, kept as user.e2b.<key> extended attributes.
METADATA_XATTR_PREFIX = "user.e2b."
METADATA_HEADER_PREFIX = "x-metadata-"

__all__ = [
    "DEFAULT_USER",
    "METADATA_XATTR_PREFIX",
    "METADATA_HEADER_PREFIX",
    "file_metadata",
    "metadata_xattrs",
    "validate_metadata",
    "ENV_HEADER",
    "default_env",
    "KNOWN_OWNERS",
    "entry_info",
    "permissions",
    "owner_name",
    "connect_error",
    "http_error_status",
    "user_from_authorization",
    "event_type",
    "filesystem_event",
    "selector",
    "end_status",
]

# The user commands and file operations run as when the caller names none (E2B's default user, which the
# base template has: uid 1000, home /home/user).
DEFAULT_USER = "user"
# Set by the API's envd proxy: the sandbox's default command environment, base64 of a JSON object.
ENV_HEADER = "x-podbay-e2b-env"
# uid -> name in the base template; others are shown as their number (the guest's passwd is not read
# for every listing).
KNOWN_OWNERS = {0: "root", 1000: "user"}

_TYPES = {"file": fs_pb.FileType.FILE, "dir": fs_pb.FileType.DIRECTORY,
          "symlink": fs_pb.FileType.SYMLINK}
_EVENTS = {"create": fs_pb.EventType.CREATE, "write": fs_pb.EventType.WRITE,
           "remove": fs_pb.EventType.REMOVE, "rename": fs_pb.EventType.RENAME, "chmod": fs_pb.EventType.CHMOD}


def owner_name(uid: int) -> str:
    """The name shown for ``uid`` (``KNOWN_OWNERS``, else the number)."""
    return KNOWN_OWNERS.get(uid, str(uid))


def permissions(kind: str, mode: int) -> str:
    """``ls -l`` style permissions, e.g. ``-rw-r--r--`` or ``drwxr-xr-x``, from the type and mode bits."""
    head = {"dir": "d", "symlink": "L"}.get(kind, "-")
    return head + stat_mod.filemode(mode & 0o7777)[1:]


def entry_info(st: FileStat, link: tuple[str, FileStat | None] | None = None) -> fs_pb.EntryInfo:
    """The envd ``EntryInfo`` of a guest ``FileStat`` (type, size in bytes, mode bits, owner, mtime).

    For a symlink, ``link`` is ``(resolved absolute path, FileStat of it or None)``: as envd does, the entry
    then has the target's type and permission bits and ``symlink_target`` set to the resolved path (the
    link's own path when it does not resolve, the type then UNSPECIFIED); size, owner, mtime and the
    ``L...`` permission string stay the link's own, and ``is_symlink`` stays unset: envd's EntryInfo has no such
    field (E2B infra, packages/envd/spec/filesystem/filesystem.proto), and an SDK that reads it would report
    the link as SYMLINK instead of its target's type. Without ``link`` a symlink is reported as SYMLINK
    (``is_symlink`` set), as before resolution."""
    ts = Timestamp()
    seconds = int(st.mtime)
    ts.seconds, ts.nanos = seconds, int(round((st.mtime - seconds) * 1e9)) % 1_000_000_000
    kind, mode, target = _TYPES.get(st.type, fs_pb.FileType.UNSPECIFIED), st.mode, None
    if st.type == "symlink" and link is not None:
        target = link[0]
        kind = _TYPES.get(link[1].type, fs_pb.FileType.UNSPECIFIED) if link[1] is not None else fs_pb.FileType.UNSPECIFIED
        mode = link[1].mode if link[1] is not None else 0
    return fs_pb.EntryInfo(
        name=st.name, type=kind, path=st.path,
        size=st.size, mode=mode, permissions=permissions(st.type, st.mode), owner=owner_name(st.uid),
        group=owner_name(st.gid), modified_time=ts, is_symlink=st.type == "symlink" and target is None,
        metadata=file_metadata(st.xattrs), symlink_target=target,
    )


def file_metadata(xattrs: dict[str, str] | None) -> dict[str, str]:
    """E2B's file metadata from a file's extended attributes: ``user.e2b.<key>`` -> ``<key>``."""
    return {k[len(METADATA_XATTR_PREFIX):]: v for k, v in (xattrs or {}).items()
            if k.startswith(METADATA_XATTR_PREFIX)}


# envd's limits (E2B infra, packages/shared/pkg/filesystem/xattr.go): an xattr name is at most 255 bytes with
# its prefix, and all of a file's metadata (names with the prefix, plus values) fits one 4 KiB ext4 block.
MAX_METADATA_KEY_LEN = 255 - len(METADATA_XATTR_PREFIX)
MAX_METADATA_TOTAL_LEN = 4096


def validate_metadata(xattrs: dict[str, str]) -> None:
    """Check ``user.e2b.<key>`` attributes as envd checks upload metadata: keys non-empty and at most
    MAX_METADATA_KEY_LEN bytes, keys and values printable ASCII (0x20-0x7e), the whole at most
    MAX_METADATA_TOTAL_LEN bytes. Raises ``InvalidRequest`` ``invalid metadata: ...`` (400)."""
    total = 0
    for name, value in xattrs.items():
        key = name[len(METADATA_XATTR_PREFIX):]
        if not key:
            raise InvalidRequest("invalid metadata: metadata key must not be empty")
        if len(key.encode()) > MAX_METADATA_KEY_LEN:
            raise InvalidRequest(f"invalid metadata: metadata key {key!r} exceeds {MAX_METADATA_KEY_LEN} bytes")
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            bad = next(((i, c) for i, c in enumerate(text.encode()) if c < 0x20 or c > 0x7E), None)
            if bad is not None:
                raise InvalidRequest(f"invalid metadata: metadata {label} contains non-printable-ASCII byte "
                                     f"0x{bad[1]:02x} at offset {bad[0]}")
        total += len(name.encode()) + len(value.encode())
    if total > MAX_METADATA_TOTAL_LEN:
        raise InvalidRequest(f"invalid metadata: total metadata size {total} exceeds {MAX_METADATA_TOTAL_LEN} bytes")


def metadata_xattrs(headers: Any) -> dict[str, str]:
    """The ``user.e2b.<key>`` extended attributes an upload asks for with ``X-Metadata-<Key>`` headers (keys
    lowercased, as envd does)."""
    return {METADATA_XATTR_PREFIX + k.lower()[len(METADATA_HEADER_PREFIX):]: v for k, v in headers.items()
            if k.lower().startswith(METADATA_HEADER_PREFIX) and len(k) > len(METADATA_HEADER_PREFIX)}


def event_type(kind: str) -> fs_pb.EventType:
    """The envd event type of a guest watch event type."""
    return _EVENTS.get(kind, fs_pb.EventType.UNSPECIFIED)


def filesystem_event(ev: WatchEvent, include_entry: bool) -> fs_pb.FilesystemEvent:
    """The envd ``FilesystemEvent`` of a guest watch event (``name`` stays relative to the watched dir)."""
    out = fs_pb.FilesystemEvent(name=ev.name, type=event_type(ev.type))
    if include_entry and ev.stat is not None:
        out.entry = entry_info(ev.stat)
    return out


# podbay error class -> Connect code; the first match in order wins (subclasses first).
_CODES: list[tuple[type[PodbayError], Code]] = [
    (NotFound, Code.NOT_FOUND),
    (InvalidState, Code.FAILED_PRECONDITION),
    (StaleGeneration, Code.UNAVAILABLE),
    (Conflict, Code.ALREADY_EXISTS),
    (InvalidRequest, Code.INVALID_ARGUMENT),
    (Unauthorized, Code.UNAUTHENTICATED),
    (Timeout, Code.DEADLINE_EXCEEDED),
    (Unavailable, Code.UNAVAILABLE),
    (GuestError, Code.INTERNAL),
]
# Guest codes that say more than the class: permission_denied is a client error in envd's terms.
_GUEST_CODES = {"permission_denied": Code.PERMISSION_DENIED, "cancelled": Code.CANCELED}


def connect_error(exc: PodbayError) -> ConnectError:
    """The Connect error for a podbay error (NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT, ...)."""
    code = _GUEST_CODES.get(str(exc.details.get("guest_code", "")))
    if code is None:
        code = next((c for cls, c in _CODES if isinstance(exc, cls)), Code.INTERNAL)
    return ConnectError(code, exc.message)


_HTTP = {Code.NOT_FOUND: 404, Code.ALREADY_EXISTS: 409, Code.INVALID_ARGUMENT: 400, Code.UNAUTHENTICATED: 401,
         Code.PERMISSION_DENIED: 403, Code.DEADLINE_EXCEEDED: 504, Code.UNAVAILABLE: 502,
         Code.FAILED_PRECONDITION: 409}


def http_error_status(exc: PodbayError) -> int:
    """The HTTP status envd's plain ``/files`` API answers for ``exc`` (404, 400, 403, 409, 502, 500)."""
    return _HTTP.get(connect_error(exc).code, 500)


def user_from_authorization(value: str | None) -> str | None:
    """The user of an envd ``Authorization: Basic base64("<user>:")`` header, None without one.
    Raises ``InvalidRequest`` for a malformed header."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic":
        raise InvalidRequest("Authorization must be 'Basic base64(<user>:)'")
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest("Authorization is not valid base64") from exc
    return decoded.split(":", 1)[0] or None


def selector(process: Any) -> tuple[int | None, str | None]:
    """``(pid, tag)`` of a ``ProcessSelector``; ``InvalidRequest`` when neither is set."""
    which = getattr(process, "selector", None) if process is not None else None
    if which is None:
        raise InvalidRequest("give the process by pid or tag")
    return (int(which.value), None) if which.field == "pid" else (None, str(which.value))


def end_status(exit_code: int) -> str:
    """envd's status text of an exit: ``exit status N``, or ``signal: killed`` for -9 (strsignal)."""
    if exit_code >= 0:
        return f"exit status {exit_code}"
    try:
        name = signal.strsignal(-exit_code)
    except ValueError:
        name = None
    return f"signal: {(name or str(-exit_code)).lower()}"


def default_env(header: str | None) -> dict[str, str]:
    """The sandbox's default command environment from ``ENV_HEADER`` ({} without one). Raises
    ``InvalidRequest`` when it is not base64 of a JSON object of strings."""
    if not header:
        return {}
    try:
        env = json.loads(base64.b64decode(header, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest("malformed default environment") from exc
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidRequest("malformed default environment")
    return env
