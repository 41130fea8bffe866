"""The node's port proxy ends the requests relayed to a sandbox when the sandbox leaves the node
(services/nodeagent/net/ports.py ``PortsProxy.left``, the manager's ``on_leave`` hook): a killed guest sends no FIN,
so without it a streamed response (a long ``run_code``, a server-sent stream) or a WebSocket would hang until
TCP gave up. An HTTP response is cut without its last chunk (the client reads a broken stream; E2B's SDKs then
report the sandbox killed), a WebSocket is closed with 1001. A real uvicorn serves the proxy; the guest is a
real TCP server on loopback that sends the start of a response and then nothing."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
import websockets
from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.grants import Grant, GrantKind
from podbay_nodeagent.dataplane.grant_check import SCOPE_KEY
from podbay_nodeagent.net.ports import PortsProxy

SANDBOX = "sbx_left0000000000000001"
OTHER = "sbx_stays000000000000001"


@dataclass
class _Vm:
    generation: int = 1
    stopping: bool = False
    channel: object = object()


@dataclass
class _Lease:
    guest_addr: str


@dataclass
class _Net:
    def leased(self) -> dict[str, _Lease]:
        # Two addresses (each guest address has a connection pool of its own, as on a node).
        return {SANDBOX: _Lease("127.0.0.1"), OTHER: _Lease("127.0.0.2")}


@dataclass
class _Manager:
    """What the proxy reads of the node's sandbox manager: its VMs, leases and on_leave hooks."""

    vms: dict[str, _Vm] = field(default_factory=lambda: {SANDBOX: _Vm(), OTHER: _Vm()})
    net: _Net = field(default_factory=_Net)
    on_leave: list[Callable[[str], None]] = field(default_factory=list)

    def leave(self, sandbox_id: str) -> None:
        self.vms.pop(sandbox_id, None)
        for hook in self.on_leave:
            hook(sandbox_id)


def _granted(app: ASGIApp) -> ASGIApp:
    """The data plane's grant check, reduced to its outcome: a traffic grant for the sandbox in the path."""
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            sid = scope["path"].split("/")[3]
            scope[SCOPE_KEY] = Grant("ten", sid, 1, GrantKind.TRAFFIC, time.time() + 60, "jti")
        await app(scope, receive, send)
    return wrapped


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("only port requests are expected")


async def _hanging_guest(writer_box: list[asyncio.StreamWriter],
                         closed: asyncio.Event | None = None) -> tuple[list[asyncio.Server], int]:
    """A guest HTTP server that answers a chunked 200 with one chunk, then sends nothing (a stream in flight);
    ``closed`` is set when the proxy closes the connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer_box.append(writer)
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        await reader.readexactly(2)  # the body, b"{}"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"9\r\n{\"a\": 1}\n\r\n")
        await writer.drain()
        if await reader.read() == b"" and closed is not None:
            closed.set()
        await asyncio.Event().wait()  # says nothing more

    first = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = first.sockets[0].getsockname()[1]
    return [first, await asyncio.start_server(handle, "127.0.0.2", port)], port


@pytest.fixture
async def node() -> AsyncIterator[tuple[str, _Manager]]:
    """(base URL of a uvicorn serving the ports proxy, the fake manager it reads)."""
    manager = _Manager()
    proxy = PortsProxy(_not_found, manager=manager)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_granted(proxy), lifespan="off", log_level="critical", loop="asyncio"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", manager
    finally:
        server.should_exit = True
        await task
        await proxy.aclose()
        sock.close()


async def _first_line(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        if line:
            return line
    raise AssertionError("no line")


async def test_a_streamed_response_is_cut_when_its_sandbox_leaves(node: tuple[str, _Manager]) -> None:
    url, manager = node
    writers: list[asyncio.StreamWriter] = []
    guests, guest_port = await _hanging_guest(writers)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            headers = {"x-podbay-port-path": "/execute"}
            async with client.stream("POST", f"{url}/internal/ports/{SANDBOX}/{guest_port}", headers=headers,
                                     content=b"{}") as kept, \
                    client.stream("POST", f"{url}/internal/ports/{OTHER}/{guest_port}", headers=headers,
                                  content=b"{}") as stays:
                assert kept.status_code == 200 and stays.status_code == 200
                lines = kept.aiter_lines()
                assert await _first_line(lines) == '{"a": 1}'
                other_lines = stays.aiter_lines()
                assert await _first_line(other_lines) == '{"a": 1}'
                manager.leave(SANDBOX)
                # Bounded only so that a regression fails instead of hanging the suite.
                with pytest.raises(httpx.RemoteProtocolError):
                    await asyncio.wait_for(_first_line(lines), 30)
                # The other sandbox's stream is untouched: still open, nothing more to read yet.
                pending = asyncio.ensure_future(_first_line(other_lines))
                await asyncio.sleep(0.3)
                assert not pending.done()
                pending.cancel()
    finally:
        for w in writers:
            w.close()
        for g in guests:
            g.close()


async def test_a_websocket_is_closed_going_away_when_its_sandbox_leaves(node: tuple[str, _Manager]) -> None:
    url, manager = node
    async def silent(ws: Any) -> None:
        await ws.wait_closed()  # says nothing, as a guest that is gone

    async with websockets.serve(silent, "127.0.0.1", 0) as guest:
        guest_port = next(iter(guest.sockets)).getsockname()[1]
        ws_url = "ws" + url[len("http"):] + f"/internal/ports/{SANDBOX}/{guest_port}"
        async with websockets.connect(ws_url, additional_headers={"x-podbay-port-path": "/"}) as ws:
            manager.leave(SANDBOX)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001


async def test_a_client_that_goes_away_closes_the_guests_connection(node: tuple[str, _Manager]) -> None:
    """uvicorn drops what is sent after the client left without an error: the relay watches for the disconnect
    and closes the guest's connection, so the guest's server notices (E2B's code interpreter then interrupts
    the kernel) instead of streaming into the void for ever."""
    url, _ = node
    writers: list[asyncio.StreamWriter] = []
    closed = asyncio.Event()
    guests, guest_port = await _hanging_guest(writers, closed)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            async with client.stream("POST", f"{url}/internal/ports/{SANDBOX}/{guest_port}", content=b"{}",
                                     headers={"x-podbay-port-path": "/execute"}) as resp:
                assert await _first_line(resp.aiter_lines()) == '{"a": 1}'
        # The client's connection is closed; bounded only so that a regression fails instead of hanging.
        await asyncio.wait_for(closed.wait(), 30)
    finally:
        for w in writers:
            w.close()
        for g in guests:
            g.close()
