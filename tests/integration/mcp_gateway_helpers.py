"""The ``mcp-gateway`` template (templates/mcp-gateway) for the tests that need it with real VMs: how it is built
(one set of inputs, so the e2e and security modules share one cached build) and how a test reaches a sandbox's
gateway with the ``mcp`` client library, the way E2B's docs say (``get_mcp_url()``, bearer ``get_mcp_token()``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator

import pytest

from podbay.sdk import Client

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates" / "mcp-gateway"
NAME = "mcp-gateway"
#: What the RUN step needs: Debian's mirror (python3-venv) and the package index with its file host, over TLS.
EGRESS = {"allow": [{"domain": "deb.debian.org", "ports": [80]}, {"domain": "pypi.org", "ports": [443]},
                    {"domain": "files.pythonhosted.org", "ports": [443]}]}
MEMORY_MIB = 512
DISK_MIB = 2048


def build_mcp_gateway(stack: Any) -> None:
    """Build the template on ``stack`` by its dev key (the operator's, so it is shared with every tenant); the
    build's events are printed (a long build's progress) and its duration."""
    def show(e: Any) -> None:
        print(e.model_dump_json(exclude_none=True), flush=True)

    with Client(stack.api_url, stack.api_key, timeout_s=3600) as c:
        t0 = time.monotonic()
        tpl = c.build_template(NAME, TEMPLATE_DIR / "Dockerfile", TEMPLATE_DIR, egress=EGRESS,
                               memory_mib=MEMORY_MIB, disk_mib=DISK_MIB, on_event=show)
        print(f"{NAME} build: {time.monotonic() - t0:.1f} s", flush=True)
        assert tpl.memory_mib == MEMORY_MIB


@contextmanager
def e2b_shell(stack: Any, tmp: Path) -> Iterator[dict[str, str]]:
    """``eval "$(podbay env --e2b)"`` for the stack's key: the real CLI's exports (E2B_*, SSL_CERT_FILE for the
    TLS edge) set in this process's environment while the context is open."""
    import os

    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({"api_url": stack.api_url, "api_key": stack.api_key, **stack.edge_client()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODBAY_API_", "E2B_"))}
    env["PODBAY_CONFIG"] = str(cfg)
    out = subprocess.run([str(Path(sys.executable).with_name("podbay")), "env", "--e2b"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    exports = dict(shlex.split(line)[1].split("=", 1) for line in out.splitlines() if line.startswith("export "))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in exports.items():
            mp.setenv(k, v)
        yield exports


def wait_for_gateway(url: str, timeout_s: float = 300) -> None:
    """Until the gateway itself answers at ``url`` (its 401 to a request without the token; the port edge's
    answer while nothing listens is another status): the ``mcp-gateway`` command returns before the gateway
    listens when its start takes longer than the command's wait (under emulation)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.post(url, json={}, timeout=30).status_code == 401:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the gateway at {url} did not answer"
        time.sleep(1)


@asynccontextmanager
async def mcp_session(url: str, token: str | None) -> AsyncIterator[Any]:
    """An ``mcp`` client over streamable HTTP to ``url``, with ``Authorization: Bearer <token>`` (none when
    ``token`` is None)."""
    from mcp import Client as McpClient
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"} if token is not None else None)
    async with http, McpClient(streamable_http_client(url, http_client=http)) as session:
        yield session
