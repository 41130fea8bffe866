"""Guest ports on this node: the last hop of the API edge's port proxy, and the guest's listening ports.

The API's edge (services/api/edge/ports.py) authorises a request for ``{port}-{sandbox}.{domain}`` and sends it
here as ``/internal/ports/{sandbox_id}/{port}`` with a ``traffic`` grant (podbay.grants), the generation it saw and the guest's
path in ``x-podbay-port-path`` (and, for E2B's ``maskRequestHost``, the ``Host`` the guest is to see in
``x-podbay-port-host``; otherwise it sees the client's). This
module (plain ASGI, ahead of the data-plane app's middleware so that nothing buffers) checks both, then relays
the request to ``http://<guest address>:<port><path>`` on the sandbox's tap (its /30, services/nodeagent/net/network.py):

* HTTP/1.1: request and response bodies are streamed chunk by chunk both ways (bounded by the transport's
  flow control, never read whole); keep-alive connections to the guest are pooled per address. A guest that
  refuses the connection (nothing listens) answers 502 ``port_not_open`` with ``x-podbay-port-error``, so the
  edge can render it; a listener that starts later is reached on the next request, with nothing to register.
* WebSocket: the upstream handshake happens first (so the guest's chosen subprotocol is the one accepted),
  then messages are relayed both ways until either side closes; the close code is passed on.

Libraries: ``httpx`` for HTTP (already the API's client to nodes; ``send(stream=True)`` with ``aiter_raw``
relays bytes as they come, content encodings untouched, and its transport takes socket options), and
``websockets`` (the asyncio client, the same library uvicorn serves WebSockets with) for upgrades. aiohttp
would do both but would be a second HTTP stack beside httpx in the same process.

Every connection to a guest is opened with ``SO_MARK`` = :data:`PORTS_MARK`: the node's nftables ruleset
(services/nodeagent/net/netfilter.py) refuses any other new TCP connection from the host into a tap, and accepts
from a tap only the replies to such connections, so this proxy is the only way in, and it only ever reaches
the port the edge asked for on the sandbox the edge authorised.

Listening ports (``GET /internal/v1/sandboxes/{id}/ports``) are read from the guest's ``/proc/net/tcp`` and
``/proc/net/tcp6`` through guestd's file read (no guestd change, no template rebuild): :func:`parse_proc_net_tcp`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpcore
import httpx
from anyio.abc import SocketStream
from httpcore._backends.anyio import AnyIOStream  # httpcore's own anyio stream wrapper
from starlette.types import ASGIApp, Receive, Scope, Send

from podbay.asgiproxy import Answer, deny, forwarded_headers, json_error, relay_response, relay_websocket, request_body
from podbay.errors import PodbayError, Unavailable
from podbay.grants import GrantKind

from ..dataplane.grant_check import SCOPE_KEY as GRANT_SCOPE_KEY
from .netfilter import PORTS_MARK

if TYPE_CHECKING:
    from ..computer.cdp_mask import RelayFilter
    from ..ops.sandboxes import SandboxManager

__all__ = ["PortsProxy", "PREFIX", "PATH_HEADER", "HOST_HEADER", "Listener", "parse_proc_net_tcp", "listening_ports",
           "guest_http_client", "connect_guest"]

log = logging.getLogger("podbay.nodeagent.ports")

PREFIX = "/internal/ports/"
CONNECT_TIMEOUT_S = 5.0
#: Bound of reading the guest's listening sockets to explain a refused connection (seconds).
LISTENERS_TIMEOUT_S = 2.0
#: Request header with the guest's path and query (``/a/b?c=d``), as the client sent them.
PATH_HEADER = "x-podbay-port-path"
#: Request header with the ``Host`` the guest sees instead of the client's (E2B's ``maskRequestHost``).
HOST_HEADER = "x-podbay-port-host"


def _guest_host(headers: dict[bytes, bytes]) -> str:
    """The ``Host`` an HTTP request reaches the guest with: the edge's mask, else the client's host."""
    raw = headers.get(HOST_HEADER.encode()) or headers.get(b"x-forwarded-host", headers.get(b"host", b""))
    return raw.decode("latin-1")


class Listener(dict[str, Any]):
    """``{"port": int, "address": str, "family": "ipv4"|"ipv6"}`` of one listening TCP socket."""


def parse_proc_net_tcp(text: str, *, ipv6: bool) -> list[Listener]:
    """The LISTEN sockets (state ``0A``) of a ``/proc/net/tcp`` or ``/proc/net/tcp6`` text; malformed lines
    are skipped (the text comes from the untrusted guest)."""
    out: list[Listener] = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != "0A" or ":" not in parts[1]:
            continue
        addr_hex, _, port_hex = parts[1].rpartition(":")
        try:
            port = int(port_hex, 16)
            raw = bytes.fromhex(addr_hex)
            if ipv6 and len(raw) == 16:
                # Four host-order 32-bit words.
                addr = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
            elif not ipv6 and len(raw) == 4:
                addr = str(ipaddress.IPv4Address(raw[::-1]))
            else:
                continue
        except ValueError:
            continue
        if 0 < port <= 65535:
            out.append(Listener(port=port, address=addr, family="ipv6" if ipv6 else "ipv4"))
    return out


def not_open_message(port: int, listeners: list[Listener]) -> str:
    """What a client is told when the guest refused the connection to ``port``, given the guest's
    ``listeners``: that only loopback addresses listen on it (and how to fix that), or that nothing does."""
    local = sorted({item["address"] for item in listeners if item["port"] == port})
    if local and all(ipaddress.ip_address(a).is_loopback for a in local):
        return (f"port {port} listens only on {', '.join(local)} in the sandbox, which is not reachable from "
                f"outside it; bind the server to 0.0.0.0 (or ::) instead")
    return f"nothing listens on port {port} in the sandbox (connection refused)"


async def listening_ports(channel: Any) -> list[Listener]:
    """The guest's listening TCP ports, sorted by port then address, read over ``channel`` (guestd's file
    read of ``/proc/net/tcp`` and ``/proc/net/tcp6``; a missing file counts as none)."""
    seen: dict[tuple[int, str], Listener] = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        buf = bytearray()
        try:
            async for chunk in channel.read_file(path):
                buf += chunk
                if len(buf) > 4 << 20:  # an untrusted guest: a bound on what we parse
                    break
        except PodbayError as exc:
            if exc.code != "not_found":
                raise
            continue
        for item in parse_proc_net_tcp(buf.decode(errors="replace"), ipv6=v6):
            seen[(item["port"], item["address"])] = item
    return [seen[k] for k in sorted(seen)]


def _marked_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    with contextlib.suppress(OSError):  # unprivileged (tests): no mark, and no ruleset to need one
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, PORTS_MARK)
    return sock


async def connect_guest(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A TCP connection to a guest, marked so that the node's ruleset lets it in (blocking mode, for a library
    that drives it on the loop itself, as ``websockets`` does). Raises ``OSError`` or ``TimeoutError``."""
    sock = _marked_socket(host, port)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout_s)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(True)
    return sock


def guest_http_client() -> httpx.AsyncClient:
    """An HTTP client for guests' ports: every connection marked (:data:`PORTS_MARK`) before it connects, no
    proxy settings of the node's environment, no redirects followed, connects bounded by
    :data:`CONNECT_TIMEOUT_S`."""
    transport = httpx.AsyncHTTPTransport()
    # httpx has no seam for a connection's socket, and its socket_options are applied after connect(),
    # too late for the SYN that nftables judges: its pool is swapped for one on a backend that marks
    # sockets before connecting (the pool is httpx's documented engine, httpcore).
    transport._pool = httpcore.AsyncConnectionPool(
        max_connections=1000, max_keepalive_connections=100, keepalive_expiry=30,
        network_backend=_MarkedBackend())
    # trust_env=False: the node's proxy settings must never route guest traffic elsewhere.
    return httpx.AsyncClient(transport=transport, trust_env=False, follow_redirects=False,
                             timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))


class SandboxLeft(Exception):
    """A response from a guest was cut short because its sandbox left the node (deleted, failed, moved):
    raised after the response started, so that the server closes the connection without the last chunk."""


class _Refused(Exception):
    def __init__(self, answer: Answer) -> None:
        super().__init__(answer[0])
        self.answer = answer


class PortsProxy:
    """ASGI middleware: ``/internal/ports/{sandbox_id}/{port}`` (HTTP and WebSocket) to the guest;
    every other request goes to ``app``."""

    def __init__(self, app: ASGIApp, manager: SandboxManager,
                 relay_filter: Callable[[str], Awaitable[RelayFilter]] | None = None) -> None:
        self.app = app
        self.manager = manager
        # sandbox id -> the transforms of a WebSocket's messages (credential fill's redaction and screenshot
        # masks), awaited before the connection is relayed; Unavailable refuses it (503) rather than relay it
        # unredacted
        self.relay_filter = relay_filter
        # guest address -> ((sandbox id, generation) holding it, the pooled client for it): see _client_for
        self._clients: dict[str, tuple[tuple[str, int], httpx.AsyncClient]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # sandbox id -> an event per request relayed to it now, set when the sandbox leaves the node (see
        # _while_here); the manager's on_leave hook runs on every way out (delete, suspend, migration, fence,
        # a VM that died)
        self._open: dict[str, set[asyncio.Event]] = {}
        if manager is not None:
            manager.on_leave.append(self.left)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            guest, port, path = self._target(scope)
        except _Refused as exc:
            await deny(scope, receive, send, *exc.answer)
            return
        if scope["type"] == "http":
            await self._http(scope, receive, send, guest, port, path, self._owner(scope))
        else:
            await self._ws(scope, receive, send, guest, port, path)

    def _owner(self, scope: Scope) -> tuple[str, int]:
        """(sandbox id, generation of its VM on this node) of a request that :meth:`_target` accepted."""
        sandbox_id = scope["path"][len(PREFIX):].partition("/")[0]
        vm = self.manager.vms.get(sandbox_id)
        return sandbox_id, vm.generation if vm is not None else -1

    def _client_for(self, guest: str, owner: tuple[str, int]) -> httpx.AsyncClient:
        """The pooled client for guest address ``guest`` while ``owner`` (sandbox id, generation) holds it.

        Guest addresses are leased again (a warm slot or a new sandbox gets the address a deleted one had), and
        a VM restored at a new generation has a fresh TCP stack: a kept-alive connection to the previous holder
        would reach a guest that never opened it and end in a reset (502 ``port_error`` ``ReadError`` on the
        first request to the new sandbox). So each holder gets a pool of its own; the previous one is closed
        (its guest is gone, so are its connections)."""
        held = self._clients.get(guest)
        if held is not None and held[0] == owner:
            return held[1]
        client = guest_http_client()
        self._clients[guest] = (owner, client)
        if held is not None:
            task = asyncio.get_running_loop().create_task(held[1].aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return client

    def _target(self, scope: Scope) -> tuple[str, int, str]:
        """(guest address, port, path with query) of a request; :class:`_Refused` with the answer otherwise."""
        headers = dict(scope.get("headers", []))
        rest = scope["path"][len(PREFIX):]
        sandbox_id, _, rest = rest.partition("/")
        # The data plane's grant check (services/nodeagent/dataplane/grant_check.py, outermost) verified the API's grant
        # for this sandbox's port traffic; without one (this proxy mounted alone) nothing passes.
        grant = scope.get(GRANT_SCOPE_KEY)
        if grant is None or grant.kind != GrantKind.TRAFFIC or grant.subject != sandbox_id:
            raise _Refused(json_error(403, "grant_refused", "no grant for this sandbox's ports"))
        port_s = rest.partition("/")[0]
        if not port_s.isdigit() or not 0 < int(port_s) <= 65535:
            raise _Refused(json_error(400, "invalid_request", f"bad port {port_s[:16]!r}"))
        vm = self.manager.vms.get(sandbox_id)
        gen = headers.get(b"x-podbay-generation", b"").decode()
        if vm is None:
            raise _Refused(json_error(404, "not_found", f"sandbox {sandbox_id} is not running on this node"))
        if gen.isdigit() and int(gen) != vm.generation:
            raise _Refused(json_error(409, "stale_generation",
                                      f"sandbox {sandbox_id} is at generation {vm.generation}"))
        if vm.stopping or vm.channel is None:
            raise _Refused(json_error(409, "invalid_state", f"sandbox {sandbox_id} is paused or stopping"))
        lease = self.manager.net.leased().get(sandbox_id)
        if lease is None:
            raise _Refused(json_error(409, "invalid_state", f"sandbox {sandbox_id} has no network"))
        # The edge sends the guest's path as the client spelled it (raw, with its query) in a header, so that
        # no URL normalisation of ours can turn "/../" into a path of this internal API.
        wanted = headers.get(PATH_HEADER.encode(), b"").decode("latin-1")
        if not wanted.startswith("/") or any(c in wanted for c in "\r\n "):
            raise _Refused(json_error(400, "invalid_request", f"missing or bad {PATH_HEADER}"))
        return lease.guest_addr, int(port_s), wanted

    async def _http(self, scope: Scope, receive: Receive, send: Send, guest: str, port: int, path: str,
                    owner: tuple[str, int]) -> None:
        headers = forwarded_headers(scope)
        orig = dict(scope.get("headers", []))
        host = _guest_host(orig)
        if host:
            headers.append(("host", host))
        has_body = b"content-length" in orig or b"transfer-encoding" in orig
        try:
            # Built from parts: the client's path is the path and nothing else (the host is the guest's).
            url = httpx.URL(scheme="http", host=guest, port=port, raw_path=path.encode("latin-1"))
        except httpx.InvalidURL:
            await deny(scope, receive, send, *json_error(400, "invalid_request", f"bad {PATH_HEADER}"))
            return
        http = self._client_for(guest, owner)
        req = http.build_request(scope["method"], url, headers=headers,
                                 content=request_body(receive) if has_body else None)
        try:
            resp = await http.send(req, stream=True)
        except httpx.ConnectError as exc:
            await deny(scope, receive, send, *json_error(502, "port_not_open", await self._not_open(scope, port)))
            log.debug("port %s of %s: %r", port, guest, exc)
            return
        except httpx.TimeoutException:
            await deny(scope, receive, send, *json_error(504, "port_timeout", f"port {port} did not answer"))
            return
        except httpx.HTTPError as exc:
            await deny(scope, receive, send, *json_error(502, "port_error", f"port {port}: {type(exc).__name__}"))
            return
        try:
            if await self._while_here(owner[0], relay_response(resp, send, receive=receive)):
                # The sandbox is gone and its guest will never end the response: end it unfinished (no last
                # chunk), so that the client reads a broken stream at once rather than waiting for bytes that
                # never come (E2B's SDKs then ask whether the sandbox runs and report it killed).
                log.info("port %s of %s: the sandbox left the node mid-response; response cut", port, owner[0])
                raise SandboxLeft(owner[0])
        finally:
            await resp.aclose()

    async def _ws(self, scope: Scope, receive: Receive, send: Send, guest: str, port: int, path: str) -> None:
        sandbox_id = scope["path"][len(PREFIX):].partition("/")[0]
        try:
            filt = await self.relay_filter(sandbox_id) if self.relay_filter is not None else None
        except Unavailable as exc:
            await deny(scope, receive, send, *json_error(503, exc.code, exc.message))
            return
        try:
            sock = await connect_guest(guest, port)
        except (OSError, TimeoutError):
            await deny(scope, receive, send, *json_error(502, "port_not_open", await self._not_open(scope, port)))
            return
        # The URI names the Host of the handshake only: the socket is connected to the guest already.
        masked = dict(scope.get("headers", [])).get(HOST_HEADER.encode(), b"").decode("latin-1")
        relay = relay_websocket(scope, receive, send, f"ws://{masked or f'{guest}:{port}'}{path}", {}, sock=sock,
                                to_client=filt.to_client if filt is not None else None,
                                to_upstream=filt.to_upstream if filt is not None else None)
        if await self._while_here(sandbox_id, relay):
            # 1001 "going away": the sandbox left the node (the relay's own close never came: the guest is gone).
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1001, "reason": "sandbox is gone"})

    def left(self, sandbox_id: str) -> None:
        """The sandbox left this node (the manager's ``on_leave`` hook): end every request relayed to it now.
        Its guest is gone without closing its connections (a killed VM sends no FIN), so a stream from it
        would otherwise hang until TCP gives up, minutes later."""
        for event in self._open.pop(sandbox_id, ()):
            event.set()

    async def _while_here(self, sandbox_id: str, relay: Awaitable[Any]) -> bool:
        """Run ``relay`` (a request's relay to the guest of ``sandbox_id``) until it ends, or until the sandbox
        leaves the node (:meth:`left`): then cancel it and return True. False when it ended by itself (its
        exception, if any, raised); a cancellation of the caller cancels it too."""
        gone = asyncio.Event()
        self._open.setdefault(sandbox_id, set()).add(gone)
        task = asyncio.ensure_future(relay)
        waiter = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        finally:
            waiter.cancel()
            events = self._open.get(sandbox_id)
            if events is not None:
                events.discard(gone)
                if not events:
                    del self._open[sandbox_id]
        if task.done():
            task.result()
            return False
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return True

    async def _not_open(self, scope: Scope, port: int) -> str:
        """The message of a refused connection. A server bound to the guest's loopback only (``127.0.0.1``,
        ``::1``: a common default of dev servers) refuses the proxy as surely as no server at all, so the
        guest's listening sockets are read (bounded by :data:`LISTENERS_TIMEOUT_S`) to say which it is."""
        sandbox_id = scope["path"][len(PREFIX):].partition("/")[0]
        try:
            listeners = await asyncio.wait_for(
                listening_ports(self.manager.channel(sandbox_id, None)), LISTENERS_TIMEOUT_S)
        except (PodbayError, TimeoutError, OSError) as exc:
            log.debug("listening ports of %s: %r", sandbox_id, exc)
            listeners = []
        return not_open_message(port, listeners)

    async def aclose(self) -> None:
        for _, client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class _MarkedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend for guest connections: the socket is marked (:data:`PORTS_MARK`) before it
    connects, then handed to anyio like any other."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        sock = _marked_socket(host, port)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout)
        except TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(f"{host}:{port}: timed out") from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(f"{host}:{port}: {exc.strerror or exc}") from exc
        return AnyIOStream(await SocketStream.from_socket(sock))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("guest ports are TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


