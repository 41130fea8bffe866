"""Volume API bodies (``/v1/volumes``, ``SandboxCreate.volumes``) and the rules of a mount path.

A volume is a named, tenant-scoped ext4 filesystem in a file on one node's btrfs store (docs/ARCHITECTURE.md
"Volumes"). Sizes are bytes. :func:`check_mount_path` is the one place that says which guest paths a volume
may be mounted at; the API calls it and answers 400 ``invalid_volume_path``.
"""

from __future__ import annotations

import posixpath
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["VolumeCreate", "VolumeRestore", "VolumeInfo", "VolumeList", "VolumeMount", "VolumeAttachment", "VolumeSnapshotInfo",
           "VolumeSnapshotList", "check_mount_path",
           "parse_size", "parse_mount", "SYSTEM_DIRS", "VOLUME_NAME_PATTERN", "MIN_VOLUME_BYTES",
           "MAX_VOLUMES_PER_SANDBOX"]

VOLUME_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
#: Smallest volume (an ext4 journal and its metadata need a few MiB).
MIN_VOLUME_BYTES = 16 << 20
#: Volume slots of the machine (services/nodeagent/vm/vmm.py VOLUME_SLOTS).
MAX_VOLUMES_PER_SANDBOX = 4
#: Guest directories a volume may neither be mounted at nor under: the OS and what guestd and the init need.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
               "/sys", "/usr", "/var")


def check_mount_path(path: str) -> str | None:
    """Why ``path`` cannot be a volume's mount path, or None when it can: it must be absolute and normalised
    (no ``.``, ``..``, ``//`` or trailing ``/``), not ``/``, and neither one of :data:`SYSTEM_DIRS` nor under
    one."""
    if not path.startswith("/"):
        return "must be absolute"
    if path == "/":
        return "cannot be / (it would shadow the whole system)"
    if posixpath.normpath(path) != path or "\0" in path:
        return f"must be normalised (e.g. {posixpath.normpath(path)!r})"
    for d in SYSTEM_DIRS:
        if path == d or path.startswith(d + "/"):
            return f"would shadow the system directory {d}"
    return None


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"10GiB"`` -> bytes (units b, k/kb, m/mb, g/gb, t/tb in powers of 1000; kib, mib, gib, tib in powers of
    1024; case-insensitive; a plain number is bytes). Raises ``ValueError``."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"not a size: {text!r} (e.g. 10GiB, 512MiB)")
    try:
        value = float(num)
    except ValueError as exc:
        raise ValueError(f"not a size: {text!r} (e.g. 10GiB, 512MiB)") from exc
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * _UNITS[unit])


def parse_mount(spec: str) -> dict[str, object]:
    """``"data:/mnt/data"`` or ``"data:/mnt/data:ro"`` (``:rw`` too) -> the JSON shape of :class:`VolumeMount`.
    Raises ``ValueError`` for another shape (the model checks the name and path)."""
    parts = spec.split(":")
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        name, path, mode = parts
    elif len(parts) == 2:
        (name, path), mode = parts, "rw"
    else:
        raise ValueError(f"volume {spec!r}: expected NAME:/PATH or NAME:/PATH:ro")
    return {"name": name, "path": path, "readonly": mode == "ro"}


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VolumeCreate(_In):
    """``POST /v1/volumes``."""

    name: str = Field(pattern=VOLUME_NAME_PATTERN, description="Unique among the tenant's volumes.")
    size_bytes: int = Field(ge=MIN_VOLUME_BYTES, description="Capacity in bytes; at most the node's limit "
                            "(PODBAY_VOLUME_MAX_SIZE_GIB). Sparse: it costs what is written.")


class VolumeRestore(_In):
    """``POST /v1/volumes/{name}/restore``: put the volume back to one of its own promoted snapshots."""

    snapshot_id: str = Field(min_length=1, max_length=64, description="An id from ``GET /v1/volumes/{name}/"
                             "snapshots`` whose state is ``promoted``.")


class VolumeMount(_In):
    """One entry of ``SandboxCreate.volumes``: volume ``name`` at ``path`` in the guest."""

    name: str = Field(pattern=VOLUME_NAME_PATTERN)
    path: str = Field(min_length=1, max_length=255, description="Absolute; not at or under a system directory.")
    readonly: bool = Field(False, description="Read-only: any number of sandboxes at once, while no sandbox has "
                           "it read-write. Read-write: one sandbox at a time.")


class VolumeAttachment(BaseModel):
    sandbox_id: str
    path: str
    readonly: bool


class VolumeInfo(BaseModel):
    id: str
    name: str
    size_bytes: int
    node_id: str | None = Field(None, description="The node its file lives on; null until first attached.")
    created_at: datetime
    attachments: list[VolumeAttachment] = Field(default_factory=list,
                                                description="Sandboxes (not deleted) that have it attached.")
    snapshot_at: datetime | None = Field(
        None, description="When the copy in its newest promoted snapshot was taken: what a lost node falls back "
        "to, and what a node without its file fetches. Null until first promoted.")


class VolumeList(BaseModel):
    volumes: list[VolumeInfo]


class VolumeSnapshotInfo(BaseModel):
    """One of a volume's own snapshots, promoted to object storage (docs/ARCHITECTURE.md "Volumes")."""

    id: str
    reason: Literal["cadence", "suspend"] = Field(description="Taken on the promotion period, or by a suspend.")
    state: Literal["promoting", "promoted", "failed"]
    taken_at: datetime
    promoted_at: datetime | None = None
    total_bytes: int | None = Field(None, description="The volume's size as recorded in the snapshot.")
    uploaded_bytes: int | None = Field(None, description="Bytes of chunks sent, uncompressed (chunks the "
                                       "object store already held are not sent again).")
    error: str | None = None
    current: bool = Field(description="The newest promoted copy, the one a fetch uses.")


class VolumeSnapshotList(BaseModel):
    snapshots: list[VolumeSnapshotInfo]
