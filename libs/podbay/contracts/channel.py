"""Guest channel operation payloads: what the host sends in OPEN frames and what guestd answers.

The frame codec is ``podbay.channel.frames``; the protocol is described in docs/channel.md. guestd (standard
library only) builds plain dicts with the same field names; the host validates every guest answer with
these models, because the guest is untrusted (docs/DESIGN.md §4, guest channel).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from podbay.contracts.api import FileInfo

__all__ = [
    "PROTOCOL_VERSION",
    "Op",
    "GuestErrorCode",
    "GuestInfo",
    "PtySize",
    "ExecSpec",
    "KeptProcess",
    "ProcsResult",
    "ExecStarted",
    "ExecExit",
    "FileStat",
    "ReadResult",
    "ListResult",
    "MkdirRequest",
    "RemoveRequest",
    "RemoveResult",
    "MoveRequest",
    "WatchRequest",
    "WatchEvent",
    "GuestNet",
    "GUEST_EXTRA_CA_MAX",
    "AfterRestoreRequest",
    "GuestVolume",
    "AfterRestoreResult",
    "FreezeRequest",
    "FreezeResult",
    "ChannelErrorBody",
]

PROTOCOL_VERSION = 1

#: Longest ``GuestNet.extra_ca_pem`` (characters): it shares one frame (256 KiB) with the rest of after_restore.
GUEST_EXTRA_CA_MAX = 128 * 1024


class Op(StrEnum):
    """Operations a host may open a stream for (the ``op`` of an OPEN payload)."""

    HELLO = "hello"
    PING = "ping"
    EXEC = "exec"
    STAT = "stat"
    LIST = "list"
    READ = "read"
    WRITE = "write"
    MKDIR = "mkdir"
    MOVE = "move"
    REMOVE = "remove"
    WATCH = "watch"
    PROCS = "procs"
    ATTACH = "attach"
    PROC_INPUT = "proc_input"
    PROC_CLOSE_STDIN = "proc_close_stdin"
    PROC_SIGNAL = "proc_signal"
    PROC_RESIZE = "proc_resize"
    AFTER_RESTORE = "after_restore"
    FREEZE = "freeze"
    THAW = "thaw"


class GuestErrorCode(StrEnum):
    """Codes of ERROR frames. The host maps not_found, exists and invalid to NotFound, Conflict and
    InvalidRequest, is_a_directory and not_a_directory to InvalidRequest; every other code becomes
    GuestError."""

    NOT_FOUND = "not_found"
    EXISTS = "exists"
    PERMISSION_DENIED = "permission_denied"
    INVALID = "invalid"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_DIRECTORY = "not_a_directory"
    IO_ERROR = "io_error"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    # Guest answers may gain fields in later guest versions; unknown ones are ignored.
    model_config = ConfigDict(extra="ignore")


class GuestInfo(_Lenient):
    """guestd's answer to HELLO, ``hello`` and ``ping``. ``uptime_s`` is the guest's CLOCK_BOOTTIME in
    seconds; ``boot_id`` is the kernel's random boot id (it survives a snapshot restore)."""

    version: int
    boot_id: str
    uptime_s: float
    pid: int
    hostname: str = ""
    session: str | None = None


class PtySize(_Strict):
    """A terminal's size in characters."""

    cols: int = Field(ge=1, le=10000)
    rows: int = Field(ge=1, le=10000)


class ExecSpec(_Strict):
    """Arguments of ``exec``. Give ``argv`` or ``shell`` (run as ``/bin/sh -c``), not both.

    ``env`` is merged over guestd's defaults (PATH, HOME, LANG) and the env of ``after_restore``;
    ``user`` is a name or a uid (default root); ``timeout_s`` kills the process group when reached;
    ``stdin=True`` means the host streams stdin (DATA fd 0, then EOF), else stdin is /dev/null.
    """

    argv: list[str] | None = Field(None, min_length=1)
    shell: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | int | None = None
    timeout_s: float | None = Field(None, gt=0)
    stdin: bool = False
    keep: bool = Field(False, description="Register the process: it outlives this stream (docs/channel.md).")
    tag: str | None = Field(None, max_length=256, description="A name for a kept process.")
    pty: PtySize | None = Field(None, description="Run a kept process on a pseudo-terminal of this size.")

    @model_validator(mode="after")
    def _one_command(self) -> ExecSpec:
        if (self.argv is None) == (self.shell is None):
            raise ValueError("give exactly one of argv or shell")
        if (self.tag is not None or self.pty is not None) and not self.keep:
            raise ValueError("tag and pty need keep=True")
        return self


class ExecStarted(_Lenient):
    """STARTED payload of ``exec``: the process id in the guest."""

    pid: int


class ExecExit(_Lenient):
    """RESULT payload of ``exec``. ``exit_code`` is negative (-N) when the process was killed by signal N;
    ``timed_out`` says guestd killed it because ``timeout_s`` passed. ``output_truncated`` is set by the
    host (``GuestChannel.run``) when captured output hit its limit; guestd never sends it."""

    exit_code: int
    timed_out: bool = False
    pid: int
    output_truncated: bool = False


class FileStat(FileInfo, _Lenient):
    """A file's metadata (``lstat``: symlinks are not followed). ``mode`` holds the permission bits,
    ``mtime`` is seconds since the epoch, ``size`` bytes."""

    # The API's FileInfo fields first (path, name, type, size, mode, mtime), then owner and xattrs.

    uid: int = 0
    gid: int = 0
    xattrs: dict[str, str] | None = Field(None, description="Extended attributes, when asked for by prefix.")


class ReadResult(_Lenient):
    """RESULT payload of ``read``: ``size`` is the number of bytes sent."""

    size: int


class ListResult(_Lenient):
    """RESULT payload of ``list``; the entries themselves arrive as DATA fd 3 chunks of JSON lines, each
    line a ``FileStat``."""

    count: int


class MkdirRequest(_Strict):
    """Arguments of ``mkdir``."""

    path: str = Field(min_length=1)
    parents: bool = True
    exist_ok: bool = True
    mode: int = Field(0o755, ge=0, le=0o7777)
    user: str | int | None = Field(None, description="Owner of the directories this call creates.")


class RemoveRequest(_Strict):
    """Arguments of ``remove``: ``recursive`` is needed for a non-empty directory."""

    path: str = Field(min_length=1)
    recursive: bool = False


class RemoveResult(_Lenient):
    removed: bool


class GuestNet(_Strict):
    """The guest's network (``after_restore.net``; docs/ARCHITECTURE.md "Sandbox network"): IPv4
    ``address``/``prefix_len`` on the guest's NIC, the default route via ``gateway`` (the tap's host side),
    ``/etc/resolv.conf`` naming ``dns``, and ``ca_cert_pem`` (the sandbox's CA certificate, PEM) installed
    into the guest's trust store as ``/usr/local/share/ca-certificates/podbay-sandbox.crt`` and appended to
    the template's original ``/etc/ssl/certs/ca-certificates.crt`` (replacing an earlier sandbox CA).
    ``extra_ca_pem`` (PEM certificates, the node's ``GUEST_CA_FILE``: a network that inspects TLS) goes to
    ``podbay-extra.crt`` beside it and into the bundle before the sandbox CA; absent, an earlier one is
    removed."""

    address: str = Field(pattern=r"^\d{1,3}(\.\d{1,3}){3}$")
    prefix_len: int = Field(30, ge=8, le=30)
    gateway: str = Field(pattern=r"^\d{1,3}(\.\d{1,3}){3}$")
    dns: list[str] = Field(default_factory=list, max_length=3)
    ca_cert_pem: str | None = Field(None, max_length=16384)
    extra_ca_pem: str | None = Field(None, min_length=1, max_length=GUEST_EXTRA_CA_MAX)


class GuestVolume(_Strict):
    """A volume for guestd to mount (``after_restore.volumes``; guestd/volumes.py): volume slot ``slot``
    (the virtio-blk device with serial ``podbay-vol<slot>``) at ``path``, read-only when ``readonly``."""

    slot: int = Field(ge=0, le=15)
    path: str = Field(min_length=2, max_length=255, pattern=r"^/")
    readonly: bool = False


class AfterRestoreRequest(_Strict):
    """Arguments of ``after_restore``, sent after every restore or fork (there is no vmgenid on microvm,
    docs/DESIGN.md §3): a new hostname, a random seed mixed into (and credited to) the kernel RNG, the wall
    clock in ns since the epoch, env vars added to every later exec (replacing earlier ones), and the
    sandbox's access token, which guestd keeps in ``/run/podbay/access_token`` (mode 0600)."""

    hostname: str | None = Field(None, min_length=1, max_length=64)
    seed_b64: str | None = None
    time_ns: int | None = Field(None, ge=0)
    env: dict[str, str] | None = None
    access_token: str | None = Field(None, min_length=16, max_length=256)
    #: the guest's address, route, resolver and trust store (set when the VM gets its tap)
    net: GuestNet | None = None
    #: volumes to mount (a slot already mounted at its path is left as it is)
    volumes: list[GuestVolume] | None = Field(None, max_length=16)


class AfterRestoreResult(_Lenient):
    hostname: str
    entropy_credited: bool
    #: the CRNG was reseeded from the input pool, so /dev/urandom already differs from the snapshot's
    crng_reseeded: bool = False
    clock_set: bool
    env_keys: list[str] = Field(default_factory=list)
    access_token_set: bool = False
    #: the NIC ``net`` was applied to (None when no ``net`` was sent)
    net_interface: str | None = None
    #: the paths of ``volumes`` that are mounted
    volumes_mounted: list[str] = Field(default_factory=list)


class FreezeRequest(_Strict):
    """Arguments of ``freeze`` and ``thaw``. ``timeout_s`` (freeze only) thaws automatically if no thaw
    arrives in time, so a lost host never leaves the guest frozen."""

    mounts: list[str] = Field(default_factory=lambda: ["/"], min_length=1)
    timeout_s: float = Field(30.0, gt=0, le=600)


class FreezeResult(_Lenient):
    mounts: list[str]


class ChannelErrorBody(_Lenient):
    """Payload of an ERROR frame."""

    code: str
    message: str = ""


class MoveRequest(_Strict):
    """Arguments of ``move``: rename ``source`` to ``destination`` (both absolute, same filesystem)."""

    source: str = Field(min_length=1, max_length=4096)
    destination: str = Field(min_length=1, max_length=4096)


class WatchRequest(_Strict):
    """Arguments of ``watch``: report changes under directory ``path`` every ``interval_s`` seconds."""

    path: str = Field(min_length=1, max_length=4096)
    recursive: bool = False
    interval_s: float = Field(0.1, ge=0.01, le=10)


class WatchEvent(_Lenient):
    """One change seen by ``watch`` (a JSON line in DATA fd 3): ``name`` relative to the watched directory,
    ``stat`` of the entry after the change (None for ``remove`` and ``rename``, which names the old path; the
    new path follows as ``create``)."""

    name: str = Field(max_length=4096)
    type: Literal["create", "write", "remove", "rename", "chmod"]
    stat: FileStat | None = None


class KeptProcess(_Lenient):
    """A running kept process, as ``procs`` lists it: how it was started."""

    pid: int
    tag: str | None = None
    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    pty: PtySize | None = None


class ProcsResult(_Lenient):
    """RESULT of ``procs``."""

    processes: list[KeptProcess]
