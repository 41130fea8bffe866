"""Schedules in the SDK: ``client.schedules.add/list/get/runs/remove`` (sync and async) and
``sandbox.schedules`` bound to one sandbox.

A schedule wakes its sandbox at each fire time (cron with a time zone, or one time), runs a command (or
only wakes it) and puts it back in the state it was in; see docs/sdk.md. Builders (``*_call``) are shared by
the sync and async clients, like ``podbay.sdk._calls``. Bad values are refused locally with
``InvalidRequest`` before any round trip; the server adds ``InvalidCron``, ``UnknownTimeZone``,
``TimeInPast`` and ``LimitExceeded``.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote

from podbay.contracts.schedules import ScheduleCreate, ScheduleInfo, ScheduleList, ScheduleRunInfo, ScheduleRunList
from podbay.sdk._calls import Call, _model, _none, _sandbox_path, _validate, check_id

__all__ = ["add_schedule_call", "list_schedules_call", "get_schedule_call", "schedule_runs_call",
           "remove_schedule_call", "Schedules", "AsyncSchedules", "BoundSchedules", "AsyncBoundSchedules"]


def add_schedule_call(sandbox_id: str, *, cron: str | None = None, tz: str = "UTC", at: datetime | None = None,
                      command: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                      cwd: str | None = None, user: str | None = None, timeout_s: float | None = None,
                      awake_s: int | None = None, overlap: str = "skip",
                      missed: str = "catch_up_once") -> Call[ScheduleInfo]:
    """``POST /v1/sandboxes/{id}/schedules`` -> 201 ``ScheduleInfo``."""
    fields: dict[str, Any] = {"cron": cron, "tz": tz, "at": at, "awake_s": awake_s, "overlap": overlap,
                              "missed": missed}
    if command is not None:
        cmd: dict[str, Any] = {"argv": list(command), "env": dict(env or {}), "cwd": cwd, "user": user}
        if timeout_s is not None:
            cmd["timeout_s"] = timeout_s
        fields["command"] = cmd
    body = _validate(ScheduleCreate, fields, "schedule")
    return Call("POST", _sandbox_path(sandbox_id, "/schedules"), _model(ScheduleInfo),
                json=body.model_dump(mode="json", exclude_none=True))


def list_schedules_call(sandbox_id: str) -> Call[builtins.list[ScheduleInfo]]:
    """``GET /v1/sandboxes/{id}/schedules`` -> the sandbox's schedules with next fire time and last run."""
    return Call("GET", _sandbox_path(sandbox_id, "/schedules"), lambda r: _model(ScheduleList)(r).schedules)


def _one(sandbox_id: str, schedule_id: str, rest: str = "") -> str:
    return _sandbox_path(sandbox_id, f"/schedules/{quote(check_id(schedule_id, 'schedule id'), safe='')}{rest}")


def get_schedule_call(sandbox_id: str, schedule_id: str) -> Call[ScheduleInfo]:
    """``GET /v1/sandboxes/{id}/schedules/{schedule_id}``."""
    return Call("GET", _one(sandbox_id, schedule_id), _model(ScheduleInfo))


def schedule_runs_call(sandbox_id: str, schedule_id: str, limit: int = 20) -> Call[builtins.list[ScheduleRunInfo]]:
    """``GET .../schedules/{schedule_id}/runs`` -> runs, newest first, with the head and tail of output."""
    return Call("GET", _one(sandbox_id, schedule_id, "/runs"), lambda r: _model(ScheduleRunList)(r).runs,
                params={"limit": str(limit)})


def remove_schedule_call(sandbox_id: str, schedule_id: str) -> Call[None]:
    """``DELETE .../schedules/{schedule_id}`` -> 204."""
    return Call("DELETE", _one(sandbox_id, schedule_id), _none)


class Schedules:
    """``client.schedules``: add, list, get, runs and remove schedules of any of the tenant's sandboxes."""

    def __init__(self, call: Callable[[Call[Any]], Any]) -> None:
        self._call = call

    def add(self, sandbox_id: str, *, cron: str | None = None, tz: str = "UTC", at: datetime | None = None,
            command: Sequence[str] | None = None, **options: Any) -> ScheduleInfo:
        """Add a schedule: ``cron`` (five fields, read in ``tz``) or ``at`` (one time); ``command`` (argv)
        with ``env``, ``cwd``, ``user``, ``timeout_s``, or none to only wake; ``awake_s``, ``overlap``
        (``skip``/``queue``), ``missed`` (``catch_up_once``/``skip``)."""
        return self._call(add_schedule_call(  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients
            sandbox_id, cron=cron, tz=tz, at=at, command=command, **options))

    def list(self, sandbox_id: str) -> builtins.list[ScheduleInfo]:
        """The sandbox's schedules, each with its next fire time and newest run."""
        return self._call(list_schedules_call(sandbox_id))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def get(self, sandbox_id: str, schedule_id: str) -> ScheduleInfo:
        return self._call(get_schedule_call(sandbox_id, schedule_id))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def runs(self, sandbox_id: str, schedule_id: str, limit: int = 20) -> builtins.list[ScheduleRunInfo]:
        """The schedule's runs, newest first: times, state, exit code, head and tail of output."""
        return self._call(schedule_runs_call(sandbox_id, schedule_id, limit))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    def remove(self, sandbox_id: str, schedule_id: str) -> None:
        """Remove the schedule and its run history (a run in progress finishes)."""
        self._call(remove_schedule_call(sandbox_id, schedule_id))


class AsyncSchedules:
    """``AsyncClient.schedules``: as :class:`Schedules`, awaited."""

    def __init__(self, call: Callable[[Call[Any]], Awaitable[Any]]) -> None:
        self._call = call

    async def add(self, sandbox_id: str, *, cron: str | None = None, tz: str = "UTC", at: datetime | None = None,
                  command: Sequence[str] | None = None, **options: Any) -> ScheduleInfo:
        return await self._call(add_schedule_call(  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients
            sandbox_id, cron=cron, tz=tz, at=at, command=command, **options))

    async def list(self, sandbox_id: str) -> builtins.list[ScheduleInfo]:
        return await self._call(list_schedules_call(sandbox_id))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def get(self, sandbox_id: str, schedule_id: str) -> ScheduleInfo:
        return await self._call(get_schedule_call(sandbox_id, schedule_id))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def runs(self, sandbox_id: str, schedule_id: str, limit: int = 20) -> builtins.list[ScheduleRunInfo]:
        return await self._call(schedule_runs_call(sandbox_id, schedule_id, limit))  # type: ignore[no-any-return]  # _call returns Any: one helper serves the sync and async clients

    async def remove(self, sandbox_id: str, schedule_id: str) -> None:
        await self._call(remove_schedule_call(sandbox_id, schedule_id))


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


class AsyncBoundSchedules:
    """``AsyncSandbox.schedules``: as :class:`BoundSchedules`, awaited."""

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
