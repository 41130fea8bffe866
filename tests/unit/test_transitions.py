"""``podbay.transitions``: a table's moves, its refusals and the guarded statement it writes."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import pytest

from podbay.errors import InvalidState
from podbay.transitions import TransitionTable, in_sql


class St(StrEnum):
    NEW = "new"
    DONE = "done"
    BAD = "bad"
    GONE = "gone"


class Vb(StrEnum):
    FINISH = "finish"
    END = "end"
    DROP = "drop"


TABLE = TransitionTable({(St.NEW, Vb.FINISH): St.DONE, (St.NEW, Vb.END): frozenset({St.DONE, St.BAD}),
                         **{(s, Vb.DROP): St.GONE for s in (St.NEW, St.DONE, St.BAD)}},
                        states=St, refusal="a thing that is {state} cannot {verb}")


def test_a_move_in_the_table_is_allowed_and_one_outside_refused() -> None:
    assert TABLE.next_state("new", Vb.FINISH) == St.DONE
    assert TABLE.next_state(St.NEW, Vb.END, "bad") == St.BAD
    with pytest.raises(InvalidState) as exc:
        TABLE.next_state(St.DONE, Vb.FINISH)
    assert exc.value.message == "a thing that is done cannot finish"
    assert exc.value.details == {"state": "done", "verb": "finish"}
    with pytest.raises(InvalidState, match="cannot end to gone"):
        TABLE.next_state(St.NEW, Vb.END, St.GONE)
    with pytest.raises(InvalidState):
        TABLE.next_state(St.NEW, Vb.END)  # several outcomes: the caller names one
    with pytest.raises(ValueError):
        TABLE.next_state("lost", Vb.FINISH)


def test_sources_targets_and_fences() -> None:
    assert TABLE.sources(Vb.DROP) == {St.NEW, St.DONE, St.BAD}
    assert TABLE.target(Vb.DROP) == St.GONE
    with pytest.raises(ValueError):
        TABLE.target(Vb.END)
    assert TABLE.fence({St.NEW}) == "state='new'"
    assert TABLE.fence({St.NEW, St.DONE, St.BAD}) == "state IN ('bad', 'done', 'new')"
    complement = TransitionTable(TABLE.moves, states=St, refusal="{state} cannot {verb}", complement_fence=True)
    assert complement.fence({St.NEW, St.DONE, St.BAD}) == "state <> 'gone'"
    with pytest.raises(ValueError):
        in_sql("state", [])


def test_the_guarded_update_is_fenced_by_the_states_its_verb_leaves() -> None:
    assert TABLE.update_sql("things", Vb.FINISH) == "UPDATE things SET state='done' WHERE id=$1 AND state='new'"
    assert TABLE.update_sql("things", Vb.DROP, also="gone_at=now()", where="owner=$1", then="pinned IS NOT TRUE",
                            returning="id") == (
        "UPDATE things SET state='gone', gone_at=now() WHERE owner=$1 AND state IN ('bad', 'done', 'new')"
        " AND pinned IS NOT TRUE RETURNING id")
    assert TABLE.update_sql("things", Vb.END, to="$2", fence={St.NEW}) == (
        "UPDATE things SET state=$2 WHERE id=$1 AND state='new'")


#: The modules that own a state column each (docs/ARCHITECTURE.md, "Who writes which table").
OWNERS = {"libs/podbay/lifecycle.py", "libs/podbay/snapshot_state.py", "libs/podbay/operation_state.py",
          "libs/podbay/warm_slot_state.py", "libs/podbay/schedule_run_state.py", "libs/podbay/build_state.py",
          "libs/podbay/volume_state.py"}


def test_only_the_owners_build_a_table() -> None:
    # update_sql writes "UPDATE <table>" from a name, which the owners' literal scans would not see elsewhere.
    root = Path(__file__).resolve().parents[2]
    users = {p.relative_to(root).as_posix() for folder in ("libs", "services") for p in (root / folder).rglob("*.py")
             if "TransitionTable(" in p.read_text()} - {"libs/podbay/transitions.py"}
    assert users == OWNERS
