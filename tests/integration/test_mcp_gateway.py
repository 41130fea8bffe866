"""podbay's MCP gateway (templates/mcp-gateway/gateway.py) on the host, started as E2B's SDK starts it in the
sandbox (``GATEWAY_ACCESS_TOKEN=... mcp-gateway --config '<json>'``, a command that returns once the gateway
listens), with a stdio MCP server of this folder (mcp_stdio_fixture_server.py) installed where the gateway looks
for the catalog's ``time`` and ``fetch`` servers (``--servers-dir``). The ``mcp`` client library lists and calls
tools over streamable HTTP with the bearer token; a missing or wrong token is 401.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from mcp_gateway_helpers import mcp_session

from podbay.devstack.procs import free_port

pytest.importorskip("mcp")

GATEWAY = Path(__file__).resolve().parents[2] / "templates" / "mcp-gateway" / "gateway.py"
FIXTURE_SERVER = Path(__file__).resolve().with_name("mcp_stdio_fixture_server.py")


def _gateway_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("podbay_mcp_gateway", GATEWAY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _install_fixture(servers_dir: Path, name: str, script: str, tag: str) -> None:
    """``servers_dir/name/bin/script``: the fixture server, as a pre-installed catalog server sits there."""
    path = servers_dir / name / "bin" / script
    path.parent.mkdir(parents=True)
    path.write_text(f"#!/bin/sh\nFIXTURE_TAG={tag} exec {sys.executable} {FIXTURE_SERVER} \"$@\"\n")
    path.chmod(0o755)


class Gateway:
    """A gateway started by the launching command in ``root`` (token file, log, servers), stopped by its pid."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.servers = root / "servers"
        self.token_file = root / "etc" / ".token"
        self.url = f"http://127.0.0.1:{self.port}/mcp"

    def launch(self, config: dict[str, Any], token: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "GATEWAY_ACCESS_TOKEN"}
        if token is not None:
            env["GATEWAY_ACCESS_TOKEN"] = token
        return subprocess.run([sys.executable, str(GATEWAY), "--config", json.dumps(config), "--host", "127.0.0.1",
                               "--port", str(self.port), "--token-file", str(self.token_file), "--servers-dir",
                               str(self.servers), "--log-file", str(self.root / "gateway.log")],
                              env=env, capture_output=True, text=True, timeout=300)

    def stop(self) -> None:
        pid_file = self.token_file.with_name("gateway.pid")
        if pid_file.exists():
            pid = int(pid_file.read_text())
            try:
                os.killpg(pid, signal.SIGTERM)  # its own session: the gateway and the servers it started
            except ProcessLookupError:
                pass


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path)
    _install_fixture(gw.servers, "time", "mcp-server-time", "time")
    _install_fixture(gw.servers, "fetch", "mcp-server-fetch", "fetch")
    try:
        yield gw
    finally:
        gw.stop()


async def test_serves_a_servers_tools_behind_the_token(gateway: Gateway) -> None:
    done = gateway.launch({"time": {"localTimezone": "Asia/Tokyo"}}, "tok-1")
    assert done.returncode == 0, done.stderr
    assert gateway.token_file.read_text() == "tok-1"
    assert stat.S_IMODE(gateway.token_file.stat().st_mode) == 0o600
    async with mcp_session(gateway.url, "tok-1") as mcp:
        assert {t.name for t in (await mcp.list_tools()).tools} == {"get_current_time", "argv"}
        now = await mcp.call_tool("get_current_time", {"timezone": "Europe/Paris"})
        assert not now.is_error and now.content[0].text == "12:00 in Europe/Paris"
        # E2B's camelCase setting became the server's own flag
        assert (await mcp.call_tool("argv", {})).content[0].text == "--local-timezone Asia/Tokyo time"
        unknown = await mcp.call_tool("nope", {})
        assert unknown.is_error and "unknown tool" in unknown.content[0].text
    ping = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in (None, "Bearer tok-2", "Bearer tok-1x", "tok-1", "Basic dG9rLTE="):
        r = httpx.post(gateway.url, json=ping, headers={**headers, **({"Authorization": auth} if auth else {})})
        assert r.status_code == 401, (auth, r.text)
        assert r.json()["error"]["code"] == "unauthorized"


async def test_tools_of_two_servers_are_aggregated_and_a_clash_is_prefixed(gateway: Gateway) -> None:
    done = gateway.launch({"time": {}, "fetch": {}}, "tok")
    assert done.returncode == 0, done.stderr
    async with mcp_session(gateway.url, "tok") as mcp:
        names = {t.name for t in (await mcp.list_tools()).tools}
        assert names == {"get_current_time", "argv", "fetch__get_current_time", "fetch__argv"}
        assert (await mcp.call_tool("argv", {})).content[0].text == "time"
        assert (await mcp.call_tool("fetch__argv", {})).content[0].text == "fetch"


async def test_without_the_variable_a_random_token_is_written(gateway: Gateway) -> None:
    done = gateway.launch({"time": {}}, None)
    assert done.returncode == 0, done.stderr
    token = gateway.token_file.read_text()
    assert len(token) >= 32
    async with mcp_session(gateway.url, token) as mcp:
        assert "argv" in {t.name for t in (await mcp.list_tools()).tools}


@pytest.mark.parametrize(("config", "message"), [
    ({"noSuchServer": {}}, "'noSuchServer' is not in this gateway's catalog"),
    ({"time": "x"}, "the settings of 'time' must be a JSON object"),
    ({}, "at least one MCP server"),
])
def test_a_config_it_cannot_serve_fails_the_command(gateway: Gateway, config: Any, message: str) -> None:
    done = gateway.launch(config, "tok")
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not gateway.token_file.exists()


def test_a_server_that_is_not_installed_is_named(tmp_path: Path) -> None:
    gw = _gateway_module()
    with pytest.raises(gw.ConfigError, match="git: mcp-server-git is not installed"):
        gw.plan({"git": {"paths": ["/home/user/repo"]}}, tmp_path, install=False)
    _install_fixture(tmp_path, "git", "mcp-server-git", "git")
    (launch,) = gw.plan({"git": {"paths": ["/home/user/repo"]}}, tmp_path, install=False)
    assert launch.args == ["--repository", "/home/user/repo"]


async def test_the_command_returns_while_a_slow_start_goes_on(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under emulation the gateway can take longer to start than E2B's SDK gives the command (60 s): the command
    returns after ``START_WAIT_S`` (0 here) with the gateway still starting, and a server slower than the
    listener (3 s here) is waited for by the first tools request."""
    gw = _gateway_module()
    slow = gateway.servers / "time" / "bin" / "mcp-server-time"
    slow.write_text(slow.read_text().replace("FIXTURE_TAG=", "sleep 3; FIXTURE_TAG=", 1))
    monkeypatch.setattr(gw, "START_WAIT_S", 0.0)
    monkeypatch.setenv("GATEWAY_ACCESS_TOKEN", "tok")
    gateway.token_file.parent.mkdir(parents=True)
    argv = ["--config", json.dumps({"time": {}}), "--host", "127.0.0.1", "--port", str(gateway.port),
            "--servers-dir", str(gateway.servers)]
    assert gw.launch_background(argv, gateway.port, gateway.root / "gateway.log",
                                gateway.token_file.with_name("gateway.pid")) == 0
    deadline = time.monotonic() + 120
    while not gw._listening(gateway.port):
        assert time.monotonic() < deadline, (gateway.root / "gateway.log").read_text()
        time.sleep(0.1)
    async with mcp_session(gateway.url, "tok") as mcp:
        assert "argv" in {t.name for t in (await mcp.list_tools()).tools}
