"""``podbay.operation_state``: every step of the transition table is allowed, every other pair refused, each
statement is fenced by the states its step leaves, and every write of ``operations`` in services/ and libs/
goes through the module or is on the short allow-list (docs/ARCHITECTURE.md, "Who writes which table")."""

from __future__ import annotations

import re
from itertools import product

import pytest
from test_lifecycle import _sites

from podbay import operation_state
from podbay.contracts.states import OperationState
from podbay.errors import InvalidState
from podbay.operation_state import TRANSITIONS, OperationVerb, next_state

O = OperationState  # noqa: E741

LEGAL: dict[tuple[OperationState, OperationVerb], OperationState] = {
    (O.PENDING, OperationVerb.START): O.RUNNING,
    **{(s, OperationVerb.REQUEUE): O.PENDING for s in (O.PENDING, O.RUNNING, O.FAILED)},
    **{(s, OperationVerb.SUCCEED): O.SUCCEEDED for s in (O.PENDING, O.RUNNING, O.FAILED)},
    **{(s, OperationVerb.FAIL): O.FAILED for s in (O.PENDING, O.RUNNING, O.FAILED)},
}

#: Files that may still write ``operations`` themselves, with how many statements and why. (podbay.lifecycle,
#: which the finder skips, records a sandbox operation's outcome with the sandbox's transition.)
ALLOWED_SITES: dict[str, tuple[int, str]] = {
    "services/api/services/warm.py": (1, "the warm claim's operation, one CTE of the claim's single round trip"),
}

_WRITE = re.compile(r"\b(?:UPDATE\s+operations|INSERT\s+INTO\s+operations|DELETE\s+FROM\s+operations)\b",
                    re.IGNORECASE)


def test_the_table_is_the_legal_steps() -> None:
    assert dict(TRANSITIONS) == LEGAL


@pytest.mark.parametrize(("state", "verb"), list(product(OperationState, OperationVerb)))
def test_every_legal_step_is_allowed_and_every_other_refused(state: OperationState, verb: OperationVerb) -> None:
    if (state, verb) in LEGAL:
        assert next_state(state.value, verb) == LEGAL[(state, verb)]
    else:
        with pytest.raises(InvalidState):
            next_state(state, verb)


def test_a_succeeded_operation_is_final_and_an_unknown_state_refused() -> None:
    assert not [v for (s, v) in TRANSITIONS if s == O.SUCCEEDED]
    with pytest.raises(ValueError):
        next_state("cancelled", OperationVerb.FAIL)


def test_every_statement_is_fenced_by_the_states_its_step_leaves() -> None:
    assert operation_state._START_SQL == "UPDATE operations SET state='running' WHERE id=$1 AND state='pending'"
    for sql in (operation_state._SUCCEED_SQL, operation_state._SUCCEED_DATA_SQL, operation_state._FAIL_SQL):
        assert sql.endswith("WHERE id=$1 AND state IN ('failed', 'pending', 'running')")
    assert operation_state._SUCCEED_SQL.startswith("UPDATE operations SET state='succeeded'")
    assert operation_state._FAIL_SQL.startswith("UPDATE operations SET state='failed'")


def test_only_the_owner_writes_the_operations_table() -> None:
    found = {f: n for f, n in _sites(_WRITE).items() if f != "libs/podbay/operation_state.py"}
    outside = {f: n for f, n in found.items() if f not in ALLOWED_SITES or n > ALLOWED_SITES[f][0]}
    assert not outside, f"write operations through podbay.operation_state, not here: {outside}"
    stale = {f: (n, found.get(f, 0)) for f, (n, _) in ALLOWED_SITES.items() if found.get(f, 0) < n}
    assert not stale, f"allow-list entries with fewer sites than listed (shrink them): {stale}"
