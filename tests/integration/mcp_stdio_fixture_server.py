"""A small stdio MCP server for the gateway's host tests (tests/integration/test_mcp_gateway.py), standing in for a
catalog server: its tools are ``get_current_time`` (named as the ``time`` server's, so two of it collide) and
``argv`` (the arguments the gateway started it with). Run as ``python mcp_stdio_fixture_server.py [args...]``."""

from __future__ import annotations

import os
import sys

from mcp.server.mcpserver import MCPServer

server: MCPServer = MCPServer("fixture")


@server.tool()
def get_current_time(timezone: str) -> str:
    """A fixed answer naming ``timezone`` (no clock: the test compares it)."""
    return f"12:00 in {timezone}"


@server.tool()
def argv() -> str:
    """The server's command-line arguments and its FIXTURE_TAG variable, space-separated."""
    return " ".join([*sys.argv[1:], os.environ.get("FIXTURE_TAG", "")]).strip()


if __name__ == "__main__":
    server.run()
