"""``podbay.schedule_run_state``: every step of the transition table is allowed, every other pair refused, and
every write of ``schedule_runs`` in services/ and libs/ goes through the module (docs/ARCHITECTURE.md, "Who
writes which table")."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from itertools import product

import pytest
from test_lifecycle import _sites

from podbay import schedule_run_state
from podbay.contracts.schedules import ScheduleRunState
from podbay.errors import InvalidState
from podbay.schedule_run_state import RunVerb, next_state

R = ScheduleRunState
NOW = datetime(2026, 1, 1, tzinfo=UTC)
OUTCOMES = {R.SUCCEEDED, R.FAILED, R.TIMED_OUT, R.WAKE_FAILED, R.INTERRUPTED}
_WRITE = re.compile(r"\b(?:UPDATE\s+schedule_runs|INSERT\s+INTO\s+schedule_runs|DELETE\s+FROM\s+schedule_runs)\b",
                    re.IGNORECASE)


def _legal(state: ScheduleRunState, verb: RunVerb, to: ScheduleRunState) -> bool:
    return (state, verb, to) == (R.QUEUED, RunVerb.CLAIM, R.RUNNING) or (
        state == R.RUNNING and verb == RunVerb.FINISH and to in OUTCOMES)


@pytest.mark.parametrize(("state", "verb", "to"), list(product(ScheduleRunState, RunVerb, ScheduleRunState)))
def test_every_legal_step_is_allowed_and_every_other_refused(state: ScheduleRunState, verb: RunVerb,
                                                            to: ScheduleRunState) -> None:
    if _legal(state, verb, to):
        assert next_state(state.value, verb, to.value) == to
    else:
        with pytest.raises(InvalidState):
            next_state(state, verb, to)


def test_a_claim_names_its_target_and_a_finished_run_is_final() -> None:
    assert next_state(R.QUEUED, RunVerb.CLAIM) == R.RUNNING
    with pytest.raises(InvalidState):
        next_state(R.RUNNING, RunVerb.FINISH)  # a finish names its outcome
    for state in schedule_run_state.FINISHED:
        for verb in RunVerb:
            with pytest.raises(InvalidState):
                next_state(state, verb)
    with pytest.raises(ValueError):
        next_state("paused", RunVerb.CLAIM)


async def test_a_run_is_born_queued_or_skipped_and_finishes_with_an_outcome() -> None:
    with pytest.raises(ValueError):
        await schedule_run_state.insert(None, "run_1", schedule_id="s", sandbox_id="x", tenant_id="t",
                                        fire_at=NOW, due_at=NOW, state=R.RUNNING, reason=None)
    with pytest.raises(InvalidState):
        await schedule_run_state.finish(None, "run_1", "owner", R.SKIPPED, reason=None, message=None, output={},
                                        output_key=None)


def test_the_statements_are_fenced_by_the_states_their_step_leaves() -> None:
    assert "WHERE id=$1 AND state='queued' RETURNING prior_state" in schedule_run_state._CLAIM_SQL
    assert "WHERE id=$1 AND owner=$2 AND state='running' RETURNING id" in schedule_run_state._FINISH_SQL


def test_only_the_owner_writes_the_schedule_runs_table() -> None:
    found = {f: n for f, n in _sites(_WRITE).items() if f != "libs/podbay/schedule_run_state.py"}
    assert not found, f"write schedule_runs through podbay.schedule_run_state, not here: {found}"
