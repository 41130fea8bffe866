"""Volumes in the SDK: ``client.volumes.create/list/get/snapshots/restore/delete`` (sync and async), and the
``volumes`` argument of a create (``["data:/mnt/data", "models:/models:ro"]`` or :class:`~podbay.contracts.volumes.VolumeMount`).

The ``client.volumes`` namespace is in ``podbay.sdk._async_namespaces`` (and the generated
``_sync_namespaces``). A volume is a named ext4 filesystem of the tenant's on one node, mounted into sandboxes at create (read-write
by one at a time, read-only by many); see docs/ARCHITECTURE.md. Builders (``*_call``) are shared by
the sync and async clients, like ``podbay.sdk._calls``. Errors: ``InvalidRequest`` (refused locally, or
``volume_too_large``), ``NotFound``, ``Conflict`` (the name is taken), ``VolumeInUse``, ``InvalidState`` (a restore
to a snapshot that is not promoted).
"""

from __future__ import annotations

import builtins
from urllib.parse import quote

from podbay.contracts.volumes import (
    VolumeCreate,
    VolumeInfo,
    VolumeList,
    VolumeRestore,
    VolumeSnapshotInfo,
    VolumeSnapshotList,
    parse_size,
)
from podbay.errors import InvalidRequest
from podbay.sdk._calls import Call, _model, _none, _validate

__all__ = ["create_volume_call", "list_volumes_call", "get_volume_call", "delete_volume_call",
           "volume_snapshots_call", "restore_volume_call",]

def _path(name: str) -> str:
    return f"/v1/volumes/{quote(name, safe='')}"


def create_volume_call(name: str, size: int | str) -> Call[VolumeInfo]:
    """``POST /v1/volumes`` -> 201 ``VolumeInfo``; ``size`` in bytes or as ``"10GiB"``."""
    try:
        size_bytes = parse_size(size) if isinstance(size, str) else int(size)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    body = _validate(VolumeCreate, {"name": name, "size_bytes": size_bytes}, "volume")
    return Call("POST", "/v1/volumes", _model(VolumeInfo), json=body.model_dump(mode="json"))


def list_volumes_call() -> Call[builtins.list[VolumeInfo]]:
    """``GET /v1/volumes`` -> the tenant's volumes with their attachments."""
    return Call("GET", "/v1/volumes", lambda r: _model(VolumeList)(r).volumes)


def get_volume_call(name: str) -> Call[VolumeInfo]:
    """``GET /v1/volumes/{name}``."""
    return Call("GET", _path(name), _model(VolumeInfo))


def volume_snapshots_call(name: str) -> Call[builtins.list[VolumeSnapshotInfo]]:
    """``GET /v1/volumes/{name}/snapshots`` -> the volume's own snapshots, newest first."""
    return Call("GET", _path(name) + "/snapshots", lambda r: _model(VolumeSnapshotList)(r).snapshots)


def restore_volume_call(name: str, snapshot_id: str) -> Call[VolumeInfo]:
    """``POST /v1/volumes/{name}/restore`` {"snapshot_id"} -> ``VolumeInfo``; ``VolumeInUse`` while attached,
    ``NotFound`` for a snapshot that is not the volume's, ``InvalidState`` for one not promoted."""
    body = _validate(VolumeRestore, {"snapshot_id": snapshot_id}, "volume restore")
    return Call("POST", _path(name) + "/restore", _model(VolumeInfo), json=body.model_dump(mode="json"))


def delete_volume_call(name: str) -> Call[None]:
    """``DELETE /v1/volumes/{name}`` -> 204; ``VolumeInUse`` while attached."""
    return Call("DELETE", _path(name), _none)
