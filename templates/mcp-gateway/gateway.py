"""podbay's MCP gateway: the ``mcp-gateway`` command of the ``mcp-gateway`` template (docs/mcp.md).

E2B's SDK, given ``Sandbox.create(mcp={"time": {}, ...})``, asks for the template ``mcp-gateway`` and runs, as root::

    GATEWAY_ACCESS_TOKEN=<uuid> mcp-gateway --config '{"time": {}, ...}'

then reads the token back from ``/etc/mcp-gateway/.token`` and speaks MCP's streamable HTTP to
``https://<host of port 50005>/mcp`` with ``Authorization: Bearer <token>``. This program does that:

- the config is a JSON object whose keys name MCP servers of the catalog E2B's SDK types list (``CATALOG`` below:
  the entries this gateway knows how to start) and whose values are that server's settings (camelCase, as E2B's
  types spell them). An unknown name, or a known one whose program is missing and cannot be installed, exits
  2 with the reason on stderr (the SDK raises it as "Failed to start MCP gateway: <stderr>").
- each server runs as a stdio subprocess (``mcp`` SDK's client); a PyPI server pre-installed in
  ``/opt/mcp-servers/<name>`` runs from there, else from ``PATH``, else it is installed from the package index
  into that directory (which needs the sandbox's egress to allow the index); an npm server runs with ``npx``
  when node is in the image.
- the tools of all servers are served as one MCP server (low-level ``mcp.server.lowlevel.Server``), under the
  names their servers give them, as Docker's MCP gateway (the one E2B runs) does by default; when two servers
  name a tool alike, the later one's is served as ``<server>__<tool>``.
- every HTTP request needs ``Authorization: Bearer <token>`` (compared in constant time), else 401 before the
  MCP layer; the token is ``GATEWAY_ACCESS_TOKEN`` (a random one when unset), written to
  ``/etc/mcp-gateway/.token`` (mode 0600).
- the command returns once the gateway listens (``0.0.0.0:50005``; at most ``START_WAIT_S``), leaving it running in a session of its
  own (its log: ``/var/log/mcp-gateway.log``, its pid: ``gateway.pid`` beside the token), as E2B's SDK waits
  for the command to finish.
  ``--foreground`` serves in this process instead (tests).

Only the standard library and the ``mcp`` SDK (with its uvicorn/starlette) are used: this file runs in the
template's own virtual environment, not with podbay installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PORT = 50005
MCP_PATH = "/mcp"
TOKEN_ENV = "GATEWAY_ACCESS_TOKEN"
TOKEN_FILE = Path("/etc/mcp-gateway/.token")
LOG_FILE = Path("/var/log/mcp-gateway.log")
SERVERS_DIR = Path("/opt/mcp-servers")
#: How long the launching command waits for the gateway to listen before it returns anyway (the gateway still
#: starting): E2B's SDK gives the command 60 s, and a Python start under emulation can take most of that.
START_WAIT_S = 45.0
#: The guest's CA bundle (it holds the CA of a TLS-inspecting network; pip's certifi does not).
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class ConfigError(Exception):
    """The config names a server this gateway cannot start, or is not a JSON object of objects."""


@dataclass(frozen=True)
class Entry:
    """How to start one catalog server: a PyPI ``package`` with its console ``script``, or an npm
    ``npm_package`` run with npx; ``args`` turns the server's settings (E2B's camelCase keys) into arguments
    and ``env`` into environment variables."""

    package: str = ""
    script: str = ""
    npm_package: str = ""
    args: Callable[[dict[str, Any]], list[str]] = lambda cfg: []
    env: Callable[[dict[str, Any]], dict[str, str]] = lambda cfg: {}


def _opt(flag: str, key: str) -> Callable[[dict[str, Any]], list[str]]:
    return lambda cfg: [flag, str(cfg[key])] if cfg.get(key) else []


def _paths(cfg: dict[str, Any]) -> list[str]:
    paths = cfg.get("paths") or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ConfigError("paths must be a list of strings")
    return list(paths)


#: The entries of E2B's catalog this gateway starts (keys as E2B's ``McpServer`` type spells them). ``time`` is
#: pre-installed in the template; the other PyPI ones install on first use when the index is reachable.
CATALOG: dict[str, Entry] = {
    "time": Entry(package="mcp-server-time==2026.10.19", script="mcp-server-time",
                  args=_opt("--local-timezone", "localTimezone")),
    "fetch": Entry(package="mcp-server-fetch", script="mcp-server-fetch"),
    "git": Entry(package="mcp-server-git", script="mcp-server-git",
                 args=lambda cfg: [a for p in _paths(cfg)[:1] for a in ("--repository", p)]),
    "sqlite": Entry(package="mcp-server-sqlite", script="mcp-server-sqlite",
                    args=lambda cfg: ["--db-path", str(cfg.get("dbPath") or "/home/user/db.sqlite")]),
    "filesystem": Entry(npm_package="@modelcontextprotocol/server-filesystem", args=_paths),
    "memory": Entry(npm_package="@modelcontextprotocol/server-memory"),
    "sequentialthinking": Entry(npm_package="@modelcontextprotocol/server-sequential-thinking"),
}


@dataclass
class Launch:
    """One server to start: its config name and the command, arguments and extra environment."""

    name: str
    command: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def parse_config(text: str) -> dict[str, dict[str, Any]]:
    """The ``--config`` JSON as {server name: settings}; raises ``ConfigError`` for anything else."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config is not JSON: {exc}") from exc
    if not isinstance(cfg, dict) or not cfg:
        raise ConfigError("--config must be a JSON object naming at least one MCP server")
    for name, settings in cfg.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"the settings of {name!r} must be a JSON object")
    return cfg


def _install(name: str, package: str, servers_dir: Path) -> None:
    """Install ``package`` from the package index into its own virtual environment ``servers_dir/name``."""
    venv = servers_dir / name
    try:
        if not (venv / "bin" / "pip").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=600)
        cert = ["--cert", CA_BUNDLE] if Path(CA_BUNDLE).is_file() else []
        subprocess.run([str(venv / "bin" / "pip"), "install", "--no-cache-dir", *cert, package], check=True,
                       capture_output=True, timeout=1800)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
        raise ConfigError(f"{name}: installing {package} from the package index failed: {' '.join(tail)}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"{name}: installing {package} from the package index timed out") from exc


def plan(cfg: dict[str, dict[str, Any]], servers_dir: Path = SERVERS_DIR, install: bool = True) -> list[Launch]:
    """What to start for ``cfg``: a ``Launch`` per server. A PyPI server's script is looked for in
    ``servers_dir/<name>/bin``, then on ``PATH``, then installed (when ``install``). Raises ``ConfigError``
    naming the first server that cannot be started."""
    out: list[Launch] = []
    for name, settings in cfg.items():
        entry = CATALOG.get(name)
        if entry is None:
            known = ", ".join(sorted(CATALOG))
            raise ConfigError(f"MCP server {name!r} is not in this gateway's catalog (known: {known})")
        args, env = entry.args(settings), entry.env(settings)
        if entry.script:
            local = servers_dir / name / "bin" / entry.script
            if not local.exists() and not shutil.which(entry.script) and install:
                _install(name, entry.package, servers_dir)
            if local.exists():
                out.append(Launch(name, str(local), args, env))
            elif found := shutil.which(entry.script):
                out.append(Launch(name, found, args, env))
            else:
                raise ConfigError(f"{name}: {entry.script} is not installed")
        else:
            npx = shutil.which("npx")
            if npx is None:
                raise ConfigError(f"{name}: an npm server ({entry.npm_package}) needs node, absent in this image")
            out.append(Launch(name, npx, ["-y", entry.npm_package, *args], env))
    return out


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Scope]], Callable[[Scope], Awaitable[None]]], Awaitable[None]]


def bearer_guard(app: ASGIApp, token: str) -> ASGIApp:
    """``app`` behind ``Authorization: Bearer <token>``: any other HTTP request gets 401 (JSON body)."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: Scope, receive: Callable[[], Awaitable[Scope]],
                      send: Callable[[Scope], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            sent = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
            if not hmac.compare_digest(sent, expected):
                body = b'{"error": {"code": "unauthorized", "message": "missing or wrong bearer token"}}'
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


@contextlib.asynccontextmanager
async def upstreams(launches: list[Launch]) -> AsyncIterator[tuple[list[Any], dict[str, tuple[Any, str]]]]:
    """Start every server and list its tools: yields (the tools as served, {served name: (client, its own
    name)}). The servers stop when the context exits."""
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import get_default_environment

    tools: list[Any] = []
    route: dict[str, tuple[Any, str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        for launch in launches:
            params = StdioServerParameters(command=launch.command, args=launch.args,
                                           env={**get_default_environment(), **launch.env})
            client = await stack.enter_async_context(Client(params))
            for tool in (await client.list_tools()).tools:
                served = tool.name if tool.name not in route else f"{launch.name}__{tool.name}"
                route[served] = (client, tool.name)
                tools.append(tool.model_copy(update={"name": served}))
        yield tools, route


async def serve(launches: list[Launch], host: str, port: int, token: str) -> None:
    """Serve the servers' tools over streamable HTTP at ``MCP_PATH`` until cancelled. The listener opens first
    and the servers start beside it (a server's start is slow under emulation): a request for the tools waits
    until every server has started; when one fails to start, the gateway exits (the log says why)."""
    import mcp_types as types
    import uvicorn
    from mcp.server.lowlevel import Server

    ready = asyncio.Event()
    tools: list[Any] = []
    route: dict[str, tuple[Any, str]] = {}

    async def list_tools(ctx: Any, params: Any) -> Any:
        await ready.wait()
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: Any) -> Any:
        await ready.wait()
        target = route.get(params.name)
        if target is None:
            text = f"unknown tool {params.name!r}"
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)
        client, name = target
        return await client.call_tool(name, params.arguments or {})

    server: Server[Any] = Server("podbay-mcp-gateway", version="1", on_list_tools=list_tools,
                                 on_call_tool=call_tool)
    app = bearer_guard(server.streamable_http_app(streamable_http_path=MCP_PATH, host=host), token)
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    listening = asyncio.create_task(http.serve())
    try:
        async with upstreams(launches) as (started, routes):
            tools.extend(started)
            route.update(routes)
            ready.set()
            await listening
    finally:
        http.should_exit = True
        with contextlib.suppress(Exception):
            await listening


def write_token(token: str, path: Path) -> None:
    """Write ``token`` to ``path`` (mode 0600, directory 0700), replacing what was there."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def launch_background(argv: list[str], port: int, log: Path, pid_file: Path) -> int:
    """Run this program with ``argv`` + ``--foreground`` in a new session (stdio on ``log``, its pid written to
    ``pid_file``), and wait until it listens on ``port``, at most ``START_WAIT_S``: 0 (also when the wait ran out
    with the gateway still starting: a client's first requests may then be refused for a moment), or 1 with the
    log's tail on stderr when it exits first."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--foreground"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    pid_file.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_WAIT_S
    while not _listening(port):
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-10:]
            print("mcp-gateway did not start:\n" + "\n".join(tail), file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"mcp-gateway: still starting (pid {proc.pid}); it will listen on port {port}", file=sys.stderr)
            return 0
        time.sleep(0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mcp-gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON: {server name: settings}")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--token-file", type=Path, default=TOKEN_FILE)
    p.add_argument("--servers-dir", type=Path, default=SERVERS_DIR)
    p.add_argument("--log-file", type=Path, default=LOG_FILE)
    p.add_argument("--foreground", action="store_true", help="serve in this process (the command returns "
                   "once the gateway listens otherwise)")
    args = p.parse_args(argv)
    try:
        launches = plan(parse_config(args.config), args.servers_dir)
    except ConfigError as exc:
        print(f"mcp-gateway: {exc}", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or ""
    if not args.foreground:
        if not token:
            token = os.urandom(16).hex()
        write_token(token, args.token_file)
        os.environ[TOKEN_ENV] = token  # the child's, inherited
        return launch_background(list(argv if argv is not None else sys.argv[1:]), args.port, args.log_file,
                                 args.token_file.with_name("gateway.pid"))
    if not token:
        print(f"mcp-gateway: {TOKEN_ENV} is not set", file=sys.stderr)
        return 2
    asyncio.run(serve(launches, args.host, args.port, token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
