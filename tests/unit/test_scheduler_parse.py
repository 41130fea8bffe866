"""The scheduler's consumers: a malformed command is dropped for good (``term``), a valid one parsed."""

from __future__ import annotations

from podbay_scheduler.main import _parse

from podbay.contracts.messages import DrainNodeCmd


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.termed = False

    async def term(self) -> None:
        self.termed = True


async def test_a_malformed_command_is_terminated_and_a_valid_one_parsed() -> None:
    bad = _Msg(b'{"node": 1')
    assert await _parse(bad, DrainNodeCmd, "drain") is None
    assert bad.termed
    good = _Msg(DrainNodeCmd(operation_id="op_1", node_id="n1").model_dump_json().encode())
    cmd = await _parse(good, DrainNodeCmd, "drain")
    assert cmd is not None and cmd.node_id == "n1" and not good.termed
