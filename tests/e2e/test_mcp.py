"""``podbay mcp`` as MCP clients use it: the official ``mcp`` client library drives the real command (a
subprocess) over stdio and over streamable HTTP, against the real stack and real microVMs.

Also measures the round trip of an MCP tool call over stdio (``exec`` of ``true``, p50 of 20 calls), printed,
never asserted.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from podbay.sdk import AsyncClient

pytestmark = pytest.mark.e2e

PODBAY = str(Path(sys.executable).with_name("podbay"))


def _env(stack: Any, tmp_path: Path) -> dict[str, str]:
    """The caller's key and URL in the environment, and no config file (the key is the stack's)."""
    return {"PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": stack.api_key,
            "PODBAY_CONFIG": str(tmp_path / "absent.json")}


def _out(result: Any) -> Any:
    assert not result.is_error, result.content
    return result.structured_content


async def test_stdio_tools_on_a_real_sandbox(stack: Any, tmp_path: Path) -> None:
    params = StdioServerParameters(command=PODBAY, args=["mcp"], env=_env(stack, tmp_path))
    async with Client(params) as mcp:
        names = {t.name for t in (await mcp.list_tools()).tools}
        assert {"sandbox_create", "exec", "read_file", "write_file", "kill", "fork", "rollback"} <= names
        sid = _out(await mcp.call_tool("sandbox_create", {"template": "base"}))["id"]
        try:
            ran = _out(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "echo hi"}))
            assert (ran["stdout"], ran["exit_code"]) == ("hi\n", 0)
            _out(await mcp.call_tool("write_file", {"sandbox_id": sid, "path": "/tmp/mcp.txt", "content": "from mcp"}))
            read = _out(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/mcp.txt"}))
            assert read["content"] == "from mcp"
            res = await mcp.read_resource(f"podbay://sandboxes/{sid}/files/tmp/mcp.txt")
            assert res.contents[0].text == "from mcp"  # type: ignore[union-attr]

            laps, floor = [], []
            async with AsyncClient(stack.api_url, stack.api_key) as api:
                for _ in range(20):
                    t0 = time.perf_counter()
                    result = await mcp.call_tool("exec", {"sandbox_id": sid, "command": ["true"]})
                    laps.append((time.perf_counter() - t0) * 1000)
                    assert _out(result)["exit_code"] == 0
                    t0 = time.perf_counter()
                    await api.exec(sid, ["true"])  # the floor: the same call from the SDK, no MCP in between
                    floor.append((time.perf_counter() - t0) * 1000)
            print(f"\nMCP tool call round trip over stdio, exec ['true']: p50 {statistics.median(laps):.1f} ms "
                  f"(min {min(laps):.1f}, max {max(laps):.1f}); the SDK's exec alone, same run: p50 "
                  f"{statistics.median(floor):.1f} ms (20 calls each)")
        finally:
            _out(await mcp.call_tool("kill", {"sandbox_id": sid}))
        gone = await mcp.call_tool("sandbox_get", {"sandbox_id": sid})
        # a deleted sandbox answers as deleted for a while, then 404 (a tool error naming not_found)
        assert (gone.is_error and "not_found:" in gone.content[0].text  # type: ignore[union-attr]
                or (gone.structured_content or {}).get("state") == "deleted"), gone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_streamable_http_needs_the_token(stack: Any, tmp_path: Path) -> None:
    port = _free_port()
    token = "t-" + os.urandom(16).hex()
    env = {**os.environ, **_env(stack, tmp_path), "PODBAY_MCP_TOKEN": token}
    proc = subprocess.Popen([PODBAY, "mcp", "--http", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                refused = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "podbay mcp --http did not start"
                time.sleep(0.2)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        wrong = httpx.post(url, json={}, headers={"Authorization": "Bearer nope"}, timeout=5)
        assert wrong.status_code == 401

        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        async with http, Client(streamable_http_client(url, http_client=http)) as mcp:
            assert "exec" in {t.name for t in (await mcp.list_tools()).tools}
            listed = _out(await mcp.call_tool("sandbox_list", {}))
            assert isinstance(listed["sandboxes"], list)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
