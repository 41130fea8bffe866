"""One list of sandbox event types (``podbay.contracts.events.EventType``): every emitter names a member, the
CLI's note and docs/sdk.md's table follow it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from podbay.cli import events as cli_events
from podbay.contracts.events import EVENT_TYPES, EventType

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "services", ROOT / "libs" / "podbay"]

#: Emitters of sandbox events -> the position of the type among their positional arguments.
EMITTERS = {"SandboxEvent": 0, "emit_sandbox_event": 2, "sandbox_event": 1}
#: Calls that take the type as keyword ``event`` (the node agent's bring-up of a VM).
KEYWORD_EMITTERS = {"bring_up"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _types_in(node: ast.expr) -> list[str | None]:
    """The event types ``node`` names: a literal's value, ``EventType.X``'s value, both branches of a
    conditional; ``None`` for a variable (typed ``EventType`` where it was made, which mypy checks)."""
    if isinstance(node, ast.IfExp):
        return _types_in(node.body) + _types_in(node.orelse)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "EventType":
        return [EventType[node.attr].value if node.attr in EventType.__members__ else f"EventType.{node.attr}"]
    return [None]


def emitted_types() -> dict[str, list[str]]:
    """Every event type the services and the shared library emit -> where (``path:line``)."""
    found: dict[str, list[str]] = {}
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            if "envd/proto" in path.as_posix():
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                name = _name(node.func)
                args: list[ast.expr] = []
                if name in EMITTERS and len(node.args) > EMITTERS[name]:
                    args.append(node.args[EMITTERS[name]])
                args += [k.value for k in node.keywords if k.arg == "type" and name == "SandboxEvent"]
                args += [k.value for k in node.keywords if k.arg == "event" and name in KEYWORD_EMITTERS]
                for arg in args:
                    for t in _types_in(arg):
                        if t is not None:
                            found.setdefault(t, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_emitted_event_type_is_an_event_type_member() -> None:
    found = emitted_types()
    unknown = {t: where for t, where in found.items() if t not in EVENT_TYPES}
    assert not unknown, f"emitted but not in podbay.contracts.events.EventType: {unknown}"
    # The scan sees the emitters (a renamed emitter would otherwise make this pass on nothing), among them
    # the two that the list once lacked.
    assert {"created", "started", "deleted", "migrated", "rescheduled", "schedule.fired"} <= found.keys()


def test_the_scan_catches_a_literal_outside_the_enum(tmp_path: Path) -> None:
    src = 'SandboxEvent("teleported", node_id=n)\nemit_sandbox_event(conn, sid, EventType.FORKED)\n'
    seen = [t for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Call) and _name(node.func) in EMITTERS
            for t in _types_in(node.args[EMITTERS[_name(node.func)]])]
    assert seen == ["teleported", "forked"] and "teleported" not in EVENT_TYPES


def test_event_types_are_well_formed_subject_tokens_and_unique() -> None:
    from podbay.contracts.events import EVENT_TYPE_PATTERN

    assert len(set(EVENT_TYPES)) == len(EVENT_TYPES) == len(EventType)
    assert all(re.fullmatch(EVENT_TYPE_PATTERN, t) for t in EVENT_TYPES)
    assert f"{EventType.SCHEDULE_FIRED}" == "schedule.fired"  # a member is its wire string in subjects


@pytest.mark.parametrize("kind", ["migrated", "rescheduled", "schedule.finished"])
def test_the_cli_notes_nothing_for_an_emitted_type(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    cli_events.note_unknown_types([kind])
    assert capsys.readouterr().err == ""


def test_docs_sdk_lists_exactly_the_event_types() -> None:
    doc = (ROOT / "docs" / "sdk.md").read_text()
    listed = re.findall(r"^\| `([a-z._]+)` \| ", doc.split("The event types podbay emits", 1)[1].split("\n\n", 2)[1],
                        re.M)
    assert listed == list(EVENT_TYPES)
