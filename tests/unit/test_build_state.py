"""``podbay.build_state``: every step of the two build tables is allowed, every other pair refused, each
statement is fenced by the states its step leaves, and every write of ``template_builds`` and
``e2b_template_builds`` in services/ and libs/ goes through the module."""

from __future__ import annotations

import re
from itertools import product

import pytest
from test_lifecycle import _sites

from podbay import build_state
from podbay.build_state import (BUILD_TRANSITIONS, E2B_TRANSITIONS, BuildVerb, E2BBuildVerb, next_build_state,
                                next_e2b_state)
from podbay.contracts.states import E2BBuildState
from podbay.contracts.templates import BuildState
from podbay.errors import InvalidState

B, E = BuildState, E2BBuildState

LEGAL_BUILD = {(B.RUNNING, BuildVerb.FINISH, B.SUCCEEDED), (B.RUNNING, BuildVerb.FINISH, B.FAILED)}
LEGAL_E2B = {
    (E.WAITING, E2BBuildVerb.START): E.BUILDING,
    (E.BUILDING, E2BBuildVerb.FINISH): E.READY,
    (E.WAITING, E2BBuildVerb.FAIL): E.ERROR,
    (E.BUILDING, E2BBuildVerb.FAIL): E.ERROR,
}

_WRITE = re.compile(r"\b(?:UPDATE\s+|INSERT\s+INTO\s+|DELETE\s+FROM\s+)(?:e2b_)?template_builds\b", re.IGNORECASE)


def test_the_tables_are_the_legal_steps() -> None:
    assert {(s, v, t) for (s, v), ts in BUILD_TRANSITIONS.items() for t in ts} == LEGAL_BUILD
    assert dict(E2B_TRANSITIONS) == LEGAL_E2B


@pytest.mark.parametrize(("state", "to"), list(product(BuildState, BuildState)))
def test_a_build_ends_once_succeeded_or_failed(state: BuildState, to: BuildState) -> None:
    if (state, BuildVerb.FINISH, to) in LEGAL_BUILD:
        assert next_build_state(state.value, BuildVerb.FINISH, to.value) == to
    else:
        with pytest.raises(InvalidState):
            next_build_state(state, BuildVerb.FINISH, to)


@pytest.mark.parametrize(("state", "verb"), list(product(E2BBuildState, E2BBuildVerb)))
def test_every_legal_e2b_step_is_allowed_and_every_other_refused(state: E2BBuildState, verb: E2BBuildVerb) -> None:
    if (state, verb) in LEGAL_E2B:
        assert next_e2b_state(state.value, verb) == LEGAL_E2B[(state, verb)]
    else:
        with pytest.raises(InvalidState):
            next_e2b_state(state, verb)


def test_an_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError):
        next_build_state("queued", BuildVerb.FINISH, B.FAILED)
    with pytest.raises(ValueError):
        next_e2b_state("done", E2BBuildVerb.FAIL)


def test_every_statement_is_fenced_by_the_states_its_step_leaves() -> None:
    for sql in (build_state._FINISH_BUILD_SQL, build_state._FAIL_BUILD_SQL):
        assert sql.endswith("WHERE id=$1 AND state='running'")
    assert build_state._FAIL_NODE_BUILDS_SQL.endswith("WHERE node_id=$1 AND state='running'")
    assert build_state._INSERT_BUILD_SQL.endswith(",'running')")
    assert build_state._INSERT_E2B_SQL.endswith(", 'waiting')")
    assert build_state._START_E2B_SQL.startswith("UPDATE e2b_template_builds SET state='building'")
    assert build_state._START_E2B_SQL.endswith("WHERE id=$1 AND state='waiting'")
    assert build_state._FINISH_E2B_SQL.endswith("WHERE id=$1 AND state='building'")
    assert build_state._FAIL_E2B_SQL.endswith("WHERE id=$1 AND state IN ('building', 'waiting')")
    assert build_state._FAIL_E2B_BUILDING_SQL.endswith("WHERE id=$1 AND state='building'")


def test_only_the_owner_writes_the_build_tables() -> None:
    found = {f: n for f, n in _sites(_WRITE).items() if f != "libs/podbay/build_state.py"}
    assert not found, f"write template builds through podbay.build_state, not here: {found}"
