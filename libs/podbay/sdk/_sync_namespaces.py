"""The blocking client's namespaces: ``client.credentials``, ``client.keys``, ``client.webhooks``,
``client.schedules`` (and ``sandbox.schedules``) and ``client.volumes``.

GENERATED from ``_async_namespaces.py`` by scripts/gen_sync_sdk.py: do not edit; change that module and run
``.venv/bin/python scripts/gen_sync_sdk.py`` (a unit test fails on drift).
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
from podbay.sdk._calls import Caller
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

__all__ = ["Credentials", "Keys", "Webhooks", "Schedules", "BoundSchedules",
           "Volumes"]


class Credentials:
    """``client.credentials``: create, list, get and delete credentials (values are write-only)."""

    def __init__(self, call: Caller) -> None:
        self._call = call

    def create(
        self, name: str, value: str, hosts: Sequence[str], *, path_prefix: str | None = None,
        header: str | None = None, format: str | None = None, expires_at: datetime | None = None,
        rate_limit_per_min: int | None = None, sandboxes: Sequence[str] | None = None,
        templates: Sequence[str] | None = None,
    ) -> CredentialInfo:
        """Store a credential for ``hosts``; the gateway sets ``header: format`` (``{value}`` replaced) on
        matching requests. Returns everything but the value. ``Conflict`` when the name is taken."""
        return self._call(create_credential_call(
            name, value, hosts, path_prefix=path_prefix, header=header, format=format, expires_at=expires_at,
            rate_limit_per_min=rate_limit_per_min, sandboxes=list(sandboxes) if sandboxes is not None else None,
            templates=list(templates) if templates is not None else None))

    def list(self) -> builtins.list[CredentialInfo]:
        """The tenant's credentials."""
        return self._call(list_credentials_call())

    def get(self, name: str) -> CredentialInfo:
        """One credential; ``NotFound`` when missing."""
        return self._call(get_credential_call(name))

    def delete(self, name: str) -> None:
        """Delete a credential (its value is destroyed)."""
        self._call(delete_credential_call(name))


class Keys:
    """``client.keys``: create (the key is returned once), list (prefixes) and revoke API keys."""

    def __init__(self, call: Caller) -> None:
        self._call = call

    def create(self, name: str) -> KeyCreated:
        """A new key of the caller's tenant; ``.key`` is shown this once."""
        return self._call(create_key_call(name))

    def list(self, all: bool = False) -> builtins.list[KeyInfo]:
        """The tenant's keys (revoked ones too with ``all``)."""
        return self._call(list_keys_call(all))

    def revoke(self, key_id: str) -> KeyInfo:
        """Revoke a key; ``Conflict`` when it is the caller's own and the tenant's last."""
        return self._call(revoke_key_call(key_id))


class Webhooks:
    """``client.webhooks``: ``create(url, types=None)`` (the answer's ``secret`` is shown once), ``list()``
    (with delivery state), ``delete(id)``. Verify deliveries with ``podbay.webhooks.verify_signature``."""

    def __init__(self, call: Caller) -> None:
        self._call = call

    def create(self, url: str, types: Sequence[str] | None = None) -> WebhookCreated:
        return self._call(create_webhook_call(url, types))

    def list(self) -> builtins.list[WebhookInfo]:
        return self._call(list_webhooks_call())

    def delete(self, webhook_id: str) -> WebhookInfo:
        return self._call(delete_webhook_call(webhook_id))


class Schedules:
    """``client.schedules``: add, list, get, runs and remove schedules of any of the tenant's sandboxes."""

    def __init__(self, call: Caller) -> None:
        self._call = call

    def add(
        self, sandbox_id: str, *, cron: str | None = None, tz: str = "UTC", at: datetime | None = None,
        command: Sequence[str] | None = None, **options: Any,
    ) -> ScheduleInfo:
        """Add a schedule: ``cron`` (five fields, read in ``tz``) or ``at`` (one time); ``command`` (argv)
        with ``env``, ``cwd``, ``user``, ``timeout_s``, or none to only wake; ``awake_s``, ``overlap``
        (``skip``/``queue``), ``missed`` (``catch_up_once``/``skip``)."""
        return self._call(add_schedule_call(
            sandbox_id, cron=cron, tz=tz, at=at, command=command, **options))

    def list(self, sandbox_id: str) -> builtins.list[ScheduleInfo]:
        """The sandbox's schedules, each with its next fire time and newest run."""
        return self._call(list_schedules_call(sandbox_id))

    def get(self, sandbox_id: str, schedule_id: str) -> ScheduleInfo:
        return self._call(get_schedule_call(sandbox_id, schedule_id))

    def runs(self, sandbox_id: str, schedule_id: str, limit: int = 20) -> builtins.list[ScheduleRunInfo]:
        """The schedule's runs, newest first: times, state, exit code, head and tail of output."""
        return self._call(schedule_runs_call(sandbox_id, schedule_id, limit))

    def remove(self, sandbox_id: str, schedule_id: str) -> None:
        """Remove the schedule and its run history (a run in progress finishes)."""
        self._call(remove_schedule_call(sandbox_id, schedule_id))


class BoundSchedules:
    """``sandbox.schedules``: the same calls for one sandbox (``sb.schedules.add(cron=..., command=[...])``)."""

    def __init__(self, schedules: Schedules, sandbox_id: str) -> None:
        self._s, self._id = schedules, sandbox_id

    def add(self, **kw: Any) -> ScheduleInfo:
        return self._s.add(self._id, **kw)

    def list(self) -> builtins.list[ScheduleInfo]:
        return self._s.list(self._id)

    def get(self, schedule_id: str) -> ScheduleInfo:
        return self._s.get(self._id, schedule_id)

    def runs(self, schedule_id: str, limit: int = 20) -> builtins.list[ScheduleRunInfo]:
        return self._s.runs(self._id, schedule_id, limit)

    def remove(self, schedule_id: str) -> None:
        self._s.remove(self._id, schedule_id)


class Volumes:
    """``client.volumes``: create, list, get and delete the tenant's volumes."""

    def __init__(self, call: Caller) -> None:
        self._call = call

    def create(self, name: str, size: int | str) -> VolumeInfo:
        """Create volume ``name`` of ``size`` (bytes, or ``"10GiB"``)."""
        return self._call(create_volume_call(name, size))

    def list(self) -> builtins.list[VolumeInfo]:
        return self._call(list_volumes_call())

    def get(self, name: str) -> VolumeInfo:
        return self._call(get_volume_call(name))

    def snapshots(self, name: str) -> builtins.list[VolumeSnapshotInfo]:
        """The volume's own snapshots promoted to object storage, newest first."""
        return self._call(volume_snapshots_call(name))

    def restore(self, name: str, snapshot_id: str) -> VolumeInfo:
        """Put the volume back to its snapshot ``snapshot_id`` (from :meth:`snapshots`), refused while a
        sandbox has it attached; the next sandbox that mounts it sees that snapshot's data."""
        return self._call(restore_volume_call(name, snapshot_id))

    def delete(self, name: str) -> None:
        """Delete the volume and its data (refused while a sandbox has it attached)."""
        self._call(delete_volume_call(name))
