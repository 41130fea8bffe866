"""The one writer of the ``schedule_runs`` table: which step takes a schedule's run from which state to which,
and the named statements that take it (docs/schedules.md; the firer is services/api/schedules/).

A run (:class:`~podbay.contracts.schedules.ScheduleRunState`) is born ``queued`` when its schedule fires, or
``skipped`` (already finished) when it overlaps the previous run or was missed (:func:`insert`). A firer
claims a queued run (``running``, :func:`claim`) and finishes it (:func:`finish`) ``succeeded``, ``failed``,
``timed_out``, ``wake_failed`` or, when the process running it died and another put its sandbox back,
``interrupted``. The finished states are final. The states are closed by a CHECK in the schema
(libs/podbay/db/migrations/0013_schedules.sql). :data:`TRANSITIONS` maps ``(state, verb)`` to the next
state; the other statements here record a running run's progress (its owner and heartbeat, the times it
woke and started its command, the sandbox's prior state), not a state change.

Every function takes a connection or a pool (``conn``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

import asyncpg

from podbay.contracts.schedules import ScheduleRunState
from podbay.transitions import Conn, TransitionTable

__all__ = [
    "RunVerb", "TRANSITIONS", "BIRTH_STATES", "FINISHED", "next_state", "insert", "claim", "finish", "heartbeat",
    "take_over_stale", "mark_command_started", "set_prior_state", "mark_awake", "OUTPUT_COLUMNS",
]

R = ScheduleRunState


class RunVerb(StrEnum):
    """What moves a run."""

    CLAIM = "claim"    # a firer takes the queued run up
    FINISH = "finish"  # its outcome (one of FINISHED but skipped)


#: States a run is born in.
BIRTH_STATES: Final = frozenset({R.QUEUED, R.SKIPPED})
#: Final states; ``skipped`` is born finished.
FINISHED: Final = frozenset({R.SUCCEEDED, R.FAILED, R.TIMED_OUT, R.WAKE_FAILED, R.SKIPPED, R.INTERRUPTED})
_OUTCOMES: Final = FINISHED - {R.SKIPPED}

#: ``(state, verb)`` -> the states it may go to (a finish names its outcome); a missing pair is not a step.
TRANSITIONS: Final[Mapping[tuple[ScheduleRunState, RunVerb], frozenset[ScheduleRunState]]] = {
    (R.QUEUED, RunVerb.CLAIM): frozenset({R.RUNNING}),
    (R.RUNNING, RunVerb.FINISH): _OUTCOMES,
}

_TABLE: Final = TransitionTable(TRANSITIONS, states=ScheduleRunState, refusal="a schedule run that is {state} cannot {verb}")

#: The output columns a finish sets (None when the run had no command result).
OUTPUT_COLUMNS: Final = ("exit_code", "stdout_head", "stdout_tail", "stdout_bytes", "stderr_head", "stderr_tail",
                         "stderr_bytes")


def next_state(state: ScheduleRunState | str, verb: RunVerb,
               to: ScheduleRunState | str | None = None) -> ScheduleRunState:
    """The state ``verb`` takes a run in ``state`` to (``to``: the outcome a finish records). Raises
    ``InvalidState`` (409) when it does not apply, ``ValueError`` for an unknown state."""
    return _TABLE.next_state(state, verb, to)


_INSERT_SQL: Final = (
    "INSERT INTO schedule_runs (id, schedule_id, sandbox_id, tenant_id, fire_at, due_at, state, reason,"
    f" finished_at) VALUES ($1,$2,$3,$4,$5,$6,$7,$8, CASE WHEN $7 = '{R.SKIPPED.value}' THEN now() END)"
    " ON CONFLICT (schedule_id, fire_at) DO NOTHING RETURNING id")
_CLAIM_SQL: Final = _TABLE.update_sql(
    "schedule_runs", RunVerb.CLAIM, also="owner=$2, started_at=now(), heartbeat_at=now(),"
    " prior_state=(SELECT state FROM sandboxes WHERE id=sandbox_id)", returning="prior_state")
_FINISH_SQL: Final = _TABLE.update_sql(
    "schedule_runs", RunVerb.FINISH, to="$3", where="id=$1 AND owner=$2", returning="id",
    also="reason=$4, message=$5, finished_at=now(), exit_code=$6, stdout_head=$7, stdout_tail=$8, stdout_bytes=$9,"
    " stderr_head=$10, stderr_tail=$11, stderr_bytes=$12, output_key=$13")
_HEARTBEAT_SQL: Final = (f"UPDATE schedule_runs SET heartbeat_at=now() WHERE id = ANY($1::text[])"
                         f" AND state='{R.RUNNING.value}'")
_TAKE_OVER_SQL: Final = (
    f"UPDATE schedule_runs SET owner=$1, heartbeat_at=now() WHERE state='{R.RUNNING.value}'"
    " AND NOT (id = ANY($3::text[]))"
    " AND (heartbeat_at IS NULL OR heartbeat_at < now() - make_interval(secs => $2)) RETURNING id, sandbox_id")


async def insert(conn: Conn, run_id: str, *, schedule_id: str, sandbox_id: str, tenant_id: str, fire_at: datetime,
                 due_at: datetime, state: ScheduleRunState, reason: str | None) -> str | None:
    """Record the run of ``schedule_id`` fired at ``fire_at`` (due at ``due_at``, jittered), ``queued`` or
    ``skipped`` (``reason``: ``overlap``/``missed``; finished now). Returns its id, or None when that firing
    is recorded already. Raises ``ValueError`` for another state."""
    if state not in BIRTH_STATES:
        raise ValueError(f"a schedule run is born queued or skipped, not {state}")
    inserted: str | None = await conn.fetchval(_INSERT_SQL, run_id, schedule_id, sandbox_id, tenant_id, fire_at,
                                               due_at, ScheduleRunState(state).value, reason)
    return inserted


async def claim(conn: Conn, run_id: str, owner: str) -> str | None:
    """``queued`` -> ``running`` for firer ``owner`` (started and heartbeat now), noting the sandbox's state.
    Returns that prior state, or None when the run was not queued (or its sandbox has no row)."""
    prior: str | None = await conn.fetchval(_CLAIM_SQL, run_id, owner)
    return prior


async def finish(conn: Conn, run_id: str, owner: str, state: ScheduleRunState, *, reason: str | None,
                 message: str | None, output: Mapping[str, Any], output_key: str | None) -> str | None:
    """``running`` (owned by ``owner``) -> ``state``, one of the outcomes, with ``reason`` and ``message``,
    the command's ``output`` (:data:`OUTPUT_COLUMNS`) and where the whole output is stored (``output_key``).
    Returns its id, or None when it was not running for ``owner`` (removed, or another firer took it over).
    Raises ``InvalidState`` for a state a finish does not record."""
    next_state(R.RUNNING, RunVerb.FINISH, state)
    done: str | None = await conn.fetchval(_FINISH_SQL, run_id, owner, ScheduleRunState(state).value, reason,
                                           message, *(output[c] for c in OUTPUT_COLUMNS), output_key)
    return done


async def heartbeat(conn: Conn, run_ids: Sequence[str]) -> None:
    """Renew the heartbeat of these running runs (their firer is alive)."""
    await conn.execute(_HEARTBEAT_SQL, list(run_ids))


async def take_over_stale(conn: Conn, owner: str, stale_after_s: float,
                          exclude: Sequence[str]) -> list[asyncpg.Record]:
    """Make ``owner`` the owner of every running run (but ``exclude``) whose heartbeat is older than
    ``stale_after_s`` seconds: its process died. Returns their rows (``id``, ``sandbox_id``)."""
    rows: list[asyncpg.Record] = await conn.fetch(_TAKE_OVER_SQL, owner, stale_after_s, list(exclude))
    return rows


async def mark_command_started(conn: Conn, run_id: str) -> None:
    """The run's command was sent to the sandbox (``command_started_at`` now)."""
    await conn.execute("UPDATE schedule_runs SET command_started_at=now() WHERE id=$1", run_id)


async def set_prior_state(conn: Conn, run_id: str, prior: str) -> None:
    """The sandbox state the run woke the sandbox from (restored after it)."""
    await conn.execute("UPDATE schedule_runs SET prior_state=$2 WHERE id=$1", run_id, prior)


async def mark_awake(conn: Conn, run_id: str) -> None:
    """The sandbox is awake for the run (``awake_at`` now)."""
    await conn.execute("UPDATE schedule_runs SET awake_at=now() WHERE id=$1", run_id)
