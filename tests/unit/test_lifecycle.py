"""``podbay.lifecycle``: the transition table agrees with the command gates, the fenced UPDATE it writes, and
the INSERT of a new row, and the check that every ``UPDATE sandboxes`` and ``INSERT INTO sandboxes`` in
services/ and libs/ lives in that module or on a short allow-list (docs/ARCHITECTURE.md, "Lifecycle")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from podbay.contracts.states import ALLOWED, OperationState, SandboxCommand, SandboxState
from podbay.errors import InvalidState
from podbay.lifecycle import TRANSITIONS, Verb, insert_sql, next_state, outcome_sql, targets, update_sql

ROOT = Path(__file__).resolve().parents[2]
S = SandboxState

#: Files that may still write ``UPDATE sandboxes`` themselves, with how many statements and why. Keep it short:
#: a change of a sandbox's state, generation or node belongs in podbay.lifecycle.
ALLOWED_SITES: dict[str, tuple[int, str]] = {
    "libs/podbay/outbox.py": (1, "the event sequence number, bumped with every sandbox event; not a state"),
    "services/api/services/network.py": (1, "the sandbox's egress policy; not a state"),
}

#: Files that may still write ``INSERT INTO sandboxes`` themselves, with how many statements and why. Empty:
#: the API's create, fork, E2B snapshot create and warm claim all go through lifecycle.insert/insert_sql.
ALLOWED_INSERT_SITES: dict[str, tuple[int, str]] = {}

_UPDATE = re.compile(r"\bUPDATE\s+sandboxes\b", re.IGNORECASE)
_INSERT = re.compile(r"\bINSERT\s+INTO\s+sandboxes\b", re.IGNORECASE)


def update_sites(source: str, pattern: re.Pattern[str] = _UPDATE) -> int:
    """How many string literals of ``source`` (adjacent literals count as one, f-strings included) hold an
    ``UPDATE sandboxes`` (or ``pattern``)."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            count += len(pattern.findall(node.value))
    return count


def _sites(pattern: re.Pattern[str]) -> dict[str, int]:
    """Files of libs/ and services/ (but podbay.lifecycle) with statements matching ``pattern``, and how many."""
    found: dict[str, int] = {}
    for folder in ("libs", "services"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "libs/podbay/lifecycle.py" or "/proto/" in rel:
                continue
            n = update_sites(path.read_text(), pattern)
            if n:
                found[rel] = n
    return found


def test_every_update_of_sandboxes_is_in_the_lifecycle_module_or_allowed() -> None:
    found = _sites(_UPDATE)
    outside = {f: n for f, n in found.items() if f not in ALLOWED_SITES or n > ALLOWED_SITES[f][0]}
    assert not outside, ("UPDATE sandboxes outside podbay.lifecycle (use lifecycle.apply, or compose "
                         f"lifecycle.update_sql): {outside}")
    stale = {f: (n, found.get(f, 0)) for f, (n, _) in ALLOWED_SITES.items() if found.get(f, 0) < n}
    assert not stale, f"allow-list entries with fewer sites than listed (shrink them): {stale}"


def test_every_insert_of_a_sandbox_is_in_the_lifecycle_module_or_allowed() -> None:
    found = _sites(_INSERT)
    outside = {f: n for f, n in found.items() if f not in ALLOWED_INSERT_SITES or n > ALLOWED_INSERT_SITES[f][0]}
    assert not outside, ("INSERT INTO sandboxes outside podbay.lifecycle (use lifecycle.insert, or compose "
                         f"lifecycle.insert_sql): {outside}")
    stale = {f: (n, found.get(f, 0)) for f, (n, _) in ALLOWED_INSERT_SITES.items() if found.get(f, 0) < n}
    assert not stale, f"allow-list entries with fewer sites than listed (shrink them): {stale}"


def test_a_new_row_is_born_with_its_state_hostname_and_lease() -> None:
    assert insert_sql(S.PENDING, {"id": "$1", "tenant_id": "$2", "lease_s": "$3"}) == (
        "INSERT INTO sandboxes (id, tenant_id, lease_s, state, desired_state, hostname, lease_expires_at)"
        " VALUES ($1, $2, $3, 'pending', 'running', 'sbx-' || substr($1, 5, 12),"
        " now() + $3::integer * interval '1 second') RETURNING id")
    assert insert_sql(S.STARTING, {"id": "slot.id", "node_id": "slot.node_id"}, select_from="slot, t",
                      returning="*") == (
        "INSERT INTO sandboxes (id, node_id, state, desired_state, hostname)"
        " SELECT slot.id, slot.node_id, 'starting', 'running', 'sbx-' || substr(slot.id, 5, 12)"
        " FROM slot, t RETURNING *")
    with pytest.raises(ValueError):
        insert_sql(S.PENDING, {"id": "$1", "state": "'running'"})  # the state is the lifecycle's
    with pytest.raises(ValueError):
        insert_sql(S.PENDING, {"tenant_id": "$1"})
    with pytest.raises(InvalidState):
        insert_sql(S.RUNNING, {"id": "$1"})


def test_the_finder_sees_split_literals_and_f_strings() -> None:
    assert update_sites('x = ("UPDATE " "sandboxes SET a=1")\ny = f"update  sandboxes SET {z}"\n') == 2
    assert update_sites('x = "UPDATE sandboxes_v SET a=1"  # UPDATE sandboxes\n') == 0
    assert update_sites('x = ("INSERT INTO " "sandboxes (id) VALUES ($1)")\n', _INSERT) == 1


@pytest.mark.parametrize(("verb", "command"), [(Verb.PAUSE, SandboxCommand.PAUSE), (Verb.RESUME, SandboxCommand.RESUME),
                                              (Verb.SUSPEND, SandboxCommand.SUSPEND),
                                              (Verb.RESTORE, SandboxCommand.RESTORE),
                                              (Verb.DELETE, SandboxCommand.DELETE)])
def test_a_commands_transition_starts_where_its_gate_allows_it(verb: Verb, command: SandboxCommand) -> None:
    assert {s for (s, v) in TRANSITIONS if v == verb} == set(ALLOWED[command])


def test_the_table_names_each_step() -> None:
    assert next_state(S.RUNNING, Verb.PAUSE) is S.PAUSED
    assert next_state(S.PAUSED, Verb.RESUME) is S.RUNNING
    assert next_state(S.SUSPENDED, Verb.RESUME) is S.RESUMING
    assert next_state(S.PENDING, Verb.PLACE) is S.STARTING
    assert next_state(S.RESUMING, Verb.PLACE) is S.RESUMING
    assert next_state(S.SUSPENDING, Verb.SUSPEND_FAILED) is S.PAUSED
    assert next_state("failed", Verb.RESTORE) is S.STARTING
    with pytest.raises(InvalidState) as err:
        next_state(S.DELETED, Verb.DELETE)
    assert err.value.http_status == 409 and err.value.details == {"state": "deleted", "verb": "delete"}
    # Nothing leaves deleted, and nothing but the lifecycle's own verbs enter it.
    assert not [k for k in TRANSITIONS if k[0] is S.DELETED]
    assert {v for (_, v), to in TRANSITIONS.items() if to is S.DELETED} == {Verb.DELETED}


def test_states_that_go_different_ways_cannot_share_one_update() -> None:
    assert targets(Verb.MOVE) is None  # running stays running, paused stays paused
    assert targets(Verb.RESUME, [S.PAUSED]) is S.RUNNING
    with pytest.raises(ValueError):
        targets(Verb.RESUME)


def test_the_update_is_fenced_by_state_generation_and_node() -> None:
    assert update_sql(Verb.STARTED, [S.STARTING], generation="$2", node="$3",
                      values={"event_seq": "event_seq+1"}, returning="event_seq") == (
        "UPDATE sandboxes SET state='running', event_seq=event_seq+1, updated_at=now()"
        " WHERE id=$1 AND state='starting' AND generation=$2 AND node_id=$3"
        " RETURNING event_seq")
    assert update_sql(Verb.DELETE, None) == (
        "UPDATE sandboxes SET state='deleting', desired_state='deleted', updated_at=now() WHERE id=$1 RETURNING id")
    assert update_sql(Verb.FAIL, [S.PENDING], node_is_null=True, values={"failure_reason": "$3"},
                      set_node="NULL", new_generation="generation+1") == (
        "UPDATE sandboxes SET state='failed', failure_reason=$3, node_id=NULL, generation=generation+1,"
        " updated_at=now() WHERE id=$1 AND state='pending' AND node_id IS NULL RETURNING id")
    with pytest.raises(ValueError):
        update_sql(Verb.FAIL, [S.RUNNING], values={"lease_s": "$2"})


def test_an_operations_outcome_sets_what_it_is_given() -> None:
    assert outcome_sql(OperationState.SUCCEEDED, operation="$4", where="EXISTS (SELECT 1 FROM s)") == (
        "UPDATE operations SET state='succeeded', finished_at=now() WHERE id=$4 AND EXISTS (SELECT 1 FROM s)")
    assert outcome_sql(OperationState.PENDING, error_code=None, error_message=None, finished=False) == (
        "UPDATE operations SET state='pending', error_code=NULL, error_message=NULL, finished_at=NULL WHERE id=$1")
    assert outcome_sql(OperationState.RUNNING, finished=None) == "UPDATE operations SET state='running' WHERE id=$1"
