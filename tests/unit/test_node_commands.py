"""Node commands as one union (``podbay.contracts.messages``): every verb has one body model and one handler,
and a verb outside the union is refused before any handler runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args, get_type_hints

import pytest
from pydantic import ValidationError

from podbay.contracts.messages import (
    NODE_COMMANDS,
    NodeHandlers,
    NodeVerb,
    SandboxOpCmd,
    UnknownNodeCommand,
    dispatch_node_command,
)
from podbay_nodeagent.main import command_handlers


def _recording() -> tuple[NodeHandlers, list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []

    def handler(verb: str) -> Any:
        async def handle(cmd: Any) -> None:
            seen.append((verb, cmd))
        return handle

    return NodeHandlers(**{v: handler(v) for v in get_args(NodeVerb)}), seen


def test_every_verb_has_a_body_model_and_a_handler_slot() -> None:
    verbs = set(get_args(NodeVerb))
    assert set(NODE_COMMANDS) == verbs
    hints = get_type_hints(NodeHandlers)
    assert set(hints) == verbs
    for verb, model in NODE_COMMANDS.items():
        assert get_args(hints[verb])[0] == [model], verb  # Callable[[model], Awaitable[None]]


def test_the_node_agent_handles_every_verb() -> None:
    async def h(cmd: Any) -> None: ...
    ops = SimpleNamespace(snapshot=h, restore=h, fork=h, suspend=h, wake=h, migrate_out=h)
    manager = SimpleNamespace(create=h, delete=h, pause=h, resume=h, snapshots=ops, suspend_ops=ops, migrations=ops)
    assert set(command_handlers(manager)) == set(get_args(NodeVerb))


async def test_a_command_reaches_its_verbs_handler_as_its_model() -> None:
    handlers, seen = _recording()
    body = b'{"operation_id": "op1", "sandbox_id": "sb1", "generation": 3}'
    await dispatch_node_command(handlers, "resume", body)
    assert seen == [("resume", SandboxOpCmd(operation_id="op1", sandbox_id="sb1", generation=3))]


@pytest.mark.parametrize("verb", ["teleport", "", "create.x", "__class__", "keys"])
async def test_an_unknown_verb_fails_and_runs_no_handler(verb: str) -> None:
    handlers, seen = _recording()
    with pytest.raises(UnknownNodeCommand):
        await dispatch_node_command(handlers, verb, b"{}")
    assert seen == []


async def test_a_malformed_body_fails_before_its_handler() -> None:
    handlers, seen = _recording()
    with pytest.raises(ValidationError):
        await dispatch_node_command(handlers, "pause", b'{"operation_id": "op1", "sandbox_id": "../x", "generation": 1}')
    with pytest.raises(ValidationError):  # a body of another verb: extra fields are refused
        await dispatch_node_command(handlers, "delete", b'{"operation_id": "op1", "sandbox_id": "s", "generation": 1,'
                                                        b' "snapshot_id": "x"}')
    assert seen == []
