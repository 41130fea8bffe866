"""Lifecycle table, error wire shape and API key handling: pure logic."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from podbay.contracts.states import ALLOWED, SandboxCommand, SandboxState, check_allowed
from podbay.errors import InvalidState, NotFound, PodbayError, SandboxFailed, Unprocessable, error_from_wire
from podbay_api.core.auth import generate_key, hash_key


@pytest.mark.parametrize("state", list(SandboxState))
def test_exec_is_allowed_only_when_running(state: SandboxState) -> None:
    if state is SandboxState.RUNNING:
        check_allowed(SandboxCommand.EXEC, state)
    else:
        with pytest.raises(InvalidState) as err:
            check_allowed(SandboxCommand.EXEC, state)
        assert err.value.http_status == 409
        assert err.value.details["state"] == state.value


def test_delete_is_allowed_everywhere_but_deleted() -> None:
    assert SandboxState.DELETED not in ALLOWED[SandboxCommand.DELETE]
    for st in SandboxState:
        if st is not SandboxState.DELETED:
            check_allowed(SandboxCommand.DELETE, st)


def test_restore_is_allowed_from_failed_but_not_from_transient_states() -> None:
    # A sandbox whose VM died comes back from one of its snapshots (docs/DESIGN.md §5).
    for st in (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.FAILED):
        check_allowed(SandboxCommand.RESTORE, st)
    for st in (SandboxState.STARTING, SandboxState.SUSPENDED, SandboxState.DELETING, SandboxState.DELETED):
        with pytest.raises(InvalidState):
            check_allowed(SandboxCommand.RESTORE, st)


def test_error_round_trips_through_the_wire() -> None:
    for exc in (NotFound("no such sandbox", details={"sandbox_id": "x"}), InvalidState("busy", details={"state": "paused"}),
                SandboxFailed("boom")):
        back = error_from_wire(exc.to_wire(), exc.http_status)
        assert type(back) is type(exc)
        assert back.message == exc.message and back.details == exc.details


def test_unknown_error_body_keeps_the_status() -> None:
    err = error_from_wire("<html>bad gateway</html>", 502)
    assert type(err) is PodbayError and "502" in err.message


def test_unknown_error_code_keeps_code_status_and_family() -> None:
    """A code the client does not know (the API's ``invalid_dockerfile``) is not read as internal."""
    err = error_from_wire({"error": {"code": "invalid_dockerfile", "message": "line 2 (HEALTHCHECK)"}}, 422)
    assert isinstance(err, Unprocessable) and (err.code, err.http_status) == ("invalid_dockerfile", 422)
    big = error_from_wire({"error": {"code": "context_too_large", "message": "over"}}, 413)
    assert (big.code, big.http_status) == ("context_too_large", 413)
    assert type(error_from_wire({"error": {"message": "no code"}}, 500)) is PodbayError


def test_api_keys_are_random_and_hashed() -> None:
    a, pa = generate_key()
    b, pb = generate_key()
    assert a != b and pa != pb
    assert a.startswith(f"pb_{pa}_") and len(a.split("_")[2]) == 40
    assert hash_key(a) != hash_key(b) and len(hash_key(a)) == 32
    assert a.encode() not in hash_key(a)


class _FakePool:
    """Answers the one api_keys lookup ``authenticate`` makes, and counts the calls."""

    def __init__(self, key: str) -> None:
        self.calls = 0
        self.row = {"id": "key_1", "tenant_id": "ten_1", "key_hash": hash_key(key)}

    async def fetchrow(self, sql: str, prefix: str) -> dict[str, object] | None:
        self.calls += 1
        return self.row


async def test_authenticate_caches_verified_keys_only() -> None:
    from podbay.errors import Unauthorized
    from podbay_api.core import auth

    key, _ = generate_key()
    pool = _FakePool(key)
    first = await auth.authenticate(pool, f"Bearer {key}")  # type: ignore[arg-type]
    second = await auth.authenticate(pool, f"Bearer {key}")  # type: ignore[arg-type]
    assert first == second and first.tenant_id == "ten_1"
    assert pool.calls == 1
    wrong = key[:-1] + ("0" if key[-1] != "0" else "1")
    for _ in range(2):
        with pytest.raises(Unauthorized):
            await auth.authenticate(pool, f"Bearer {wrong}")  # type: ignore[arg-type]
    assert pool.calls == 3  # failures are looked up every time, never cached
    with pytest.raises(Unauthorized):
        await auth.authenticate(pool, None)  # type: ignore[arg-type]


def test_a_refusal_reads_as_english() -> None:
    with pytest.raises(InvalidState) as info:
        check_allowed(SandboxCommand.FILES, SandboxState.PAUSED)
    assert str(info.value) == ("cannot read or write files of a sandbox that is paused; resume it first "
                               "(POST /v1/sandboxes/{id}/resume, `podbay sandbox resume ID`)")
    with pytest.raises(InvalidState) as info:
        check_allowed(SandboxCommand.PAUSE, SandboxState.DELETED)
    assert str(info.value) == "cannot pause a sandbox that is deleted"


def test_validation_messages_read_as_the_validator_wrote_them() -> None:
    from pydantic import ValidationError

    from podbay.contracts.api import PoolSet
    from podbay.errors import validation_message

    with pytest.raises(ValidationError) as whole:
        PoolSet.model_validate({"size": 2, "max_size": 1})
    # A check of the whole model: its sentence alone, no pydantic prefix and no location.
    msg = validation_message(whole.value.errors()[0])
    assert msg == "max_size must be at least size", msg
    with pytest.raises(ValidationError) as field:
        PoolSet.model_validate({"size": -1})
    assert validation_message(field.value.errors()[0]).startswith("size: ")
    # FastAPI's locations start with where the value came from; a body field is named alone.
    assert validation_message({"loc": ("body", "size"), "msg": "too big"}) == "size: too big"
    assert validation_message({"loc": ("query", "wait"), "msg": "bad"}) == "query.wait: bad"


class _CreateBody(BaseModel):
    template: str


async def test_a_body_that_is_not_json_reads_as_such_with_where_it_stopped() -> None:
    import httpx
    from fastapi import FastAPI

    from podbay_api.core.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/sandboxes")
    async def create(body: _CreateBody) -> dict[str, str]:
        return {"template": body.template}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
        r = await c.post("/v1/sandboxes", content=b'{"template": }', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    assert r.json()["error"]["message"] == "the request body is not valid JSON: Expecting value (at character 13)"
