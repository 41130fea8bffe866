"""Webhook deliveries connect to the address they checked (libs/podbay/webhooks.py, "Pinning"): no second
lookup by the HTTP client, so a name re-pointed at a private address after the check (DNS rebinding) does not
move the POST; the receiver still sees the name (Host header; for HTTPS the SNI and the certificate check).

The HTTPS case is real TLS: a server on 127.0.0.1 with a certificate for the webhook's name only, reached
through httpcore with a network backend that records the address each connection asks for (a public-looking
one) and then connects to the local server instead."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from pathlib import Path
from typing import Any

import httpcore
import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from podbay.webhooks import Deliverer, pinned_request, refused_addresses, refused_host

NAME, PUBLIC, INSIDE = "hooks.example.test", "93.184.216.34", "10.0.0.5"


class FakePool:
    def __init__(self) -> None:
        self.updates: list[tuple[Any, ...]] = []

    async def execute(self, sql: str, *args: Any) -> None:
        self.updates.append(args)


def _rebinding_resolver(lookups: list[str]) -> Any:
    """Public at the first lookup of each attempt's check, private at any lookup after it (as a hostile DNS
    server with TTL 0 would answer): only a second lookup could reach the private address."""

    async def resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return [PUBLIC] if len(lookups) == 1 else [INSIDE]

    return resolve


def test_pinned_request_keeps_the_name_for_host_and_sni() -> None:
    url, headers, ext = pinned_request(f"https://{NAME}:8443/hook?x=1", PUBLIC)
    assert (url.host, url.port, url.raw_path) == (PUBLIC, 8443, b"/hook?x=1")
    assert headers == {"Host": f"{NAME}:8443"} and ext == {"sni_hostname": NAME}
    url, headers, ext = pinned_request(f"http://{NAME}/h", "2606:2800:220:1::1")
    assert url.host == "2606:2800:220:1::1" and headers == {"Host": NAME} and ext == {}
    url, headers, ext = pinned_request(f"http://{PUBLIC}:81/h", PUBLIC)  # an IP literal: left as it is
    assert str(url) == f"http://{PUBLIC}:81/h" and headers == {} and ext == {}


def test_a_plain_delivery_goes_to_the_checked_address_with_the_name_as_host() -> None:
    seen: list[httpx.Request] = []
    lookups: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(200)

    pool = FakePool()
    d = Deliverer(pool, bus=None, max_attempts=1, transport=httpx.MockTransport(handler),  # type: ignore[arg-type]
                  resolver=_rebinding_resolver(lookups))
    hook = {"id": "whk_1", "url": f"http://{NAME}:8080/x", "secret": "whsec_s"}
    asyncio.run(d._deliver(hook, b"{}", {"id": "evt_1", "type": "paused"}, 3))  # type: ignore[arg-type]
    assert lookups == [NAME]  # checked once; the client did not look the name up again
    assert len(seen) == 1 and seen[0].url.host == PUBLIC and seen[0].url.port == 8080
    assert seen[0].headers["Host"] == f"{NAME}:8080"
    assert pool.updates[-1][1:4] == (1, 0, 200)


def _pki(d: Path) -> tuple[Path, Path, Path]:
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "webhook test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)  # the name only
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca.public_bytes(pem))
    (d / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (d / "leaf.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    return d / "ca.pem", d / "leaf.pem", d / "leaf.key"


class RecordingBackend(httpcore.AsyncNetworkBackend):
    """Records the (host, port) of every connection and connects to ``target`` instead."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.asked = target, []  # type: ignore[var-annotated]
        self._real = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        self.asked.append((host, port))
        return await self._real.connect_tcp(*self.target, timeout=timeout)

    async def sleep(self, seconds: float) -> None:
        await self._real.sleep(seconds)


class PinnedTestTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport over a connection pool with :class:`RecordingBackend` (TLS verified against
    ``ca``)."""

    def __init__(self, ca: Path, backend: RecordingBackend) -> None:
        super().__init__()
        self._pool = httpcore.AsyncConnectionPool(ssl_context=ssl.create_default_context(cafile=str(ca)),
                                                  network_backend=backend)


async def _https_delivery(tmp_path: Path) -> tuple[list[tuple[str, int]], list[str | None], list[bytes], Any]:
    ca, cert, key = _pki(tmp_path)
    sni: list[str | None] = []
    requests: list[bytes] = []
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    ctx.sni_callback = lambda sock, name, _ctx: sni.append(name)  # type: ignore[assignment, func-returns-value]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((ln.split(b":", 1)[1] for ln in head.split(b"\r\n")
                           if ln.lower().startswith(b"content-length:")), b"0"))
        await reader.readexactly(length)
        requests.append(head)
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    backend = RecordingBackend(("127.0.0.1", port))
    lookups: list[str] = []
    pool = FakePool()
    d = Deliverer(pool, bus=None, max_attempts=1, transport=PinnedTestTransport(ca, backend),  # type: ignore[arg-type]
                  resolver=_rebinding_resolver(lookups))
    hook = {"id": "whk_1", "url": f"https://{NAME}:8443/hook", "secret": "whsec_s"}
    try:
        await d._deliver(hook, b'{"type":"paused"}', {"id": "evt_1", "type": "paused"}, 9)  # type: ignore[arg-type]
    finally:
        server.close()
        await server.wait_closed()
    return backend.asked, sni, requests, pool.updates[-1]


def test_an_https_delivery_connects_to_the_checked_address_and_verifies_the_name(tmp_path: Path) -> None:
    asked, sni, requests, update = asyncio.run(_https_delivery(tmp_path))
    assert asked == [(PUBLIC, 8443)]  # the checked address, never the name (nor the rebound private address)
    assert sni == [NAME]  # the certificate names only NAME: verification passed for the name
    assert len(requests) == 1 and f"host: {NAME}:8443".encode() in requests[0].lower()
    assert update[1:4] == (1, 0, 204), update


def test_nat64_and_6to4_forms_of_private_addresses_are_not_public() -> None:
    for host in ("64:ff9b::a00:1", "64:ff9b::a9fe:a9fe", "2002:a00:1::1"):
        assert refused_host(host) is not None, host
        assert refused_addresses(NAME, [host]) is not None, host
    assert refused_host("64:ff9b::5db8:d822") is None  # NAT64 of 93.184.216.34
