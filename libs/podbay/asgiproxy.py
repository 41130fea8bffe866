"""Streaming ASGI proxy pieces shared by the API's port edge and the node's port proxy (docs/DESIGN.md §8, ports).

Both hops relay one client request to one upstream without holding a whole body: request bodies are read
from ASGI ``receive`` chunk by chunk (:func:`request_body`), responses opened with httpx's
``send(stream=True)`` are written to ASGI ``send`` chunk by chunk (:func:`relay_response`), so memory per
request is bounded by a chunk and the servers' flow control; WebSockets are relayed message by message with
the ``websockets`` asyncio client (:func:`relay_websocket`), after the upstream's handshake so that the
subprotocol it chose is the one accepted.

Why these libraries: httpx is already every podbay service's HTTP client, streams raw bytes (content
encodings untouched) and takes socket options on its transport; ``websockets`` is the library uvicorn serves
WebSockets with. aiohttp could do both but would add a second HTTP stack beside httpx.

Errors: an answer of the proxy itself is ``{"error": {"code", "message"}}`` with :data:`ERROR_HEADER` naming
the code (:func:`json_error`), so the next hop (the edge) can render it for browsers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

__all__ = ["HOP_BY_HOP", "ERROR_HEADER", "json_error", "forwarded_headers", "request_body", "relay_response",
           "deny", "relay_websocket", "Answer"]

#: Response header naming an error of the proxy itself (its body is ``{"error": {code, message}}``).
ERROR_HEADER = "x-podbay-port-error"
#: Headers of one hop only (RFC 9110 §7.6.1), plus podbay's internal ones and Host; never relayed.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "proxy-connection", "x-podbay-internal-token", "x-podbay-grant",
                        "x-podbay-generation", "x-podbay-port-path", "x-podbay-port-host", "host"})
# Set by the WebSocket client itself.
_WS_OWN = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                     "sec-websocket-protocol", "sec-websocket-accept", "origin", "user-agent"})

#: (status, headers, body) of an answer the proxy gives itself.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


def json_error(status: int, code: str, message: str) -> Answer:
    """An answer of the proxy itself: JSON ``{"error": {code, message}}`` with :data:`ERROR_HEADER`."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (ERROR_HEADER.encode(), code.encode())], body


def forwarded_headers(scope: Scope, *, drop: frozenset[str] = HOP_BY_HOP) -> list[tuple[str, str]]:
    """The request's end-to-end headers (hop-by-hop and internal ones removed, plus those named in
    ``Connection``)."""
    raw = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", [])]
    named = {t.strip().lower() for k, v in raw if k == "connection" for t in v.split(",")}
    return [(k, v) for k, v in raw if k not in drop and k not in named]


async def request_body(receive: Receive) -> AsyncIterator[bytes]:
    """The ASGI request body, chunk by chunk as it arrives."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        chunk = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            return


async def relay_response(resp: httpx.Response, send: Send, on_bytes: Callable[[int], None] | None = None,
                         drop: frozenset[str] = HOP_BY_HOP, receive: Receive | None = None) -> bool:
    """Send ``resp`` (opened with ``stream=True``) to the ASGI client as it arrives: status, end-to-end headers,
    then each raw chunk (``on_bytes(n)`` after each). True once the response is relayed whole.

    ``receive``: the request's channel, its body already read (httpx sends a request's whole body before it
    returns the response): the relay then stops when the client disconnects, and returns False (the caller
    closes ``resp``, so the upstream sees its connection close). Without it a vanished client goes unnoticed:
    uvicorn's ``send`` drops what is sent after a disconnect without an error, so a stream that never ends (an
    execution's keepalives) would be relayed into the void for ever and its upstream never told."""
    if receive is None:
        await _relay(resp, send, on_bytes, drop)
        return True
    relay = asyncio.ensure_future(_relay(resp, send, on_bytes, drop))
    gone = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, gone):
            task.cancel()
        await asyncio.gather(relay, gone, return_exceptions=True)
    if relay.done() and not relay.cancelled():
        relay.result()
        return True
    return False


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _relay(resp: httpx.Response, send: Send, on_bytes: Callable[[int], None] | None,
                 drop: frozenset[str]) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.multi_items()
               if k.lower() not in drop]
    await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
    async for chunk in resp.aiter_raw():
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if on_bytes is not None:
                on_bytes(len(chunk))
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def deny(scope: Scope, receive: Receive, send: Send, status: int, headers: list[tuple[bytes, bytes]],
               body: bytes) -> None:
    """Answer with ``status``/``headers``/``body``: a plain response for HTTP; for a WebSocket, the same as an
    HTTP answer to the handshake where the server offers that (``websocket.http.response``), else a close."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1011 if status >= 500 else 1008})


async def relay_websocket(scope: Scope, receive: Receive, send: Send, uri: str, extra: dict[str, str], *,
                          sock: socket.socket | None = None, drop: frozenset[str] = HOP_BY_HOP,
                          on_open: Callable[[], None] | None = None,
                          to_client: Callable[[str | bytes], str | bytes | None] | None = None,
                          to_upstream: Callable[[str | bytes], list[str | bytes]] | None = None) -> dict[str, int]:
    """Open ``uri`` with the client's subprotocols, origin and end-to-end headers (plus ``extra``), accept the
    ASGI client with the subprotocol the upstream chose, and relay messages both ways until one side closes.
    An upstream that refuses the handshake is answered as :func:`deny` does (502 ``port_not_open`` when
    its HTTP status says so, the status otherwise). ``to_client``: applied to every message on its way to the
    client (the node's redaction of filled credentials in CDP and masking of screenshots; None drops the
    message); ``to_upstream``: turns each client message into the messages sent upstream, in order (the
    node's probe before a CDP screenshot). Returns ``{"in": bytes, "out": bytes}`` relayed."""
    headers = {**{k: v for k, v in forwarded_headers(scope, drop=drop | _WS_OWN)}, **extra}
    origin = dict(scope.get("headers", [])).get(b"origin")
    counts = {"in": 0, "out": 0}
    try:
        upstream = await connect(uri, sock=sock, additional_headers=headers,
                                 subprotocols=scope.get("subprotocols") or None,
                                 origin=origin.decode("latin-1") if origin else None,
                                 max_size=None, compression=None, ping_interval=None, open_timeout=30,
                                 user_agent_header=None)
    except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
        if isinstance(exc, InvalidStatus):  # the upstream answered the handshake with another status: pass it on
            resp = exc.response
            hdrs = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.raw_items()
                    if k.lower() not in drop]
            await deny(scope, receive, send, resp.status_code, hdrs, bytes(resp.body or b""))
        else:
            await deny(scope, receive, send, *json_error(502, "port_not_open",
                                                          f"the WebSocket upstream refused: {type(exc).__name__}"))
        if sock is not None:
            sock.close()
        return counts
    msg = await receive()
    if msg["type"] != "websocket.connect":
        await upstream.close()
        return counts
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    if on_open is not None:
        on_open()
    await _pump(upstream, receive, send, counts, to_client, to_upstream)
    return counts


async def _pump(upstream: ClientConnection, receive: Receive, send: Send, counts: dict[str, int],
                to_client: Callable[[str | bytes], str | bytes | None] | None = None,
                to_upstream: Callable[[str | bytes], list[str | bytes]] | None = None) -> None:
    async def client_to_upstream() -> None:
        while True:
            msg: Message = await receive()
            if msg["type"] == "websocket.disconnect":
                await upstream.close(code=int(msg.get("code", 1000)) if msg.get("code") in range(1000, 5000)
                                     and msg.get("code") not in (1005, 1006, 1015) else 1000)
                return
            data = msg["bytes"] if msg.get("bytes") is not None else msg.get("text")
            if data is None:
                continue
            counts["in"] += len(data)
            for out in (to_upstream(data) if to_upstream is not None else [data]):
                await upstream.send(out)

    async def upstream_to_client() -> None:
        try:
            async for got in upstream:
                data = to_client(got) if to_client is not None else got
                if data is None:
                    continue
                counts["out"] += len(data)
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        except ConnectionClosed:
            pass
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):  # the client may already be gone
            await send({"type": "websocket.close", "code": code if code not in (1005, 1006, 1015) else 1000,
                        "reason": upstream.close_reason or ""})

    tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        with contextlib.suppress(Exception):
            await upstream.close()
