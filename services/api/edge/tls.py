"""The API's TLS edge: the same ASGI app (port edge, E2B envd routing, routes) over HTTPS on
``PODBAY_API_TLS_PORT`` (docs/operations.md "Ports by hostname").

E2B's SDK gives a guest port as ``{port}-{sandboxID}.{domain}`` (``Sandbox.get_host``) and its users fetch
``https://`` that host. This listener terminates TLS with :class:`podbay.edge_tls.EdgeCertificates` (an
operator's wildcard certificate, or leaves minted per server name from a CA) and hands the requests to the app
in-process, so the port edge (services/api/edge/ports.py) applies exactly as over HTTP: traffic tokens,
``allowPublicTraffic``, ``maskRequestHost``, waking a paused sandbox. The scheme the app sees is ``https``.

Server name (SNI) and Host: the certificate was chosen for the SNI name, and the client checked it against
that name only. A request whose ``Host`` names another host (``8000-sbx_b...`` over a connection opened for
``8000-sbx_a...``) is answered ``421 misdirected_request`` (RFC 9110 §15.5.20) and never reaches the app, over
HTTP and WebSocket alike; a connection without SNI (a client that dialled an address) is served by ``Host``
as usual. Either way access is decided by the Host's sandbox and the credential sent, never by the name the
TLS session was opened for.

Served by uvicorn's own protocol classes (HTTP/1.1 and WebSocket, as on ``PODBAY_API_PORT``), on the API's
loop, started after the app's lifespan and drained with it (services/api/core/serving.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState

from podbay.asgiproxy import deny
from podbay.edge_tls import SNI_ATTR, EdgeCertificates

__all__ = ["TlsEdge", "host_name", "sni_guard"]

log = logging.getLogger("podbay.api.tls")


def host_name(host: str) -> str:
    """The name part of a Host header, lower case, without port or final dot (``[::1]:8443`` -> ``::1``)."""
    if host.startswith("["):
        return host[1:].partition("]")[0].lower()
    name, sep, port = host.rpartition(":")
    if not sep or not port.isdigit():
        name = host
    return name.rstrip(".").lower()


def sni_guard(app: ASGIApp, server_name: str) -> ASGIApp:
    """``app`` for one TLS connection opened for ``server_name`` (``""``: none sent): a request whose Host
    names another host gets 421 ``misdirected_request``; others pass."""
    if not server_name:
        return app

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"host"), "")
            if host_name(host) != server_name:
                body = json.dumps({"error": {"code": "misdirected_request", "message": (
                    f"this connection was opened for {server_name}; open another for the host the request "
                    "names")}}).encode()
                await deny(scope, receive, send, 421, [(b"content-type", b"application/json"),
                                                       (b"content-length", str(len(body)).encode())], body)
                return
        await app(scope, receive, send)

    return guarded


def _server_name(transport: asyncio.BaseTransport) -> str:
    ssl_object = transport.get_extra_info("ssl_object")
    return str(getattr(ssl_object, SNI_ATTR, "") or "") if ssl_object is not None else ""


class _HttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]  # uvicorn picks httptools or h11 at import
    """uvicorn's HTTP protocol whose app is guarded by the connection's SNI name (:func:`sni_guard`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.app = sni_guard(self.__dict__["app"], _server_name(transport))


def _ws_protocol(config: uvicorn.Config) -> type[asyncio.Protocol] | None:
    """uvicorn's WebSocket protocol class for ``config``, guarded likewise (an upgrade builds it from the
    config, not from the HTTP protocol's app)."""
    base = config.ws_protocol_class
    if base is None:
        return None

    class _WsProtocol(base):  # type: ignore[misc,valid-type]  # whichever WebSocket library uvicorn found
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self.app = sni_guard(self.__dict__["app"], _server_name(transport))

    return _WsProtocol


class TlsEdge:
    """The HTTPS listener on ``host:port`` for ``app`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, host: str, port: int, certs: EdgeCertificates, graceful_s: float = 10.0):
        self.addr = (host, port)
        self.certs = certs
        self.graceful_s = graceful_s
        # No lifespan (the main server ran it) and no proxy headers: clients reach this port directly, so an
        # X-Forwarded-* header they send must not change the scheme or client address the app sees.
        self.config = uvicorn.Config(app, host=host, port=port, lifespan="off", proxy_headers=False,
                                     http=_HttpProtocol, log_level="warning", access_log=False,
                                     timeout_graceful_shutdown=int(graceful_s))
        self.state = ServerState()
        self._server: asyncio.AbstractServer | None = None

    def bind(self) -> socket.socket:
        """The listening socket (bound before the app starts, so that a taken port stops the process first).
        Raises OSError."""
        return socket.create_server(self.addr, backlog=2048)

    async def start(self, sock: socket.socket, app_state: dict[str, Any]) -> None:
        """Serve on ``sock`` (from :meth:`bind`) until :meth:`stop`."""
        self.config.load()
        self.config.ws_protocol_class = _ws_protocol(self.config)
        config, state = self.config, self.state

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=state, app_state=app_state)  # type: ignore[call-arg]  # uvicorn's protocol classes take these

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(protocol, sock=sock, ssl=self.certs.context, backlog=2048)
        log.info("HTTPS (TLS edge) on %s:%d", *self.addr)

    async def stop(self) -> None:
        """Stop accepting, ask open connections to finish their request, wait up to ``graceful_s`` for them,
        then cancel what is left."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.state.connections):
            conn.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.graceful_s
        while (self.state.connections or self.state.tasks) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        for task in list(self.state.tasks):
            task.cancel()
        self._server = None
