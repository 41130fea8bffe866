"""``podbay.volume_state``: every step of the transition table is allowed, every other pair refused, each
statement is fenced by the states its step leaves, and every write of ``volumes`` in services/ and libs/ goes
through the module."""

from __future__ import annotations

import re
from itertools import product

import pytest
from test_lifecycle import _sites

from podbay import volume_state
from podbay.contracts.states import VolumeState
from podbay.errors import InvalidState
from podbay.volume_state import TRANSITIONS, VolumeVerb, next_state

V = VolumeState

LEGAL = {(V.AVAILABLE, VolumeVerb.DELETE): V.DELETING, (V.VIEW, VolumeVerb.DELETE): V.DELETING}

_WRITE = re.compile(r"\b(?:UPDATE\s+volumes|INSERT\s+INTO\s+volumes|DELETE\s+FROM\s+volumes)\b", re.IGNORECASE)
# ``SET state=`` or ``SET a=$2, state=``: the state column among the SET clause's (not a subquery's WHERE).
_STATE_WRITE = re.compile(r"\bUPDATE\s+volumes(?:\s+\w+)?\s+SET\s+(?:\w+\s*=\s*[^,()]+,\s*)*state\s*=",
                          re.IGNORECASE)


def test_the_table_is_the_legal_steps() -> None:
    assert dict(TRANSITIONS) == LEGAL


@pytest.mark.parametrize(("state", "verb"), list(product(VolumeState, VolumeVerb)))
def test_every_legal_step_is_allowed_and_every_other_refused(state: VolumeState, verb: VolumeVerb) -> None:
    if (state, verb) in LEGAL:
        assert next_state(state.value, verb) == LEGAL[(state, verb)]
    else:
        with pytest.raises(InvalidState):
            next_state(state, verb)
    with pytest.raises(ValueError):
        next_state("archived", verb)


def test_every_statement_is_fenced_by_the_states_its_step_leaves() -> None:
    assert volume_state._DELETE_SQL == (
        "UPDATE volumes SET state='deleting' WHERE id=$1 AND state IN ('available', 'view')")
    assert "v.state = 'view' AND s.state = 'deleted'" in volume_state._VIEWS_SQL
    assert volume_state._REMOVE_DELETED_SQL.endswith("state = 'deleting'")


def test_only_the_owner_writes_the_volumes_table() -> None:
    found = {f: n for f, n in _sites(_WRITE).items() if f != "libs/podbay/volume_state.py"}
    assert not found, f"write volumes through podbay.volume_state, not here: {found}"
    state_writes = {f: n for f, n in _sites(_STATE_WRITE).items() if f != "libs/podbay/volume_state.py"}
    assert not state_writes, f"only podbay.volume_state sets a volume's state: {state_writes}"
