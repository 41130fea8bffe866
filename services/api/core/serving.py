"""How the API process serves its ASGI app (docs/operations.md, "Ports").

* ``PODBAY_API_PORT``: uvicorn (HTTP/1.1 with keep-alive, WebSocket), as always.
* ``PODBAY_API_H2_PORT`` (optional): the same app object, in the same process and loop, under Hypercorn as
  well, which also speaks HTTP/2 in cleartext (h2c: by prior knowledge or by ``Upgrade: h2c``). Clients that
  want HTTP/2 at the port edge, and TLS terminators that speak h2c to their upstream, use this port.
* ``PODBAY_API_TLS_PORT`` (optional): the same app over HTTPS (:mod:`.tls_edge`), for E2B's
  ``https://{port}-{sandboxID}.{domain}`` addresses; started and drained like the HTTP/2 listener.

Why two servers rather than Hypercorn alone: every test and deployment runs the API under uvicorn, whose
behaviour (WebSocket, streaming both ways, shutdown) the suite pins; the HTTP/2 listener is an addition that
leaves that path untouched. The app's lifespan runs once, under uvicorn: Hypercorn starts after it (its
requests find ``app.state.ctx`` set) and gets a lifespan that only acknowledges. On SIGTERM/SIGINT (caught by
uvicorn) both stop accepting and drain their requests, each for up to ``graceful_s``; the app's lifespan
shutdown follows uvicorn's drain.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

import uvicorn
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.edge_tls import EdgeCertificates

from ..edge.tls import TlsEdge

__all__ = ["serve"]

log = logging.getLogger("podbay.api.serving")


def _without_lifespan(app: ASGIApp) -> ASGIApp:
    """``app`` for a second server: lifespan events are acknowledged, not passed (uvicorn already ran them)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    return wrapped


class _Server(uvicorn.Server):
    """uvicorn's server that also runs a Hypercorn listener between its startup and shutdown."""

    def __init__(self, config: uvicorn.Config, app: ASGIApp, h2_host: str, h2_port: int | None, graceful_s: float,
                 tls: TlsEdge | None = None) -> None:
        super().__init__(config)
        self._h2_app = _without_lifespan(app)
        self._h2_addr = (h2_host, h2_port or 0)
        self._h2_on = h2_port is not None
        self._tls = tls
        self._graceful_s = graceful_s
        self._h2_stop = asyncio.Event()
        self._h2_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        tls_sock = None
        if self._tls is not None:
            try:  # bound first too: a taken port stops the process before the app starts
                tls_sock = self._tls.bind()
            except OSError as exc:
                log.error("cannot listen on %s:%d for HTTPS: %s", *self._tls.addr, exc)
                sys.exit(1)
        if not self._h2_on:
            await super().startup(sockets)
            if tls_sock is not None:
                await self._start_tls(tls_sock)
            return
        try:  # bound first, so that a taken port stops the process before the app starts
            sock = socket.create_server(self._h2_addr, backlog=2048)
        except OSError as exc:
            log.error("cannot listen on %s:%d for HTTP/2: %s", *self._h2_addr, exc)
            sys.exit(1)
        await super().startup(sockets)
        if tls_sock is not None:
            await self._start_tls(tls_sock)
        if self.should_exit:
            sock.close()
            return
        cfg = HypercornConfig()
        cfg.bind = [f"fd://{sock.detach()}"]  # Hypercorn takes the descriptor over
        cfg.graceful_timeout = self._graceful_s
        cfg.include_server_header = False  # the guest's own Server header passes through the edge
        cfg.accesslog = None
        cfg.errorlog = logging.getLogger("hypercorn.error")
        self._h2_task = asyncio.create_task(hypercorn_serve(self._h2_app, cfg,  # type: ignore[arg-type]  # Hypercorn's ASGI type is its own protocol
                                                            shutdown_trigger=self._h2_stop.wait))
        self._h2_task.add_done_callback(self._h2_ended)
        log.info("HTTP/2 (h2c) and HTTP/1.1 on %s:%d", *self._h2_addr)

    async def _start_tls(self, sock: socket.socket) -> None:
        assert self._tls is not None
        if self.should_exit:
            sock.close()
            return
        await self._tls.start(sock, self.lifespan.state)

    def _h2_ended(self, task: asyncio.Task[None]) -> None:
        """A listener that ends before shutdown was asked for stops the whole process (so that a supervisor
        restarts it) rather than leave it serving one port of two."""
        if self._h2_stop.is_set() or task.cancelled():
            return
        log.error("the HTTP/2 listener ended unasked (%r): stopping", task.exception())
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._h2_stop.set()  # all drain at once
        if self._tls is not None:  # drained before uvicorn's shutdown, which ends with the app's lifespan
            await self._tls.stop()
        await super().shutdown(sockets)
        if self._h2_task is not None:
            try:
                await asyncio.wait_for(self._h2_task, self._graceful_s + 5)
            except Exception:  # noqa: BLE001 - shutting down: a listener's error is logged, not raised
                log.exception("the HTTP/2 listener ended with an error")


def serve(app: ASGIApp, *, host: str, port: int, h2_port: int | None, graceful_s: float = 10.0,
          tls_port: int | None = None, tls_certs: EdgeCertificates | None = None) -> None:
    """Serve ``app`` on ``host:port`` (uvicorn) and, when ``h2_port`` is given, on ``host:h2_port`` (Hypercorn)
    too, and when ``tls_port`` and ``tls_certs`` are, over HTTPS on ``host:tls_port`` (:mod:`.tls_edge`), in one
    uvloop loop, until SIGTERM/SIGINT. Exits 1 when a port cannot be bound."""
    opts = {"host": host, "port": port, "loop": "uvloop", "log_level": "warning", "access_log": False,
            "timeout_graceful_shutdown": int(graceful_s)}
    tls = TlsEdge(app, host, tls_port, tls_certs, graceful_s) if tls_port and tls_certs else None
    if h2_port is None and tls is None:
        uvicorn.run(app, **opts)  # type: ignore[arg-type]  # opts is a dict of mixed value types
        return
    server = _Server(uvicorn.Config(app, **opts), app, host, h2_port, graceful_s, tls)  # type: ignore[arg-type]  # opts: mixed types
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as uvicorn.run exits
