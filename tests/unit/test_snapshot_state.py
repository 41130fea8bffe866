"""``podbay.snapshot_state``: every step of the transition tables is allowed, every other pair refused, each
statement is fenced by the states its step leaves, and every write of ``snapshots`` in services/ and libs/ goes
through the module (docs/ARCHITECTURE.md, "Who writes which table")."""

from __future__ import annotations

import re
from itertools import product

import pytest
from test_lifecycle import _sites

from podbay import snapshot_state
from podbay.contracts.states import PromotionState, SnapshotState
from podbay.errors import InvalidState
from podbay.snapshot_state import (PROMOTION_TRANSITIONS, TRANSITIONS, PromotionVerb, SnapshotVerb, next_promotion,
                                   next_state)

S, P = SnapshotState, PromotionState

LEGAL: dict[tuple[SnapshotState, SnapshotVerb], SnapshotState] = {
    (S.CREATING, SnapshotVerb.READY): S.READY,
    (S.CREATING, SnapshotVerb.FAIL): S.FAILED,
    (S.CREATING, SnapshotVerb.DELETE): S.DELETED,
    (S.READY, SnapshotVerb.DELETE): S.DELETED,
    (S.FAILED, SnapshotVerb.DELETE): S.DELETED,
}
LEGAL_PROMOTION: dict[tuple[PromotionState, PromotionVerb], PromotionState] = {
    (P.LOCAL, PromotionVerb.START): P.PROMOTING,
    (P.PROMOTING, PromotionVerb.START): P.PROMOTING,  # an interrupted upload starts again
    (P.FAILED, PromotionVerb.START): P.PROMOTING,
    (P.PROMOTING, PromotionVerb.PROMOTED): P.PROMOTED,
    (P.LOCAL, PromotionVerb.FAIL): P.FAILED,
    (P.PROMOTING, PromotionVerb.FAIL): P.FAILED,
    (P.FAILED, PromotionVerb.FAIL): P.FAILED,
}

_WRITE = re.compile(r"\b(?:UPDATE\s+snapshots|INSERT\s+INTO\s+snapshots|DELETE\s+FROM\s+snapshots)\b", re.IGNORECASE)


def test_the_tables_are_the_legal_steps() -> None:
    assert dict(TRANSITIONS) == LEGAL
    assert dict(PROMOTION_TRANSITIONS) == LEGAL_PROMOTION


@pytest.mark.parametrize(("state", "verb"), list(product(SnapshotState, SnapshotVerb)))
def test_every_legal_step_is_allowed_and_every_other_refused(state: SnapshotState, verb: SnapshotVerb) -> None:
    if (state, verb) in LEGAL:
        assert next_state(state.value, verb) == LEGAL[(state, verb)]
    else:
        with pytest.raises(InvalidState):
            next_state(state, verb)


@pytest.mark.parametrize(("promotion", "verb"), list(product(PromotionState, PromotionVerb)))
def test_every_legal_promotion_step_is_allowed_and_every_other_refused(promotion: PromotionState,
                                                                      verb: PromotionVerb) -> None:
    if (promotion, verb) in LEGAL_PROMOTION:
        assert next_promotion(promotion.value, verb) == LEGAL_PROMOTION[(promotion, verb)]
    else:
        with pytest.raises(InvalidState):
            next_promotion(promotion, verb)


def test_an_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError):
        next_state("taken", SnapshotVerb.READY)
    with pytest.raises(ValueError):
        next_promotion("uploaded", PromotionVerb.START)


def test_every_statement_is_fenced_by_the_states_its_step_leaves() -> None:
    assert snapshot_state._READY_SQL.endswith("WHERE id=$1 AND state='creating'")
    assert snapshot_state._FAIL_SQL.endswith("WHERE id=$1 AND state='creating'")
    assert "state='creating' RETURNING" in snapshot_state._FAIL_NODE_SQL
    for sql in (snapshot_state._DELETE_IDS_SQL, snapshot_state._DELETE_OF_DELETED_SQL,
                snapshot_state._DELETE_LOCAL_SQL):
        assert sql.startswith("UPDATE snapshots SET state='deleted' WHERE ")
        assert "state IN ('creating', 'failed', 'ready')" in sql
    assert "promotion IN ('failed', 'local', 'promoting') AND state='ready'" in snapshot_state._START_PROMOTION_SQL
    assert snapshot_state._PROMOTED_SQL.endswith("WHERE id=$1 AND promotion='promoting' RETURNING id")
    assert snapshot_state._FAIL_PROMOTION_SQL.endswith("promotion IN ('failed', 'local', 'promoting')")
    assert snapshot_state.INSERT_SQL.endswith("VALUES ($1,$2,$3,$4,$5,'creating',$6,$7)")


def test_only_the_owner_writes_the_snapshots_table() -> None:
    found = {f: n for f, n in _sites(_WRITE).items() if f != "libs/podbay/snapshot_state.py"}
    assert not found, f"write snapshots through podbay.snapshot_state, not here: {found}"
