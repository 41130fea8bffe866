"""Request bodies refuse at the boundary what would go wrong later: ``ExecRequest`` what execve(2) in the
guest would refuse with E2BIG, so an over-long argument is the client's error (422 ``validation_error``), not
the guest's (502); a port's ``public`` anything but a JSON boolean."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from podbay.contracts.api import EXEC_ARG_MAX_BYTES, EXEC_ARGS_TOTAL_MAX_BYTES, ExecRequest


def test_the_longest_argument_linux_takes_is_accepted_and_one_byte_more_is_refused() -> None:
    fits = "x" * (EXEC_ARG_MAX_BYTES - 1)
    assert ExecRequest(argv=["echo", fits]).argv == ["echo", fits]
    for req in ({"argv": ["echo", fits + "x"]}, {"shell": fits + "x"}, {"argv": ["env"], "env": {"A": fits}}):
        with pytest.raises(ValidationError, match="MAX_ARG_STRLEN"):
            ExecRequest(**req)  # type: ignore[arg-type]


def test_arguments_and_environment_beyond_arg_max_in_all_are_refused() -> None:
    chunk = "y" * (EXEC_ARG_MAX_BYTES - 1)
    n = EXEC_ARGS_TOTAL_MAX_BYTES // EXEC_ARG_MAX_BYTES
    assert len(ExecRequest(argv=["echo", *[chunk] * (n - 1)]).argv or []) == n
    with pytest.raises(ValidationError, match="ARG_MAX"):
        ExecRequest(argv=["echo", *[chunk] * n])
    with pytest.raises(ValidationError, match="exactly one"):
        ExecRequest(argv=["true"], shell="true")


def test_a_ports_public_setting_is_a_json_boolean_only() -> None:
    from podbay.contracts.api import PortAccessUpdate

    assert PortAccessUpdate.model_validate_json('{"public": true}').public is True
    for bad in ('"yes"', '1', '"true"', 'null'):
        with pytest.raises(ValidationError):
            PortAccessUpdate.model_validate_json(f'{{"public": {bad}}}')
