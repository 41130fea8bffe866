"""The asyncio SDK against the fake API (test_sdk_fake.py): the same contract as the blocking one."""

from __future__ import annotations

import io
import pytest
from test_sdk_fake import API_KEY, FakeApi, _served, clean_env, fake_api  # noqa: F401  (fixtures)

from podbay.sdk import AsyncClient, AsyncSandbox, ExecEvent, GuestError, InvalidState, NotFound, Unavailable


async def _create(fake: FakeApi) -> AsyncSandbox:
    return await AsyncSandbox.create("base", metadata={"k": "v"}, api_url=fake.url, api_key=API_KEY)


async def test_create_exec_and_delete_on_exit(fake_api: FakeApi) -> None:
    async with await _create(fake_api) as sb:
        sid = sb.id
        assert fake_api.last("/v1/sandboxes").json() == {"template": "base", "metadata": {"k": "v"}}
        res = await sb.exec(["echo", "async"], env={"X": "y"})
        assert (res.stdout, res.exit_code) == ("async\n", 0)
        assert fake_api.last("/exec").json() == {"argv": ["echo", "async"], "env": {"X": "y"}}
        assert (await sb.refresh()).state == "running"
    assert sid not in fake_api.sandboxes
    assert sb._client._http.is_closed


async def test_connect_list_and_operations(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-a")
    sb = await AsyncSandbox.connect("sb-a", api_url=fake_api.url, api_key=API_KEY)
    await sb.aclose()
    assert [b.id for b in await AsyncSandbox.list(api_url=fake_api.url, api_key=API_KEY)] == ["sb-a"]
    async with AsyncClient(fake_api.url, API_KEY) as client:
        deleting = await client.delete_sandbox("sb-a", wait=False)
        assert deleting.operation_id == "op-delete-1"
        assert (await client.get_operation("op-delete-1")).state == "succeeded"
        assert [t.name for t in await client.list_templates()] == ["base"]
        with pytest.raises(NotFound):
            await AsyncSandbox.connect("sb-missing", client=client)


async def test_exec_stream_is_incremental(fake_api: FakeApi) -> None:
    async with await _create(fake_api) as sb:
        seen: list[ExecEvent] = []
        async for event in sb.exec_stream(["gated"]):
            seen.append(event)
            if event.data == "first\n":
                fake_api.gate.set()  # the server holds the rest until now (see the sync twin)
        assert [(e.type, e.data) for e in seen[1:3]] == [("stdout", "first\n"), ("stdout", "second\n")]
        assert seen[-1].type == "exit" and seen[-1].exit_code == 0


async def test_exec_stream_errors(fake_api: FakeApi) -> None:
    async with await _create(fake_api) as sb:
        with pytest.raises(GuestError, match="guest went away"):
            async for _ in sb.exec_stream(["fail"]):
                pass
        with pytest.raises(Unavailable, match="ended before"):
            async for _ in sb.exec_stream(["cut"]):
                pass
    fake_api.add_sandbox("sb-paused", state="paused")
    async with AsyncClient(fake_api.url, API_KEY) as client:
        with pytest.raises(InvalidState):
            async for _ in client.exec_stream("sb-paused", "true"):
                pass


class _AsyncReader:
    """A file-like object whose ``read`` is a coroutine, as aiofiles gives."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    async def read(self, n: int) -> bytes:
        return self._buf.read(n)


async def test_files_round_trip(fake_api: FakeApi) -> None:
    big = b"0123456789abcdef" * 40000
    async with await _create(fake_api) as sb:
        await sb.files.write("/a", b"bytes")
        await sb.files.write("/b", "text", mode=0o755)
        assert fake_api.last("/files").query == {"path": "/b", "mode": "0755"}
        await sb.files.write("/c", io.BytesIO(big))
        await sb.files.write("/d", _AsyncReader(big))
        assert await sb.files.read("/a") == b"bytes"
        assert await sb.files.read_text("/b") == "text"
        assert await sb.files.read("/c") == big
        assert await sb.files.read("/d") == big
        assert (await sb.files.stat("/d")).size == len(big)
        assert await sb.files.exists("/a")
        await sb.files.remove("/a")
        assert not await sb.files.exists("/a")
        assert (await sb.files.mkdir("/dir", parents=False)).type == "dir"
        assert fake_api.last("/mkdir").query == {"path": "/dir", "parents": "false"}
        assert {e.name for e in await sb.files.list("/")} == {"b", "c", "d", "dir"}


async def test_a_build_whose_stream_broke_off_is_followed(fake_api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("podbay.sdk._templates.FOLLOW_POLL_S", 0.01)
    row = {"id": "bld_fake", "name": "base", "created_at": "2026-12-04T00:00:00Z"}
    fake_api.build_rows = [[{**row, "state": "running"}], [{**row, "state": "succeeded"}]]
    async with AsyncClient(fake_api.url, API_KEY) as c:
        tpl = await c.build_template("base", "FROM base\nRUN echo BREAK\n")
    assert tpl.name == "base"
