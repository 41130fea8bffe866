"""The asyncio client's namespaces: ``client.credentials``, ``client.keys``, ``client.webhooks``,
``client.schedules`` (and ``sandbox.schedules``) and ``client.volumes``.

Each method builds its request with the call builders of its module (``_access``, ``_events``,
``_schedules``, ``_volumes``) and sends it through the client's ``_call`` (``AsyncCaller``). This module is
the source of the blocking namespaces too: scripts/gen_sync_sdk.py rewrites it into ``_sync_namespaces.py``,
so docstrings here are written for both. Run ``.venv/bin/python scripts/gen_sync_sdk.py`` after every change
here; a unit test fails on drift.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from podbay.contracts.access import CredentialInfo, KeyCreated, KeyInfo
from podbay.contracts.events import WebhookCreated, WebhookInfo
from podbay.contracts.schedules import ScheduleInfo, ScheduleRunInfo
from podbay.contracts.volumes import VolumeInfo, VolumeSnapshotInfo
from podbay.sdk._access import (
    create_credential_call,
    create_key_call,
    delete_credential_call,
    get_credential_call,
    list_credentials_call,
    list_keys_call,
    revoke_key_call,
)
from podbay.sdk._calls import AsyncCaller
from podbay.sdk._events import create_webhook_call, delete_webhook_call, list_webhooks_call
from podbay.sdk._schedules import (
    add_schedule_call,
    get_schedule_call,
    list_schedules_call,
    remove_schedule_call,
    schedule_runs_call,
)
from podbay.sdk._volumes import (
    create_volume_call,
    delete_volume_call,
    get_volume_call,
    list_volumes_call,
    restore_volume_call,
    volume_snapshots_call,
)

__all__ = ["AsyncCredentials", "AsyncKeys", "AsyncWebhooks", "AsyncSchedules", "AsyncBoundSchedules",
           "AsyncVolumes"]


class AsyncCredentials:
    """``client.credentials``: create, list, get and delete credentials (values are write-only)."""

    def __init__(self, call: AsyncCaller) -> None:
        self._call = call

    async def create(
        self, name: str, value: str, hosts: Sequence[str], *, path_prefix: str | None = None,
        header: str | None = None, format: str | None = None, expires_at: datetime | None = None,
        rate_limit_per_min: int | None = None, sandboxes: Sequence[str] | None = None,
        templates: Sequence[str] | None = None,
    ) -> CredentialInfo:
        """Store a credential for ``hosts``; the gateway sets ``header: format`` (``{value}`` replaced) on
        matching requests. Returns everything but the value. ``Conflict`` when the name is taken."""
        return await self._call(create_credential_call(
            name, value, hosts, path_prefix=path_prefix, header=header, format=format, expires_at=expires_at,
            rate_limit_per_min=rate_limit_per_min, sandboxes=list(sandboxes) if sandboxes is not None else None,
            templates=list(templates) if templates is not None else None))

    async def list(self) -> builtins.list[CredentialInfo]:
        """The tenant's credentials."""
        return await self._call(list_credentials_call())

    async def get(self, name: str) -> CredentialInfo:
        """One credential; ``NotFound`` when missing."""
        return await self._call(get_credential_call(name))

    async def delete(self, name: str) -> None:
        """Delete a credential (its value is destroyed)."""
        await self._call(delete_credential_call(name))


class AsyncKeys:
    """``client.keys``: create (the key is returned once), list (prefixes) and revoke API keys."""

    def __init__(self, call: AsyncCaller) -> None:
        self._call = call

    async def create(self, name: str) -> KeyCreated:
        """A new key of the caller's tenant; ``.key`` is shown this once."""
        return await self._call(create_key_call(name))

    async def list(self, all: bool = False) -> builtins.list[KeyInfo]:
        """The tenant's keys (revoked ones too with ``all``)."""
        return await self._call(list_keys_call(all))

    async def revoke(self, key_id: str) -> KeyInfo:
        """Revoke a key; ``Conflict`` when it is the caller's own and the tenant's last."""
        return await self._call(revoke_key_call(key_id))


class AsyncWebhooks:
    """``client.webhooks``: ``create(url, types=None)`` (the answer's ``secret`` is shown once), ``list()``
    (with delivery state), ``delete(id)``. Verify deliveries with ``podbay.webhooks.verify_signature``."""

    def __init__(self, call: AsyncCaller) -> None:
        self._call = call

    async def create(self, url: str, types: Sequence[str] | None = None) -> WebhookCreated:
        return await self._call(create_webhook_call(url, types))

    async def list(self) -> builtins.list[WebhookInfo]:
        return await self._call(list_webhooks_call())

    async def delete(self, webhook_id: str) -> WebhookInfo:
        return await self._call(delete_webhook_call(webhook_id))


class AsyncSchedules:
    """``client.schedules``: add, list, get, runs and remove schedules of any of the tenant's sandboxes."""

    def __init__(self, call: AsyncCaller) -> None:
        self._call = call

    async def add(
        self, sandbox_id: str, *, cron: str | None = None, tz: str = "UTC", at: datetime | None = None,
        command: Sequence[str] | None = None, **options: Any,
    ) -> ScheduleInfo:
        """Add a schedule: ``cron`` (five fields, read in ``tz``) or ``at`` (one time); ``command`` (argv)
        with ``env``, ``cwd``, ``user``, ``timeout_s``, or none to only wake; ``awake_s``, ``overlap``
        (``skip``/``queue``), ``missed`` (``catch_up_once``/``skip``)."""
        return await self._call(add_schedule_call(
            sandbox_id, cron=cron, tz=tz, at=at, command=command, **options))

    async def list(self, sandbox_id: str) -> builtins.list[ScheduleInfo]:
        """The sandbox's schedules, each with its next fire time and newest run."""
        return await self._call(list_schedules_call(sandbox_id))

    async def get(self, sandbox_id: str, schedule_id: str) -> ScheduleInfo:
        return await self._call(get_schedule_call(sandbox_id, schedule_id))

    async def runs(self, sandbox_id: str, schedule_id: str, limit: int = 20) -> builtins.list[ScheduleRunInfo]:
        """The schedule's runs, newest first: times, state, exit code, head and tail of output."""
        return await self._call(schedule_runs_call(sandbox_id, schedule_id, limit))

    async def remove(self, sandbox_id: str, schedule_id: str) -> None:
        """Remove the schedule and its run history (a run in progress finishes)."""
        await self._call(remove_schedule_call(sandbox_id, schedule_id))


class AsyncBoundSchedules:
    """``sandbox.schedules``: the same calls for one sandbox (``sb.schedules.add(cron=..., command=[...])``)."""

    def __init__(self, schedules: AsyncSchedules, sandbox_id: str) -> None:
        self._s, self._id = schedules, sandbox_id

    async def add(self, **kw: Any) -> ScheduleInfo:
        return await self._s.add(self._id, **kw)

    async def list(self) -> builtins.list[ScheduleInfo]:
        return await self._s.list(self._id)

    async def get(self, schedule_id: str) -> ScheduleInfo:
        return await self._s.get(self._id, schedule_id)

    async def runs(self, schedule_id: str, limit: int = 20) -> builtins.list[ScheduleRunInfo]:
        return await self._s.runs(self._id, schedule_id, limit)

    async def remove(self, schedule_id: str) -> None:
        await self._s.remove(self._id, schedule_id)


class AsyncVolumes:
    """``client.volumes``: create, list, get and delete the tenant's volumes."""

    def __init__(self, call: AsyncCaller) -> None:
        self._call = call

    async def create(self, name: str, size: int | str) -> VolumeInfo:
        """Create volume ``name`` of ``size`` (bytes, or ``"10GiB"``)."""
        return await self._call(create_volume_call(name, size))

    async def list(self) -> builtins.list[VolumeInfo]:
        return await self._call(list_volumes_call())

    async def get(self, name: str) -> VolumeInfo:
        return await self._call(get_volume_call(name))

    async def snapshots(self, name: str) -> builtins.list[VolumeSnapshotInfo]:
        """The volume's own snapshots promoted to object storage, newest first."""
        return await self._call(volume_snapshots_call(name))

    async def restore(self, name: str, snapshot_id: str) -> VolumeInfo:
        """Put the volume back to its snapshot ``snapshot_id`` (from :meth:`snapshots`), refused while a
        sandbox has it attached; the next sandbox that mounts it sees that snapshot's data."""
        return await self._call(restore_volume_call(name, snapshot_id))

    async def delete(self, name: str) -> None:
        """Delete the volume and its data (refused while a sandbox has it attached)."""
        await self._call(delete_volume_call(name))
