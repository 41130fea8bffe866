"""Client vs node, against a real stack (no microVM needed): the node agent's data plane serves nothing under
/internal without the API's grant for that very sandbox and kind, and the API's envd proxy answers 400 to an
encoded or traversing path without reaching any node.

Grants here are minted with the stack's own signing key (``Stack.grant_signing_key``), as the API mints them.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.devstack.stack import Stack
from podbay.grants import HEADER, GrantKind, GrantSigner, new_keypair
from podbay_api.e2b.common import envd_access_token

SBX_A, SBX_B = "sbx_grant_a", "sbx_grant_b"


def _node(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.ports.node}"


def _grant(stack: Stack, subject: str, kind: GrantKind, gen: int = 1) -> dict[str, str]:
    return {HEADER: GrantSigner(stack.grant_signing_key).mint("tnt_test", subject, gen, kind)}


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


@pytest.mark.parametrize(("method", "path", "kind"), [
    ("POST", f"/internal/v1/sandboxes/{SBX_A}/exec", GrantKind.EXEC),
    ("POST", f"/internal/v1/sandboxes/{SBX_A}/exec/stream", GrantKind.EXEC),
    ("GET", f"/internal/v1/sandboxes/{SBX_A}/files/stat?path=/etc", GrantKind.FILES),
    ("GET", f"/internal/v1/sandboxes/{SBX_A}/ports", GrantKind.PORTS),
    ("POST", f"/internal/v1/sandboxes/{SBX_A}/computer/screenshot", GrantKind.COMPUTER),
    ("POST", f"/internal/v1/sandboxes/{SBX_A}/computer/fill", GrantKind.FILL),
    ("GET", f"/internal/v1/sandboxes/{SBX_A}/snapshots/snp_1/diff/snp_2", GrantKind.DIFF),
    ("POST", f"/internal/e2b/{SBX_A}/process.Process/Start", GrantKind.ENVD),
    ("GET", f"/internal/ports/{SBX_A}/8080", GrantKind.TRAFFIC),
    ("GET", "/internal/v1/templates/building/some-template", GrantKind.BUILD_STATUS),
    ("GET", "/internal/v1/volumes/vol_a/content/file?path=/x", GrantKind.VOLUME),
    ("PUT", "/internal/v1/volumes/vol_a/content/file?path=/x", GrantKind.VOLUME),
])
def test_every_node_route_refuses_a_missing_foreign_or_wrong_kind_grant(
        stack: Stack, method: str, path: str, kind: GrantKind) -> None:
    url = _node(stack) + path
    subject = path.split("/")[4] if "/sandboxes/" in path or "/volumes/" in path else path.split("/")[3]
    if kind == GrantKind.BUILD_STATUS:
        subject = "some-template"
    with httpx.Client(timeout=10) as http:
        # No grant, even with the old shared token.
        r = http.request(method, url, headers={"x-podbay-internal-token": stack.internal_token})
        assert r.status_code == 403 and _code(r) == "grant_refused", r.text
        # A grant for another sandbox (or template).
        r = http.request(method, url, headers=_grant(stack, SBX_B, kind))
        assert r.status_code == 403 and "another" in r.json()["error"]["message"], r.text
        # A grant for this sandbox but another kind of operation.
        other = GrantKind.FILES if kind != GrantKind.FILES else GrantKind.EXEC
        r = http.request(method, url, headers=_grant(stack, subject, other))
        assert r.status_code == 403 and _code(r) == "grant_refused", r.text
        # Signed by another key (a node's, an attacker's): refused.
        forged = {HEADER: GrantSigner(new_keypair()[0]).mint("tnt_test", subject, 1, kind)}
        r = http.request(method, url, headers=forged)
        assert r.status_code == 403 and "signature" in r.json()["error"]["message"], r.text


def test_a_valid_grant_passes_once_and_its_replay_is_refused(stack: Stack) -> None:
    url = f"{_node(stack)}/internal/v1/sandboxes/{SBX_A}/files/stat"
    grant = _grant(stack, SBX_A, GrantKind.FILES)
    with httpx.Client(timeout=10) as http:
        r = http.get(url, params={"path": "/"}, headers=grant)
        # Past the gate: the sandbox is not on this node.
        assert r.status_code == 404 and _code(r) == "not_found", r.text
        r = http.get(url, params={"path": "/"}, headers=grant)
        assert r.status_code == 403 and "already used" in r.json()["error"]["message"], r.text
        # A generation header that is not the grant's is refused too.
        r = http.get(url, params={"path": "/"}, headers={**_grant(stack, SBX_A, GrantKind.FILES, gen=2),
                                                         "x-podbay-generation": "3"})
        assert r.status_code == 403 and "generation" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", [
    "/internal/v1/sandboxes/sbx_grant_a/../sbx_grant_b/exec", "/internal/v1/sandboxes/sbx_grant_a/exec/",
    "/internal/v1/sandboxes/sbx_grant_a//exec", "/internal/v1/nothing", "/internal/e2b/sbx_grant_a/metrics",
    "/internal/e2b/sbx_grant_a/%2e%2e/sbx_grant_b/files", "/internal/", "/internal/v1/templates/build",
])
def test_unknown_or_traversing_internal_paths_are_refused(stack: Stack, path: str) -> None:
    with socket.create_connection(("127.0.0.1", stack.ports.node), timeout=10) as s:
        grant = _grant(stack, SBX_A, GrantKind.EXEC)[HEADER]
        s.sendall(f"POST {path} HTTP/1.1\r\nhost: node\r\n{HEADER}: {grant}\r\ncontent-length: 0\r\n"
                  "connection: close\r\n\r\n".encode())
        status = s.recv(4096).split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 403"), (path, status)


def test_health_is_open_and_metrics_need_the_internal_token(stack: Stack) -> None:
    with httpx.Client(base_url=_node(stack), timeout=10) as http:
        assert http.get("/healthz").status_code == 200
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"x-podbay-internal-token": "wrong"}).status_code == 401
        assert http.get("/metrics", headers={"x-podbay-internal-token": stack.internal_token}).status_code == 200
        assert http.get("/metrics", headers={"authorization": f"Bearer {stack.internal_token}"}).status_code == 401
        assert http.get("/openapi.json").status_code == 404


@pytest.fixture()
def recording_node() -> Iterator[tuple[str, list[bytes]]]:
    """A stand-in node data plane that records every request line it gets and answers 200 ``{}``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    seen: list[bytes] = []
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
                seen.append(data.split(b"\r\n", 1)[0])
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
                             b"connection: close\r\n\r\n{}")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", seen
    finally:
        done.set()
        thread.join(5)
        srv.close()


@pytest.fixture()
def envd_sandbox(stack: Stack, recording_node: tuple[str, list[bytes]]) -> Iterator[tuple[Tenant, str, list[bytes]]]:
    """A tenant's ``running`` sandbox row placed on the recording node."""
    url, seen = recording_node
    tenant = new_tenant(stack, "grant")
    node, sbx, tpl = f"node-grant-{secrets.token_hex(3)}", f"sbx_{secrets.token_hex(10)}", f"grt-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1, $2, 1024, 1, 'tcg')",
        node, url)
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'sha256:none', 256, 1)", tpl)
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname, node_id, generation) VALUES ($1, $2, $3, 'sha256:none', 'running', 'running', 256, 1,"
        " 'h', $4, 1)", sbx, tenant.tenant_id, tpl, node)
    try:
        yield tenant, sbx, seen
    finally:
        sql(stack, "DELETE FROM sandboxes WHERE id=$1", sbx)
        sql(stack, "DELETE FROM nodes WHERE id=$1", node)


_TRAVERSALS = [
    "/../sbx_other/process.Process/Start", "/..%2fsbx_other/process.Process/Start", "/%2e%2e/%2e%2e/metrics",
    "/%252e%252e/sbx_other/files", "/..\\sbx_other/files", "/files/../../../internal/v1/sandboxes/x/exec",
    "//files", "/./files", "/files%00", "/fi%6ces", "/process.Process/Start/..", "/%2fprocess.Process/Start",
    "/process.Process/../../v1/sandboxes/sbx_other/exec", "/files;/../x",
]


def _raw_post(stack: Stack, path: str, headers: dict[str, str]) -> bytes:
    """The status line the API answers to ``POST path`` sent byte for byte (no client normalisation)."""
    port = int(stack.api_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST {path} HTTP/1.1\r\nhost: api\r\n{head}content-type: application/json\r\n"
                  "content-length: 2\r\nconnection: close\r\n\r\n{}".encode("latin-1"))
        return s.recv(4096).split(b"\r\n", 1)[0]


def test_envd_traversals_answer_400_and_never_reach_the_node(
        stack: Stack, envd_sandbox: tuple[Tenant, str, list[bytes]]) -> None:
    _, sbx, seen = envd_sandbox
    token = envd_access_token(stack.internal_token, sbx)
    for path in _TRAVERSALS:
        for via_header, raw in ((True, path), (False, f"/e2b/envd/{sbx}{path}")):
            headers = {"x-access-token": token, **({"e2b-sandbox-id": sbx} if via_header else {})}
            status = _raw_post(stack, raw, headers)
            assert status.startswith(b"HTTP/1.1 400"), (raw, via_header, status)
    assert seen == [], seen
    # A well-formed envd call does reach the node, at the allow-listed route of this sandbox, with a grant.
    status = _raw_post(stack, "/filesystem.Filesystem/Stat?x=%2e%2e", {"x-access-token": token, "e2b-sandbox-id": sbx})
    assert status.startswith(b"HTTP/1.1 200"), status
    assert seen == [f"POST /internal/e2b/{sbx}/filesystem.Filesystem/Stat?x=.. HTTP/1.1".encode()] or \
        seen == [f"POST /internal/e2b/{sbx}/filesystem.Filesystem/Stat?x=%2E%2E HTTP/1.1".encode()], seen
