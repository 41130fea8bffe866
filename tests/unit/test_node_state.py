"""A node's states come from one enum (:class:`podbay.contracts.states.NodeState`): the same strings as the
wire's ``Literal`` (``GET /v1/nodes``, drain and undrain answers) and the nodes table's CHECK, and no SQL over
``nodes`` in libs/ or services/ spells one as a string literal (issue #38: "state names come from the enums")."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from podbay.contracts import api
from podbay.contracts.states import NodeState

ROOT = Path(__file__).resolve().parents[2]
_STATE = "'(ready|draining|drained|lost)'"
#: SQL over the ``nodes`` table that names a node state as a literal: ``UPDATE nodes SET state='lost'``,
#: ``FROM nodes WHERE ... state <> 'lost'``, ``INSERT INTO nodes (...) VALUES (..., 'ready', ...)``,
#: ``JOIN nodes n ON ... n.state = 'ready'``.
_NODE_STATE_SQL = (
    re.compile(r"\bnodes(?:\s+\w+)?\s+(?:SET|WHERE)\b[^()]*?" + _STATE),
    re.compile(r"\bINTO nodes\b[^;]*?" + _STATE),
    re.compile(r"\bJOIN nodes (\w+) ON\b[^;]*?\b\1\.state\s*(?:=|<>)\s*" + _STATE),
)


def test_the_enum_is_the_wire_literal() -> None:
    assert set(NodeState) == set(get_args(api.NodeState))
    assert set(get_args(api.DrainStarted.model_fields["state"].annotation)) <= set(NodeState)
    assert set(get_args(api.NodeUndrained.model_fields["previous"].annotation)) <= set(NodeState)


def test_the_enum_is_the_tables_check() -> None:
    sql = (ROOT / "libs" / "podbay" / "db" / "migrations" / "0010_nodes.sql").read_text()
    check = re.search(r"nodes_state_check CHECK \(state IN \(([^)]*)\)\)", sql)
    assert check is not None
    assert {v.strip().strip("'") for v in check.group(1).split(",")} == {s.value for s in NodeState}


@pytest.mark.parametrize("state", list(NodeState))
def test_a_member_reads_and_writes_as_its_string(state: NodeState) -> None:
    # The wire is unchanged whether a node's state is given as the enum or as the string the database holds.
    res = api.NodeResources(memory_mib=1, vcpus=1)
    fields = dict(id="n1", live=True, schedulable=False, accel="tcg", dataplane_url="http://n1", capacity=res,
                  used=res, free=res, running=0, paused=0, sandboxes=0, warm_slots=0, heartbeat_age_s=None,
                  started_at="2026-01-01T00:00:00Z")
    by_enum = api.NodeInfo.model_validate({**fields, "state": state}).model_dump_json()
    assert by_enum == api.NodeInfo.model_validate({**fields, "state": state.value}).model_dump_json()
    assert f'"state":"{state.value}"' in by_enum


def _sql_constants(path: Path) -> list[tuple[int, str]]:
    """The string constants of ``path`` (pieces of f-strings included), docstrings and bare strings left out."""
    tree = ast.parse(path.read_text())
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in bare]


def _node_state_literals(root: Path) -> list[str]:
    hits = []
    for path in sorted([*(root / "libs").rglob("*.py"), *(root / "services").rglob("*.py")]):
        for line, text in _sql_constants(path):
            if any(p.search(text) for p in _NODE_STATE_SQL):
                hits.append(f"{path.relative_to(root)}:{line}")
    return hits


def test_the_scan_sees_node_state_literals(tmp_path: Path) -> None:
    probe = tmp_path / "libs" / "probe.py"
    probe.parent.mkdir()
    probe.write_text(
        '"""UPDATE nodes SET state=\'lost\' (a docstring: prose)."""\n'
        'A = "UPDATE nodes SET state=\'drained\' WHERE id=$1 AND state=\'draining\'"\n'
        'B = ("SELECT dataplane_url FROM nodes WHERE id=$1"\n     " AND state <> \'lost\'")\n'
        'C = "INSERT INTO nodes (id, state) VALUES ($1, \'ready\')"\n'
        'D = "SELECT n.id FROM t JOIN nodes n ON n.id = t.node_id WHERE n.state = \'ready\'"\n'
        'E = f"SELECT id FROM nodes WHERE state=\'{X}\'"\n'
        'F = "SELECT id FROM snapshots WHERE node_id=$1 AND state=\'ready\'"\n')
    assert _node_state_literals(tmp_path) == [f"libs/probe.py:{n}" for n in (2, 3, 5, 6)]


def test_no_sql_over_nodes_spells_a_state() -> None:
    assert _node_state_literals(ROOT) == [], (
        "name node states with podbay.contracts.states.NodeState: a $n parameter, or f\"'{NodeState.X}'\" in a "
        "constant built once")
