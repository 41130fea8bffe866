"""HTTP bodies of schedules (``/v1/sandboxes/{id}/schedules``): a sandbox that wakes on a cron expression or
at one time, runs a command (or only wakes) and goes back to the state it was in.

Times are UTC ``datetime`` values on the wire (ISO 8601); ``tz`` only says how the cron fields are read.
Output kept in PostgreSQL is the first and last :data:`OUTPUT_KEEP_BYTES` of each stream (UTF-8 text with
invalid bytes replaced); the whole output is in the object store under ``output_key``.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ScheduleCommand", "ScheduleCreate", "ScheduleInfo", "ScheduleList", "ScheduleRunInfo",
           "ScheduleRunList", "ScheduleRunState", "OUTPUT_KEEP_BYTES", "DEFAULT_WAKE_ONLY_AWAKE_S"]

#: Bytes of each stream's head (and tail) a run keeps in PostgreSQL.
OUTPUT_KEEP_BYTES = 64 << 10
#: How long a schedule without a command keeps its sandbox awake when ``awake_s`` is not given, seconds.
DEFAULT_WAKE_ONLY_AWAKE_S = 60


class ScheduleRunState(StrEnum):
    """A run's state; the finished ones are the ``outcome`` label of ``podbay_schedule_runs_total``."""

    QUEUED = "queued"            # recorded, waiting for its (jittered) time or for the run before it
    RUNNING = "running"          # waking, running the command, or putting the sandbox back
    SUCCEEDED = "succeeded"      # the command exited 0 (or there was none)
    FAILED = "failed"            # the command exited non-zero, or could not be started
    TIMED_OUT = "timed_out"      # the command ran past its timeout_s and was killed
    WAKE_FAILED = "wake_failed"  # the sandbox could not be woken (no node, corrupt snapshot, failed restore)
    SKIPPED = "skipped"          # not run: the previous run was still going (overlap) or it was missed
    INTERRUPTED = "interrupted"  # the process running it died; the sandbox was put back by the next one


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScheduleCommand(_In):
    """What a run executes in the guest, as ``POST /exec`` would (argv, no shell)."""

    argv: list[str] = Field(min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, max_length=4096)
    user: str | None = Field(None, max_length=64, description="User name or uid; default root.")
    timeout_s: float = Field(3600.0, gt=0, le=86400, description="The command is killed after this long.")


class ScheduleCreate(_In):
    """``POST /v1/sandboxes/{id}/schedules``: give ``cron`` (with ``tz``) or ``at``, not both.

    Errors (nothing is stored): 400 ``invalid_cron``, ``unknown_time_zone``, ``time_in_past``; 404
    ``not_found`` (no such sandbox of the caller's tenant); 409 ``limit_exceeded`` (the sandbox has
    ``PODBAY_SCHEDULES_PER_SANDBOX_MAX`` schedules); 409 ``invalid_state`` (deleted sandbox); 422 for a
    body of the wrong shape.
    """

    cron: str | None = Field(None, max_length=256, description="Five fields: minute hour day month weekday.")
    tz: str = Field("UTC", max_length=64, description="IANA time zone the cron fields are read in; DST as "
                    "cron does (a time skipped by the change runs once just after it, a repeated one once).")
    at: datetime | None = Field(None, description="One-shot: fire once at this time (with an offset; UTC "
                                "when it has none).")
    command: ScheduleCommand | None = Field(None, description="Run this; none: only wake the sandbox.")
    awake_s: int | None = Field(None, ge=0, le=86400, description="Keep the sandbox awake this long after the "
                                "command (or the wake) before putting it back; default 0 with a command, "
                                f"{DEFAULT_WAKE_ONLY_AWAKE_S} without.")
    overlap: Literal["skip", "queue"] = Field("skip", description="A fire while the previous run still goes: "
                                              "skip it (recorded as skipped) or queue it.")
    missed: Literal["catch_up_once", "skip"] = Field("catch_up_once", description="Fire times passed while "
                                                     "the firer was down: run once, or skip them.")

    @model_validator(mode="after")
    def _one_time(self) -> ScheduleCreate:
        if (self.cron is None) == (self.at is None):
            raise ValueError("give exactly one of cron or at")
        return self


class ScheduleRunInfo(BaseModel):
    """One fire of a schedule (``GET .../schedules/{schedule_id}/runs``)."""

    id: str
    schedule_id: str
    sandbox_id: str
    fire_at: datetime = Field(description="The schedule's time for this run.")
    due_at: datetime = Field(description="fire_at plus this run's jitter.")
    state: ScheduleRunState
    reason: str | None = Field(None, description="skipped: overlap or missed; failures: an error code.")
    message: str | None = None
    prior_state: str | None = Field(None, description="The sandbox's state before the wake, restored after.")
    started_at: datetime | None = None
    awake_at: datetime | None = None
    command_started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_ms: float | None = Field(None, description="started_at to finished_at.")
    exit_code: int | None = None
    stdout_head: str | None = None
    stdout_tail: str | None = Field(None, description="The last 64 KiB when stdout was longer than its head.")
    stderr_head: str | None = None
    stderr_tail: str | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    output_key: str | None = Field(None, description="Object-store prefix of the whole output "
                                   "(``<key>/stdout``, ``<key>/stderr``).")


class ScheduleRunList(BaseModel):
    runs: list[ScheduleRunInfo]


class ScheduleInfo(BaseModel):
    id: str
    sandbox_id: str
    cron: str | None
    tz: str
    at: datetime | None
    command: ScheduleCommand | None
    awake_s: int
    overlap: Literal["skip", "queue"]
    missed: Literal["catch_up_once", "skip"]
    next_fire_at: datetime | None = Field(description="None once a one-shot has fired.")
    created_at: datetime
    last_run: ScheduleRunInfo | None = Field(None, description="The newest run, without its output.")


class ScheduleList(BaseModel):
    schedules: list[ScheduleInfo]
