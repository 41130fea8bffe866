"""Volumes in the SDK: ``client.volumes.create/list/get/snapshots/restore/delete`` (sync and async), and the
``volumes`` argument of a create (``["data:/mnt/data", "models:/models:ro"]`` or :class:`~podbay.contracts.volumes.VolumeMount`).

A volume is a named ext4 filesystem of the tenant's on one node, mounted into sandboxes at create (read-write
by one at a time, read-only by many); see docs/ARCHITECTURE.md "Volumes". Builders (``*_call``) are shared by
the sync and async clients, like ``podbay.sdk._calls``. Errors: ``InvalidRequest`` (refused locally, or
``volume_too_large``), ``NotFound``, ``Conflict`` (the name is taken), ``VolumeInUse``, ``InvalidState`` (a restore
to a snapshot that is not promoted).
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable
from typing import Any
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
           "volume_snapshots_call", "restore_volume_call", "Volumes", "AsyncVolumes"]

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


class Volumes:
    """``client.volumes``: create, list, get and delete the tenant's volumes."""

    def __init__(self, call: Callable[[Call[Any]], Any]) -> None:
        self._call = call

    def create(self, name: str, size: int | str) -> VolumeInfo:
        """Create volume ``name`` of ``size`` (bytes, or ``"10GiB"``)."""
        return self._call(create_volume_call(name, size))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def list(self) -> builtins.list[VolumeInfo]:
        return self._call(list_volumes_call())  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def get(self, name: str) -> VolumeInfo:
        return self._call(get_volume_call(name))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def snapshots(self, name: str) -> builtins.list[VolumeSnapshotInfo]:
        """The volume's own snapshots promoted to object storage, newest first."""
        return self._call(volume_snapshots_call(name))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def restore(self, name: str, snapshot_id: str) -> VolumeInfo:
        """Put the volume back to its snapshot ``snapshot_id`` (from :meth:`snapshots`), refused while a
        sandbox has it attached; the next sandbox that mounts it sees that snapshot's data."""
        return self._call(restore_volume_call(name, snapshot_id))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def delete(self, name: str) -> None:
        """Delete the volume and its data (refused while a sandbox has it attached)."""
        self._call(delete_volume_call(name))


class AsyncVolumes:
    """``AsyncClient.volumes``: as :class:`Volumes`, awaited."""

    def __init__(self, call: Callable[[Call[Any]], Awaitable[Any]]) -> None:
        self._call = call

    async def create(self, name: str, size: int | str) -> VolumeInfo:
        return await self._call(create_volume_call(name, size))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def list(self) -> builtins.list[VolumeInfo]:
        return await self._call(list_volumes_call())  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def get(self, name: str) -> VolumeInfo:
        return await self._call(get_volume_call(name))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def snapshots(self, name: str) -> builtins.list[VolumeSnapshotInfo]:
        return await self._call(volume_snapshots_call(name))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def restore(self, name: str, snapshot_id: str) -> VolumeInfo:
        return await self._call(restore_volume_call(name, snapshot_id))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def delete(self, name: str) -> None:
        await self._call(delete_volume_call(name))
