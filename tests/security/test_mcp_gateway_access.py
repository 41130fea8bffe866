"""Boundary: a sandbox's MCP gateway (templates/mcp-gateway/gateway.py, port 50005 at /mcp through the port edge)
answers only the bearer token its creator's SDK set (E2B's ``get_mcp_token()``): no token, or the token of
another tenant's gateway, is 401; the token file inside the sandbox is root's (mode 0600), so an unprivileged
process there cannot read it; and another tenant's key cannot reach the sandbox to read it. Real VMs, the
unmodified ``e2b`` SDK and the ``mcp`` client library, over the TLS edge as ``podbay env --e2b`` says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from access_helpers import new_tenant
from mcp_gateway_helpers import build_mcp_gateway, e2b_shell, mcp_session, wait_for_gateway

from podbay.contracts.e2b import to_e2b_key

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

e2b = pytest.importorskip("e2b")
pytest.importorskip("mcp")


@pytest.fixture(scope="module")
def shell(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    build_mcp_gateway(stack)
    with e2b_shell(stack, tmp_path_factory.mktemp("client")) as exports:
        yield exports


async def test_only_the_creators_token_reaches_the_gateway(stack: Any, shell: dict[str, str]) -> None:
    other_key = to_e2b_key(new_tenant(stack, "mcp-other").key)
    mine = await e2b.AsyncSandbox.create(mcp={"time": {}}, timeout=900)
    try:
        theirs = await e2b.AsyncSandbox.create(mcp={"time": {}}, timeout=900, api_key=other_key)
        try:
            url, token = mine.get_mcp_url(), await mine.get_mcp_token()
            their_token = await theirs.get_mcp_token()
            assert token and their_token and token != their_token
            wait_for_gateway(url)
            wait_for_gateway(theirs.get_mcp_url())
            ping = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
            accept = {"Accept": "application/json, text/event-stream"}
            with httpx.Client(timeout=60) as h:  # trust: SSL_CERT_FILE from the exports
                for auth in ({}, {"Authorization": f"Bearer {their_token}"}, {"Authorization": token}):
                    r = h.post(url, json=ping, headers={**accept, **auth})
                    assert r.status_code == 401, (auth, r.status_code, r.text)
                # their gateway does not take my token either
                r = h.post(theirs.get_mcp_url(), json=ping, headers={**accept, "Authorization": f"Bearer {token}"})
                assert r.status_code == 401, r.text
            async with mcp_session(url, token) as mcp:  # and the right one works
                assert "get_current_time" in {t.name for t in (await mcp.list_tools()).tools}
            # the token file: root's only inside the sandbox, and not another tenant's to read
            with pytest.raises(e2b.CommandExitException):
                await mine.commands.run("cat /etc/mcp-gateway/.token", user="user")
            with pytest.raises(e2b.NotFoundException):
                await e2b.AsyncSandbox.connect(mine.sandbox_id, api_key=other_key)
        finally:
            await theirs.kill()
    finally:
        await mine.kill()
