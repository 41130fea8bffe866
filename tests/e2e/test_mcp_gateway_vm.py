"""E2B's MCP form with real VMs: the unmodified ``e2b`` SDK's ``Sandbox.create(mcp={"time": {}})`` against podbay
(pointed at it as ``podbay env --e2b`` says), on podbay's ``mcp-gateway`` template (templates/mcp-gateway, built
once per module and shared by the operator's key; its slow step comes from the host's build cache after the first
build on a machine). The ``mcp`` client library reaches ``get_mcp_url()`` over the TLS edge with
``get_mcp_token()``, lists the ``time`` server's tools through the gateway and calls one.

Figures, printed and never asserted: create to the first tool call's answer, and a tool call's round trip
(p50/p99 of 20) through the gateway.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the shared template helpers
from mcp_gateway_helpers import build_mcp_gateway, e2b_shell, mcp_session, wait_for_gateway  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

e2b = pytest.importorskip("e2b")
pytest.importorskip("mcp")


@pytest.fixture(scope="module")
def shell(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    build_mcp_gateway(stack)
    with e2b_shell(stack, tmp_path_factory.mktemp("client")) as exports:
        yield exports


async def test_e2b_mcp_form_lists_and_calls_a_pypi_servers_tool(shell: dict[str, str]) -> None:
    t0 = time.monotonic()
    sb = await e2b.AsyncSandbox.create(mcp={"time": {}}, timeout=900)  # template: the SDK's mcp-gateway
    try:
        url, token = sb.get_mcp_url(), await sb.get_mcp_token()
        assert url == f"https://{sb.get_host(50005)}/mcp" and token
        wait_for_gateway(url)
        async with mcp_session(url, token) as mcp:
            first = await mcp.call_tool("get_current_time", {"timezone": "Europe/Paris"})
            create_to_first = time.monotonic() - t0
            assert not first.is_error, first.content
            assert "Europe/Paris" in first.content[0].text
            names = {t.name for t in (await mcp.list_tools()).tools}
            assert {"get_current_time", "convert_time"} <= names, names
            converted = await mcp.call_tool("convert_time", {"source_timezone": "UTC", "time": "12:00",
                                                            "target_timezone": "Asia/Tokyo"})
            assert not converted.is_error and "21:00" in converted.content[0].text, converted.content
            unknown = await mcp.call_tool("no_such_tool", {})
            assert unknown.is_error
            laps = []
            for _ in range(20):
                t1 = time.perf_counter()
                assert not (await mcp.call_tool("get_current_time", {"timezone": "UTC"})).is_error
                laps.append((time.perf_counter() - t1) * 1000)
        laps.sort()
        print(f"\nmcp-gateway: create to first tool call {create_to_first * 1000:.0f} ms; tool call round trip "
              f"p50 {statistics.median(laps):.1f} ms, p99 (max of 20) {laps[-1]:.1f} ms", flush=True)
        # The token file is what a later connect reads (E2B's get_mcp_token on a connected sandbox).
        again = await e2b.AsyncSandbox.connect(sb.sandbox_id)
        assert await again.get_mcp_token() == token
    finally:
        await sb.kill()


async def test_an_unknown_server_fails_the_create(shell: dict[str, str]) -> None:
    with pytest.raises(e2b.SandboxException, match="not in this gateway's catalog"):
        await e2b.AsyncSandbox.create(mcp={"noSuchServer": {}}, timeout=300)
