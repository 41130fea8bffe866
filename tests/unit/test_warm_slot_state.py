"""``podbay.warm_slot_state``: every step of the transition table is allowed, every other pair refused, each
statement is fenced by the states its step leaves, and every write of ``warm_slots`` in services/ and libs/
goes through the module or is on the short allow-list (docs/ARCHITECTURE.md, "Who writes which table")."""

from __future__ import annotations

import re
from itertools import product

import pytest
from test_lifecycle import _sites

from podbay import warm_slot_state
from podbay.contracts.states import WarmSlotState
from podbay.errors import InvalidState
from podbay.warm_slot_state import TRANSITIONS, WarmSlotVerb, next_state

W = WarmSlotState
UNCLAIMED = (W.PREPARING, W.READY, W.FAILED, W.RETIRED)
LEGAL: dict[tuple[WarmSlotState, WarmSlotVerb], WarmSlotState] = {
    (W.PREPARING, WarmSlotVerb.READY): W.READY,
    (W.READY, WarmSlotVerb.CLAIM): W.CLAIMED,
    **{(s, WarmSlotVerb.FAIL): W.FAILED for s in UNCLAIMED},
    **{(s, WarmSlotVerb.RETIRE): W.RETIRED for s in UNCLAIMED},
}

#: Files that may still write ``warm_slots`` themselves, with how many statements and why.
ALLOWED_SITES: dict[str, tuple[int, str]] = {
    "services/api/services/warm.py": (1, "the claim (ready -> claimed), one CTE of the claim's single round trip"),
}

_WRITE = re.compile(r"\b(?:UPDATE\s+warm_slots|INSERT\s+INTO\s+warm_slots|DELETE\s+FROM\s+warm_slots)\b",
                    re.IGNORECASE)


def test_the_table_is_the_legal_steps() -> None:
    assert dict(TRANSITIONS) == LEGAL


@pytest.mark.parametrize(("state", "verb"), list(product(WarmSlotState, WarmSlotVerb)))
def test_every_legal_step_is_allowed_and_every_other_refused(state: WarmSlotState, verb: WarmSlotVerb) -> None:
    if (state, verb) in LEGAL:
        assert next_state(state.value, verb) == LEGAL[(state, verb)]
    else:
        with pytest.raises(InvalidState):
            next_state(state, verb)


def test_a_claimed_slot_belongs_to_its_sandbox_and_an_unknown_state_is_refused() -> None:
    assert not [v for (s, v) in TRANSITIONS if s == W.CLAIMED]
    with pytest.raises(ValueError):
        next_state("warm", WarmSlotVerb.READY)


def test_every_statement_is_fenced_by_the_states_its_step_leaves() -> None:
    assert warm_slot_state._READY_SQL.endswith("WHERE id=$1 AND state='preparing'")
    assert warm_slot_state._END_SQL.endswith("WHERE id=$1 AND state <> 'claimed'")
    assert warm_slot_state._LOST_SQL.endswith("AND state IN ('preparing', 'ready')")
    assert warm_slot_state.INSERT_SQL.endswith("VALUES ($1,$2,$3,$4,$5,$6,'preparing')")


async def test_a_slot_ends_failed_or_retired_only() -> None:
    with pytest.raises(ValueError):
        await warm_slot_state.end(None, "sbx_1", "why", state=W.READY)


def test_only_the_owner_writes_the_warm_slots_table() -> None:
    found = {f: n for f, n in _sites(_WRITE).items() if f != "libs/podbay/warm_slot_state.py"}
    outside = {f: n for f, n in found.items() if f not in ALLOWED_SITES or n > ALLOWED_SITES[f][0]}
    assert not outside, f"write warm_slots through podbay.warm_slot_state, not here: {outside}"
    stale = {f: (n, found.get(f, 0)) for f, (n, _) in ALLOWED_SITES.items() if found.get(f, 0) < n}
    assert not stale, f"allow-list entries with fewer sites than listed (shrink them): {stale}"
