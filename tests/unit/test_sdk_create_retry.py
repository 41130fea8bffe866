"""The SDK's create sends an ``Idempotency-Key`` (a fresh one per create) and, when the connection is refused or
breaks before the answer, sends the create again with the same key; other failures and other calls are not
retried. Through ``httpx.MockTransport``."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from test_sdk_fake import clean_env  # noqa: F401  (fixture)

from podbay.sdk import AsyncClient, Client, Timeout, Unavailable
from podbay.sdk import _calls

pytestmark = pytest.mark.usefixtures("clean_env")

INFO = {"id": "sbx_1", "template": "base", "state": "running", "desired_state": "running", "generation": 1,
        "memory_mib": 256, "vcpus": 1, "hostname": "h", "created_at": "2026-01-01T00:00:00Z",
        "updated_at": "2026-01-01T00:00:00Z"}


@pytest.fixture(autouse=True)
def no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_calls, "CREATE_RETRY_DELAYS_S", (0.0, 0.0, 0.0))


def _handler(failures: list[Exception], keys: list[str | None]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("Idempotency-Key"))
        if failures:
            raise failures.pop(0)
        return httpx.Response(201, json=INFO)
    return handler


def test_a_create_whose_connection_broke_is_sent_again_with_its_key() -> None:
    keys: list[str | None] = []
    failures: list[Exception] = [httpx.RemoteProtocolError("Server disconnected without sending a response."),
                                 httpx.ConnectError("refused")]
    with Client("http://api.test", "k", transport=httpx.MockTransport(_handler(failures, keys))) as client:
        assert client.create_sandbox("base").id == "sbx_1"
        assert len(keys) == 3 and keys[0] and len(set(keys)) == 1
        client.create_sandbox("base")
    assert len(keys) == 4 and keys[3] != keys[0]  # a new create, a new key


def test_retries_are_bounded_and_timeouts_are_not_retried() -> None:
    keys: list[str | None] = []
    failures: list[Exception] = [httpx.ReadError("reset")] * 4
    with Client("http://api.test", "k", transport=httpx.MockTransport(_handler(failures, keys))) as client:
        with pytest.raises(Unavailable, match="broke off"):
            client.create_sandbox("base")
        assert len(keys) == 4  # the first send and three retries
        keys.clear()
        failures[:] = [httpx.ReadTimeout("slow")]
        with pytest.raises(Timeout):
            client.create_sandbox("base")
        assert len(keys) == 1


def test_other_calls_are_sent_once() -> None:
    keys: list[str | None] = []
    failures: list[Exception] = [httpx.RemoteProtocolError("gone")]
    with Client("http://api.test", "k", transport=httpx.MockTransport(_handler(failures, keys))) as client:
        with pytest.raises(Unavailable):
            client.get_sandbox("sbx_1")
    assert keys == [None]


async def test_the_async_client_retries_a_create_with_its_key() -> None:
    keys: list[str | None] = []
    failures: list[Exception] = [httpx.RemoteProtocolError("gone")]
    transport = httpx.MockTransport(_handler(failures, keys))
    async with AsyncClient("http://api.test", "k", transport=transport) as client:
        assert (await client.create_sandbox("base")).id == "sbx_1"
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1]
