"""``podbay mcp``: podbay as an MCP server (stdio, or streamable HTTP), built on the official ``mcp`` SDK.

    podbay mcp                         # stdio: what Claude Desktop / Claude Code start (docs/mcp.md)
    podbay mcp --http --port 8765      # streamable HTTP at http://127.0.0.1:8765/mcp, bearer token required

The tools and resources are ``podbay.cli.mcp_tools``; they call the API with the caller's key (``--api-key``,
``PODBAY_API_KEY``, or the config file ``podbay up`` writes, ``podbay.clientconfig``), so the tenant is the
key's and the API enforces it.

HTTP auth: every HTTP request must carry ``Authorization: Bearer <token>``, where the token is
``PODBAY_MCP_TOKEN`` when set, else a random one generated at start and printed on stderr. It is not the
podbay API key: an MCP client holding it can use the server's tools, but never learns the key. A request
without it (or with another) gets 401 before it reaches the MCP layer. The listener binds 127.0.0.1 unless
``--host`` says otherwise.

The ``mcp`` package is the optional extra ``podbay[mcp]``: it is imported inside the functions here, so the
rest of the client (and ``podbay --help``) works without it, and ``podbay mcp`` says how to install it.
Errors: an API error in a tool becomes an MCP tool error (``isError``) whose text is ``<code>: <message>``.
"""

from __future__ import annotations

import functools
import hmac
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import typer

from podbay.cli import mcp_tools
from podbay.cli._common import fail, handle_errors, require_key, state
from podbay.errors import PodbayError
from podbay.sdk import AsyncClient

if TYPE_CHECKING:  # the optional extra: imported at run time inside functions only
    from mcp.server.mcpserver import MCPServer

__all__ = ["build_server", "bearer_guard", "mcp_command", "tool_error_text", "TOKEN_ENV", "MCP_PATH"]

#: The environment variable holding the HTTP transport's bearer token (else one is generated at start).
TOKEN_ENV = "PODBAY_MCP_TOKEN"
#: Where the streamable HTTP endpoint answers.
MCP_PATH = "/mcp"

_INSTRUCTIONS = (
    "podbay runs sandboxes: microVMs with a Linux userland that can pause, snapshot, fork and roll back. "
    "Create one with sandbox_create, run commands with exec, move files with read_file/write_file, and "
    "kill it when done. Snapshot before risky steps; rollback restores one, fork branches from one."
)

#: An ASGI application, typed as Starlette types it (scope, receive, send).
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Scope]], Callable[[Scope], Awaitable[None]]], Awaitable[None]]


def tool_error_text(exc: PodbayError) -> str:
    """What a model reads for an API error: ``"<code>: <message>"`` (e.g. ``not_found: sandbox ...``)."""
    return f"{exc.code}: {exc.message}"


def _as_tool(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``fn`` with a ``PodbayError`` turned into the MCP SDK's ``ToolError`` (a tool result with
    ``isError``, not a crash); same signature and docstring, which the SDK reads for the schema."""
    from mcp.server.mcpserver.exceptions import ToolError

    @functools.wraps(fn)
    async def tool(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except PodbayError as exc:
            raise ToolError(tool_error_text(exc)) from exc

    return tool


def _as_resource(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``fn`` with a ``PodbayError`` turned into the SDK's ``ResourceError`` (its message reaches the client)."""
    from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError

    @functools.wraps(fn)
    async def resource(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except PodbayError as exc:
            cls = ResourceNotFoundError if exc.http_status == 404 else ResourceError
            raise cls(tool_error_text(exc)) from exc

    return resource


def build_server(client: AsyncClient) -> MCPServer[Any]:
    """An ``MCPServer`` named ``podbay`` with the tools of ``mcp_tools.TOOL_NAMES`` and the resources
    ``podbay://sandboxes`` and ``podbay://sandboxes/{sandbox_id}/files/{+path}`` over ``client``."""
    from importlib.metadata import PackageNotFoundError, version

    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations

    try:
        ours = version("podbay")
    except PackageNotFoundError:
        ours = "0"
    server: MCPServer[Any] = MCPServer("podbay", instructions=_INSTRUCTIONS, version=ours, log_level="WARNING")
    tools = mcp_tools.SandboxTools(client)
    read_only = {"sandbox_list", "sandbox_get", "read_file", "list_files", "snapshot_list", "port_url"}
    destructive = {"kill", "rollback"}
    for name in mcp_tools.TOOL_NAMES:
        server.add_tool(
            _as_tool(getattr(tools, name)), name=name,
            annotations=ToolAnnotations(read_only_hint=name in read_only, destructive_hint=name in destructive,
                                        open_world_hint=False),
        )
    server.resource(mcp_tools.SANDBOXES_RESOURCE, name="sandboxes", mime_type="application/json",
                    description="This key's sandboxes.")(_as_resource(tools.sandboxes_resource))
    server.resource(mcp_tools.FILE_RESOURCE, name="sandbox-file",
                    description="A file in a sandbox: podbay://sandboxes/{sandbox_id}/files/etc/hostname is "
                    "/etc/hostname (text, or bytes when not UTF-8; the first 256 KiB).")(
        _as_resource(tools.file_resource))
    return server


def bearer_guard(app: ASGIApp, token: str) -> ASGIApp:
    """An ASGI app answering 401 to every HTTP request whose ``Authorization`` is not ``Bearer <token>``
    (compared in constant time), and passing the rest, and non-HTTP scopes (lifespan), to ``app``."""
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


async def _serve(client: AsyncClient, *, http: bool, host: str, port: int, token: str) -> None:
    server = build_server(client)
    try:
        if not http:
            await server.run_stdio_async()
            return
        import uvicorn  # a dependency of mcp

        app = bearer_guard(server.streamable_http_app(streamable_http_path=MCP_PATH, host=host), token)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning")
        await uvicorn.Server(config).serve()
    finally:
        await client.aclose()


@handle_errors
def mcp_command(
    ctx: typer.Context,
    http: bool = typer.Option(False, "--http", help="Serve streamable HTTP instead of stdio."),
    port: int = typer.Option(8765, "--port", min=1, max=65535, help="HTTP port (with --http)."),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP address to bind (with --http)."),
) -> None:
    """Serve podbay's sandboxes as MCP tools (stdio by default; --http for streamable HTTP at /mcp, with a
    bearer token: PODBAY_MCP_TOKEN, else one printed at start). Needs: pip install 'podbay\\[mcp]'."""
    try:
        import anyio
        import mcp.server.mcpserver  # noqa: F401  (checks the extra is installed)
    except ImportError:
        fail("`podbay mcp` needs the mcp package: pip install 'podbay[mcp]'", "unavailable", 1)
    cli = state(ctx)
    require_key(cli)  # every tool call would fail with 401: say so now, as the other commands do
    client = AsyncClient(cli.api_url, cli.api_key)
    token = os.environ.get(TOKEN_ENV) or ""
    if http:
        if not token:
            token = secrets.token_urlsafe(32)
            print(f"podbay mcp: bearer token {token}", file=sys.stderr)
        print(f"podbay mcp: serving http://{host}:{port}{MCP_PATH}", file=sys.stderr, flush=True)
    anyio.run(functools.partial(_serve, client, http=http, host=host, port=port, token=token))
