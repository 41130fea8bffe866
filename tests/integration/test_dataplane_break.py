"""An exec stream whose node breaks off mid-answer, through the real API (no microVM: the node is a socket).

The node agent can die while it streams an exec's output (a crash, a kill). The API has already sent its
status line, so it must say so in the body: the NDJSON stream ends with an ``error`` event (``unavailable``),
which the SDK raises as ``Unavailable``, rather than a torn chunked body and a traceback in the API's log.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Iterator

import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.devstack.stack import Stack
from podbay.errors import Unavailable
from podbay.sdk import Client

pytestmark = pytest.mark.integration


@pytest.fixture()
def breaking_node() -> Iterator[str]:
    """A node data plane that answers any request with a 200 NDJSON stream's first event, then closes the
    connection without the chunked body's end (as a node agent killed mid-stream does). Yields its URL."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                line = b'{"type":"start","pid":7}\n'
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + f"{len(line):x}\r\n".encode() + line + b"\r\n")
                conn.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        done.set()
        thread.join(5)
        srv.close()


@pytest.fixture()
def running_on(stack: Stack, breaking_node: str) -> Iterator[tuple[Tenant, str]]:
    """A tenant and a ``running`` sandbox row placed on the breaking node."""
    tenant = new_tenant(stack, "break")
    node, sbx, tpl = f"node-break-{secrets.token_hex(3)}", f"sbx_{secrets.token_hex(12)}", f"brk-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1, $2, 1024, 1, 'tcg')",
        node, breaking_node)
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'sha256:none', 256, 1)", tpl)
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname, node_id, generation) VALUES ($1, $2, $3, 'sha256:none', 'running', 'running', 256, 1,"
        " 'h', $4, 1)", sbx, tenant.tenant_id, tpl, node)
    try:
        yield tenant, sbx
    finally:
        sql(stack, "DELETE FROM sandboxes WHERE id=$1", sbx)
        sql(stack, "DELETE FROM nodes WHERE id=$1", node)


def test_an_exec_stream_broken_off_by_its_node_ends_with_an_unavailable_event(
        running_on: tuple[Tenant, str]) -> None:
    tenant, sbx = running_on
    with tenant.http() as http, http.stream("POST", f"/v1/sandboxes/{sbx}/exec/stream",
                                            json={"argv": ["true"]}) as resp:
        assert resp.status_code == 200
        lines = [json.loads(line) for line in resp.iter_lines() if line.strip()]
    assert lines[0] == {"type": "start", "pid": 7}
    assert lines[-1]["type"] == "error" and lines[-1]["error"]["code"] == "unavailable", lines
    assert "may still be running" in lines[-1]["error"]["message"]

    client = Client(api_url=tenant.api_url, api_key=tenant.key)
    with pytest.raises(Unavailable) as info:
        list(client.exec_stream(sbx, ["true"]))
    assert info.value.retryable
