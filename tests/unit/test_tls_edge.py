"""The API's TLS edge (services/api/edge/tls.py, podbay.edge_tls) in front of a stand-in app: certificates
minted per server name from a CA, an operator's certificate, the SNI/Host rule, and the scheme the app sees.
Real TLS handshakes over loopback with Python's ssl module (OpenSSL), as E2B's SDK and httpx make them."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from podbay.edge_tls import EdgeCertificates, domain_host, ensure_dev_ca, mint_leaf, write_trust_bundle
from podbay_api.edge.ports_access import parse_host
from podbay_api.edge.tls import TlsEdge, host_name

SID = "sbx_3f2a9c01b7d4e5f60718"
NAME = f"8000-{SID}.e2b.localhost"


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with its scheme and Host as JSON."""
    if scope["type"] != "http":
        return
    host = dict(scope["headers"]).get(b"host", b"").decode()
    body = json.dumps({"scheme": scope["scheme"], "host": host}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[tuple[int, Path]]:
    ca_cert, ca_key = ensure_dev_ca(tmp_path)
    certs = EdgeCertificates(domains=["e2b.localhost", "localhost"], ca_cert_file=ca_cert, ca_key_file=ca_key)
    tls = TlsEdge(_echo, "127.0.0.1", 0, certs, graceful_s=1)  # type: ignore[arg-type]
    sock = tls.bind()
    await tls.start(sock, {})
    yield sock.getsockname()[1], ca_cert
    await tls.stop()


WS_UPGRADE = ("Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
              "Sec-WebSocket-Version: 13\r\n")


async def _get(port: int, ctx: ssl.SSLContext, server_name: str | None, host: str,
               extra: str = "Connection: close\r\n") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=server_name or "")
    writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


async def test_a_name_with_an_underscore_gets_its_own_certificate_and_the_app_sees_https(
        edge: tuple[int, Path]) -> None:
    port, ca = edge
    status, body = await _get(port, _trusting(ca), NAME, f"{NAME}:{port}")
    assert status == 200 and json.loads(body) == {"scheme": "https", "host": f"{NAME}:{port}"}


async def test_host_naming_another_sandbox_than_the_server_name_is_misdirected(edge: tuple[int, Path]) -> None:
    port, ca = edge
    other = f"8000-sbx_00000000000000000000.e2b.localhost:{port}"
    status, body = await _get(port, _trusting(ca), NAME, other)
    assert status == 421 and json.loads(body)["error"]["code"] == "misdirected_request"
    # A WebSocket handshake likewise (it is served by another protocol object than plain requests).
    status, body = await _get(port, _trusting(ca), NAME, other, WS_UPGRADE)
    assert status == 421 and b"misdirected_request" in body
    # Case and a final dot are the same name.
    status, _ = await _get(port, _trusting(ca), NAME, NAME.upper() + ".")
    assert status == 200


async def test_names_outside_the_domains_get_no_certificate(edge: tuple[int, Path]) -> None:
    port, ca = edge
    with pytest.raises(ssl.SSLCertVerificationError):
        await _get(port, _trusting(ca), "example.com", "example.com")
    # Without verification, a client that sent no server name is served by Host.
    loose = ssl.create_default_context()
    loose.check_hostname, loose.verify_mode = False, ssl.CERT_NONE
    status, body = await _get(port, loose, None, NAME)
    assert status == 200 and json.loads(body)["host"] == NAME


async def test_the_dev_ca_cannot_vouch_for_names_outside_localhost(tmp_path: Path) -> None:
    ca_cert, ca_key = ensure_dev_ca(tmp_path)
    key_pem, chain_pem = mint_leaf(ca_key.read_bytes(), ca_cert.read_bytes(), ["api.example.com"])
    (tmp_path / "k.pem").write_bytes(key_pem)
    (tmp_path / "c.pem").write_bytes(chain_pem)
    certs = EdgeCertificates(domains=["example.com"], cert_file=tmp_path / "c.pem", key_file=tmp_path / "k.pem")
    tls = TlsEdge(_echo, "127.0.0.1", 0, certs, graceful_s=1)  # type: ignore[arg-type]
    sock = tls.bind()
    await tls.start(sock, {})
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="constraint|permitted"):
            await _get(sock.getsockname()[1], _trusting(ca_cert), "api.example.com", "api.example.com")
    finally:
        await tls.stop()
    # The CA is kept: a second call returns the same files, unchanged.
    before = ca_cert.read_bytes()
    assert ensure_dev_ca(tmp_path) == (ca_cert, ca_key) and ca_cert.read_bytes() == before


async def test_an_operators_certificate_is_served_for_every_name(tmp_path: Path) -> None:
    ca_cert, ca_key = ensure_dev_ca(tmp_path)
    key_pem, chain_pem = mint_leaf(ca_key.read_bytes(), ca_cert.read_bytes(), ["*.ports.localhost"])
    (tmp_path / "k.pem").write_bytes(key_pem)
    (tmp_path / "c.pem").write_bytes(chain_pem)
    certs = EdgeCertificates(domains=["ports.localhost"], cert_file=tmp_path / "c.pem", key_file=tmp_path / "k.pem")
    tls = TlsEdge(_echo, "127.0.0.1", 0, certs, graceful_s=1)  # type: ignore[arg-type]
    sock = tls.bind()
    await tls.start(sock, {})
    try:
        name = "8000-sbx-3f2a9c01b7d4e5f60718.ports.localhost"  # podbay's own host form: no '_', so a wildcard fits
        status, _ = await _get(sock.getsockname()[1], _trusting(ca_cert), name, name)
        assert status == 200
    finally:
        await tls.stop()


def test_trust_bundle_holds_the_system_roots_and_the_stack_ca(tmp_path: Path) -> None:
    ca_cert, _ = ensure_dev_ca(tmp_path)
    bundle = write_trust_bundle(tmp_path / "trust.pem", ca_cert)
    text = bundle.read_bytes()
    assert text.endswith(ca_cert.read_bytes()) and text.count(b"BEGIN CERTIFICATE") > 10
    ssl.create_default_context(cafile=str(bundle))  # loads


def test_domains_with_a_port_and_host_names() -> None:
    assert domain_host("e2b.localhost:8443") == "e2b.localhost" and domain_host("E2B.example") == "e2b.example"
    assert parse_host(f"{NAME}:8443", "e2b.localhost:8443") == (8000, SID)
    assert parse_host(f"{NAME}", "e2b.localhost:8443") == (8000, SID)
    assert parse_host(f"{NAME}", "other.localhost:8443") is None
    assert host_name("[::1]:8443") == "::1" and host_name("A.Example.:443") == "a.example"
    assert host_name("a.example") == "a.example"


def test_the_api_refuses_to_start_a_tls_port_without_certificates(capsys: pytest.CaptureFixture[str]) -> None:
    from podbay.config import Settings
    from podbay_api.main import _edge_certificates

    assert _edge_certificates(Settings(api_tls_port=None)) is None
    with pytest.raises(SystemExit) as exc:
        _edge_certificates(Settings(api_tls_port=8443))
    assert exc.value.code == 2 and "PODBAY_API_TLS_CA_CERT_FILE" in capsys.readouterr().err


def test_the_api_mints_for_its_e2b_and_ports_domains(tmp_path: Path) -> None:
    from podbay.config import Settings
    from podbay_api.main import _edge_certificates

    ca_cert, ca_key = ensure_dev_ca(tmp_path)
    certs = _edge_certificates(Settings(api_tls_port=8443, e2b_domain="e2b.localhost:8443", ports_domain="localhost",
                                        api_tls_ca_cert_file=ca_cert, api_tls_ca_key_file=ca_key))
    assert certs is not None and certs.domains == ["e2b.localhost", "localhost"]
    assert certs.context_for(NAME) is not None and certs.context_for("example.com") is None
