"""``podbay mcp`` (podbay.cli.mcp_server, podbay.cli.mcp_tools) against the fake API (test_sdk_fake.py): the
tools' schemas, their mapping to API requests, API errors as MCP tool errors, the resources, the HTTP
transport's bearer guard, and the line ``podbay mcp`` prints without the ``mcp`` extra.

The MCP side is the official SDK's in-process client (``mcp.Client(server)``): the same JSON-RPC messages as
stdio, without a subprocess (tests/e2e/test_mcp.py runs the real stdio and HTTP transports).
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from mcp import Client
from test_sdk_fake import API_KEY, FakeApi, _served, clean_env, fake_api  # noqa: F401  (fixtures)
from typer.testing import CliRunner

from podbay.cli import mcp_tools
from podbay.cli.mcp_server import bearer_guard, build_server
from podbay.sdk import AsyncClient


@asynccontextmanager
async def _connected(fake: FakeApi, key: str = API_KEY) -> AsyncIterator[Client]:
    """The MCP client of a server over the fake API (opened and closed in one task, as anyio wants)."""
    api = AsyncClient(fake.url, key)
    try:
        async with Client(build_server(api)) as client:
            yield client
    finally:
        await api.aclose()


def _json(result: Any) -> Any:
    assert not result.is_error, result.content
    return result.structured_content


async def test_lists_every_tool_with_described_parameters(fake_api: FakeApi) -> None:
    async with _connected(fake_api) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
        assert list(tools) == list(mcp_tools.TOOL_NAMES)
        for tool in tools.values():
            assert tool.description and len(tool.description) > 20, tool.name
            for name, prop in tool.input_schema.get("properties", {}).items():
                assert prop.get("description"), (tool.name, name)
        exec_schema = tools["exec"].input_schema
        assert exec_schema["required"] == ["sandbox_id", "command"]
        assert {"type": "array", "items": {"type": "string"}} in exec_schema["properties"]["command"]["anyOf"]
        assert tools["kill"].annotations is not None and tools["kill"].annotations.destructive_hint
        assert tools["sandbox_list"].annotations is not None and tools["sandbox_list"].annotations.read_only_hint


async def test_create_exec_files_and_kill_map_to_the_api(fake_api: FakeApi) -> None:
    async with _connected(fake_api) as mcp:
        created = _json(await mcp.call_tool("sandbox_create", {"template": "base", "metadata": {"who": "mcp"}}))
        sid = created["id"]
        assert fake_api.last("/v1/sandboxes").json() == {"template": "base", "metadata": {"who": "mcp"}}
        assert fake_api.last("/v1/sandboxes").headers["authorization"] == f"Bearer {API_KEY}"

        ran = _json(await mcp.call_tool("exec", {"sandbox_id": sid, "command": ["echo", "hi"], "env": {"A": "b"},
                                                 "cwd": "/tmp", "timeout_s": 5}))
        assert (ran["stdout"], ran["exit_code"], ran["timed_out"]) == ("hi\n", 0, False) and "notes" not in ran
        assert fake_api.last("/exec").json() == {"argv": ["echo", "hi"], "env": {"A": "b"}, "cwd": "/tmp",
                                                 "timeout_s": 5.0}
        shell = _json(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "ls /"}))
        assert shell["stdout"] == "sh:ls /\n" and fake_api.last("/exec").json()["shell"] == "ls /"

        wrote = _json(await mcp.call_tool("write_file", {"sandbox_id": sid, "path": "/tmp/a.txt", "content": "héllo"}))
        assert wrote["path"] == "/tmp/a.txt" and fake_api.files[(sid, "/tmp/a.txt")][0] == "héllo".encode()
        read = _json(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/a.txt"}))
        assert (read["content"], read["encoding"], read["truncated"]) == ("héllo", "utf-8", False)

        blob = bytes(range(256))
        await mcp.call_tool("write_file", {"sandbox_id": sid, "path": "/tmp/b", "encoding": "base64",
                                           "content": base64.b64encode(blob).decode()})
        assert fake_api.files[(sid, "/tmp/b")][0] == blob
        read = _json(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/b"}))
        assert read["encoding"] == "base64" and base64.b64decode(read["content"]) == blob
        cut = _json(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/b", "max_bytes": 10,
                                                          "encoding": "base64"}))
        assert cut["truncated"] and base64.b64decode(cut["content"]) == blob[:10] and cut["notes"]

        listed = _json(await mcp.call_tool("list_files", {"sandbox_id": sid, "path": "/tmp"}))
        assert {e["name"] for e in listed["entries"]} >= {"a.txt", "b"}
        assert [s["id"] for s in _json(await mcp.call_tool("sandbox_list", {}))["sandboxes"]] == [sid]
        assert _json(await mcp.call_tool("sandbox_get", {"sandbox_id": sid}))["state"] == "running"

        _json(await mcp.call_tool("kill", {"sandbox_id": sid}))
        assert sid not in fake_api.sandboxes


async def test_long_output_is_cut_in_the_middle_with_a_note(fake_api: FakeApi) -> None:
    async with _connected(fake_api) as mcp:
        fake_api.add_sandbox("sb-a")
        words = [f"w{i:04d}" for i in range(2000)]  # 12,000 characters of stdout
        ran = _json(await mcp.call_tool("exec", {"sandbox_id": "sb-a", "command": ["echo", *words],
                                                 "max_output_chars": 1000}))
        assert ran["stdout"].startswith("w0000 ") and ran["stdout"].endswith("w1999\n")
        assert len(ran["stdout"]) < 1100 and "characters cut" in ran["stdout"]
        assert ran["notes"] == ["stdout: 11000 of 12000 characters cut from the middle"]


async def test_api_errors_are_tool_errors_with_the_code_and_message(fake_api: FakeApi) -> None:
    async with _connected(fake_api) as mcp:
        missing = await mcp.call_tool("exec", {"sandbox_id": "sbx_nope", "command": "true"})
        assert missing.is_error
        text = missing.content[0].text  # type: ignore[union-attr]
        assert "not_found: sandbox sbx_nope not found" in text
        fake_api.add_sandbox("sb-paused", state="paused")
        refused = await mcp.call_tool("exec", {"sandbox_id": "sb-paused", "command": "true"})
        assert refused.is_error and "invalid_state:" in refused.content[0].text  # type: ignore[union-attr]
        bad = await mcp.call_tool("write_file", {"sandbox_id": "sb-paused", "path": "/x", "content": "%%",
                                                 "encoding": "base64"})
        assert bad.is_error and "invalid_request: content is not valid base64" in bad.content[0].text  # type: ignore[union-attr]
        # the server goes on answering after errors
        assert _json(await mcp.call_tool("sandbox_list", {}))["sandboxes"][0]["id"] == "sb-paused"


async def test_wrong_key_is_an_unauthorized_tool_error(fake_api: FakeApi) -> None:
    async with _connected(fake_api, "pb_wrong") as client:
        result = await client.call_tool("sandbox_list", {})
    assert result.is_error and result.content[0].text.startswith(  # type: ignore[union-attr]
        "Error executing tool sandbox_list: unauthorized:")


async def test_file_and_sandbox_resources(fake_api: FakeApi) -> None:
    async with _connected(fake_api) as mcp:
        fake_api.add_sandbox("sb-a")
        fake_api.files[("sb-a", "/etc/hostname")] = (b"box\n", 0o644)
        templates = (await mcp.list_resource_templates()).resource_templates
        assert [t.uri_template for t in templates] == [mcp_tools.FILE_RESOURCE]
        got = await mcp.read_resource("podbay://sandboxes/sb-a/files/etc/hostname")
        assert got.contents[0].text == "box\n"  # type: ignore[union-attr]
        assert fake_api.last("/files").query["path"] == "/etc/hostname"
        listed = await mcp.read_resource(mcp_tools.SANDBOXES_RESOURCE)
        assert [s["id"] for s in json.loads(listed.contents[0].text)["sandboxes"]] == ["sb-a"]  # type: ignore[union-attr]


def test_truncate_output_keeps_head_and_tail() -> None:
    assert mcp_tools.truncate_output("abc", 3) == ("abc", None)
    text, note = mcp_tools.truncate_output("a" * 50 + "b" * 50, 40)
    assert text == "a" * 10 + "\n[... 60 characters cut ...]\n" + "b" * 30
    assert note == "60 of 100 characters cut from the middle"


async def test_bearer_guard_refuses_a_missing_or_wrong_token_and_passes_the_right_one() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    guarded = bearer_guard(app, "s3cret")

    async def call(headers: list[tuple[bytes, bytes]]) -> int | None:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await guarded({"type": "http", "headers": headers}, None, send)  # type: ignore[arg-type]
        return sent[0]["status"] if sent else None

    assert await call([]) == 401
    assert await call([(b"authorization", b"Bearer s3cre")]) == 401
    assert await call([(b"authorization", b"s3cret")]) == 401
    assert seen == []
    assert await call([(b"authorization", b"Bearer s3cret")]) is None and seen == ["http"]
    await guarded({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["http", "lifespan"]


def test_without_the_extra_podbay_mcp_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from podbay.cli.main import app

    for name in [m for m in sys.modules if m == "mcp" or m.startswith("mcp.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mcp", None)  # import mcp raises ImportError, as when it is absent
    result = CliRunner().invoke(app, ["mcp"])
    assert (result.exit_code, result.stderr) == (
        1, "error: `podbay mcp` needs the mcp package: pip install 'podbay[mcp]' (unavailable)\n")


def _sandbox(sid: str, state: str = "running") -> dict[str, Any]:
    now = "2026-01-01T00:00:00Z"
    return {"id": sid, "template": "base", "state": state, "desired_state": "running", "node_id": "node-1",
            "generation": 2, "memory_mib": 256, "vcpus": 1, "hostname": sid, "created_at": now, "updated_at": now}


async def test_lifecycle_snapshot_fork_and_port_tools_send_the_api_requests() -> None:
    """The tools the fake API does not serve, through the SDK's transport seam: each tool's request (method,
    path, query, body) and its parsed answer."""
    import httpx

    seen: list[tuple[str, str, str, Any]] = []
    snap = {"id": "snap_1", "sandbox_id": "sbx_1", "kind": "full", "state": "ready",
            "created_at": "2026-01-01T00:00:00Z"}

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, request.url.query.decode(), body))
        path = request.url.path
        if path.endswith("/snapshots"):
            return httpx.Response(201, json=snap) if request.method == "POST" else httpx.Response(
                200, json={"snapshots": [snap]})
        if path.endswith("/fork"):
            return httpx.Response(200, json={"snapshot_id": "snap_1", "operation_id": "op_1",
                                             "children": [{"sandbox_id": "sbx_2", "state": "running"}]})
        if path.endswith("/ports/8000/url"):
            return httpx.Response(200, json={"port": 8000, "url": "http://8000-sbx-1.example", "public": False,
                                             "path_url": "http://api/p/sbx_1/8000/", "token": "tok"})
        state = {"pause": "paused", "timeout": "running"}.get(path.rsplit("/", 1)[-1], "running")
        return httpx.Response(200, json=_sandbox("sbx_1", state))

    api = AsyncClient("http://api.test", "pb_k", transport=httpx.MockTransport(answer))
    calls: list[tuple[str, dict[str, Any]]] = [
        ("sandbox_create", {"template": "base", "timeout_s": 600, "on_lease_expiry": "delete"}),
        ("pause", {"sandbox_id": "sbx_1"}),
        ("resume", {"sandbox_id": "sbx_1"}),
        ("snapshot_create", {"sandbox_id": "sbx_1", "kind": "disk"}),
        ("snapshot_list", {"sandbox_id": "sbx_1"}),
        ("fork", {"sandbox_id": "sbx_1", "count": 2, "snapshot_id": "snap_1"}),
        ("rollback", {"sandbox_id": "sbx_1", "snapshot_id": "snap_1"}),
        ("port_url", {"sandbox_id": "sbx_1", "port": 8000}),
    ]
    try:
        async with Client(build_server(api)) as client:
            results = {name: _json(await client.call_tool(name, args)) for name, args in calls}
    finally:
        await api.aclose()
    assert [(m, p) for m, p, _, _ in seen] == [
        ("POST", "/v1/sandboxes"), ("POST", "/v1/sandboxes/sbx_1/timeout"),
        ("POST", "/v1/sandboxes/sbx_1/pause"), ("POST", "/v1/sandboxes/sbx_1/resume"),
        ("POST", "/v1/sandboxes/sbx_1/snapshots"), ("GET", "/v1/sandboxes/sbx_1/snapshots"),
        ("POST", "/v1/sandboxes/sbx_1/fork"), ("POST", "/v1/sandboxes/sbx_1/restore"),
        ("GET", "/v1/sandboxes/sbx_1/ports/8000/url"),
    ]
    bodies = {p: b for _, p, _, b in seen}
    assert bodies["/v1/sandboxes/sbx_1/timeout"] == {"lease_s": 600, "on_lease_expiry": "delete"}
    assert bodies["/v1/sandboxes/sbx_1/fork"] == {"count": 2, "snapshot_id": "snap_1"}
    assert bodies["/v1/sandboxes/sbx_1/restore"] == {"snapshot_id": "snap_1"}
    assert bodies["/v1/sandboxes/sbx_1/snapshots"] is None and seen[4][3] == {"kind": "disk"}
    assert results["pause"]["state"] == "paused"
    assert results["snapshot_list"]["snapshots"][0]["id"] == "snap_1"
    assert results["fork"]["children"] == [{"sandbox_id": "sbx_2", "state": "running"}]
    assert (results["port_url"]["token"], results["port_url"]["header"]) == ("tok", "X-Podbay-Access-Token")


def test_without_a_key_podbay_mcp_says_so_before_serving(clean_env: None) -> None:
    from podbay.cli.main import app

    result = CliRunner().invoke(app, ["mcp"])
    assert result.exit_code == 2 and result.stderr.startswith("error: no API key: pass --api-key")
    assert result.stderr.endswith("(unauthorized)\n")
