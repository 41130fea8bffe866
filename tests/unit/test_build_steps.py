"""How the node's builder shows and applies steps (services/nodeagent/build/builder.py): ``--chown`` in the
step's text, a user without a group owning copied files with the user's primary group, as Docker does, and a
RUN the guest refuses (USER names no user) failing with its line."""

from __future__ import annotations

import pytest

from podbay.contracts.templates import RunStep
from podbay.dockerfile import parse_dockerfile
from podbay.errors import InvalidRequest
from podbay_nodeagent.build.builder import StepFailed, _Builder, _describe, chown_spec


@pytest.mark.parametrize(("given", "owner"), [
    ("app", "app:"), ("app:staff", "app:staff"), ("1000", "1000:1000"), ("1000:50", "1000:50"),
])
def test_chown_without_a_group_takes_the_users_primary_group(given: str, owner: str) -> None:
    assert chown_spec(given) == owner


def test_copy_step_text_shows_chown() -> None:
    spec = parse_dockerfile("FROM base\nCOPY --chown=app a.txt /home/app/\nCOPY b.txt /b\n", {})
    assert [_describe(s) for s in spec.steps] == ["COPY --chown=app a.txt /home/app/", "COPY b.txt /b"]


class _RefusingChannel:
    """A guest channel that refuses every exec as guestd does for an unknown user."""

    def exec(self, spec: object) -> _RefusingChannel:
        return self

    async def __aenter__(self) -> None:
        raise InvalidRequest("no such user: 'nosuchuser'")

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_run_as_an_unknown_user_names_its_line() -> None:
    builder = object.__new__(_Builder)
    builder.ch = _RefusingChannel()
    step = parse_dockerfile("FROM base\nUSER nosuchuser\nRUN id\n", {}).steps[0]
    assert isinstance(step, RunStep)
    with pytest.raises(StepFailed) as err:
        await builder.run(1, step)
    assert "line 3" in err.value.message and "no such user: 'nosuchuser'" in err.value.message
    assert err.value.details["line"] == 3
