"""Schedules in the SDK: ``client.schedules.add/list/get/runs/remove`` (sync and async) and
``sandbox.schedules`` bound to one sandbox: the request builders here, the namespaces in
``podbay.sdk._async_namespaces`` (and the generated ``_sync_namespaces``).

A schedule wakes its sandbox at each fire time (cron with a time zone, or one time), runs a command (or
only wakes it) and puts it back in the state it was in; see docs/sdk.md. Builders (``*_call``) are shared by
the sync and async clients, like ``podbay.sdk._calls``. Bad values are refused locally with
``InvalidRequest`` before any round trip; the server adds ``InvalidCron``, ``UnknownTimeZone``,
``TimeInPast`` and ``LimitExceeded``.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote

from podbay.contracts.schedules import ScheduleCreate, ScheduleInfo, ScheduleList, ScheduleRunInfo, ScheduleRunList
from podbay.sdk._calls import Call, _model, _none, _sandbox_path, _validate, check_id

__all__ = ["add_schedule_call", "list_schedules_call", "get_schedule_call", "schedule_runs_call",
           "remove_schedule_call",]


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
