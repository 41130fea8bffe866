"""``GET /v1/sandboxes/{id}/pty`` (WebSocket): a terminal on a PTY in the guest, for the console's xterm.js.

The API drives the node's envd process service (services/nodeagent/envd/, Connect RPC with the JSON codec)
at ``/internal/e2b/{id}/process.Process/{Start,SendInput,Update,SendSignal}``, each call with a fresh
``envd`` grant for the caller's tenant and this sandbox (podbay.grants), like the E2B envd route. No new node
route: the node already checks that grant against its own sandbox.

Wire protocol on the socket:

* server to client: binary frames, the PTY's output bytes as they come; the socket closes 1000 when the
  shell exits, 1011 when the node stream breaks.
* client to server: binary frames are keystrokes and pastes (bytes to the PTY); text frames are JSON
  control messages, ``{"type": "resize", "cols": 1..1000, "rows": 1..1000}``.
* query: ``cols``, ``rows`` (the initial size, default 80x24) and, for a console session, ``csrf``.

Authentication is :func:`session.websocket_principal`: a bearer key, or the console session cookie with its
CSRF token and the API's own origin. A refused handshake answers with the API's error body and status
(404 ``not_found`` for another tenant's sandbox) when the server supports WebSocket denial responses, else
it closes with 4000 + the status. Opening a terminal is audited (``sandbox.pty``) and renews the lease.
When the socket closes, the shell is killed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, Query, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.websockets import WebSocketState

from podbay.contracts.states import SandboxCommand
from podbay.errors import PodbayError, Unavailable
from podbay.grants import GrantKind

from .. import nodes_client
from ..core.auth import Principal
from ..core.context import ApiContext
from .session import websocket_principal

__all__ = ["router", "Resize", "envelope", "read_envelopes"]

log = logging.getLogger(__name__)
router = APIRouter()

_ENV_HEADER = "x-podbay-e2b-env"  # the sandbox's default command environment (services/api/edge/envd.py)
_SHELL = {"cmd": "/bin/sh", "args": ["-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"],
          "envs": {"TERM": "xterm-256color"}}
_MAX_INPUT = 64 * 1024  # bytes of one keystroke or paste frame


class Resize(BaseModel):
    """A control message from the browser: the terminal's new size in character cells."""

    type: str = Field(pattern="^resize$")
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


def envelope(message: dict[str, Any]) -> bytes:
    """One Connect streaming envelope: flags 0, a 4-byte big-endian length, the JSON message."""
    body = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(body)) + body


async def read_envelopes(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """``(flags, message)`` of each Connect envelope in a byte stream (flag 2 marks the end-of-stream
    message, which carries ``error`` when the call failed)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + size:
                break
            body, buf = buf[5:5 + size], buf[5 + size:]
            yield flags, json.loads(body or b"{}")


class _Node:
    """The envd process calls of one terminal, each with its own grant."""

    def __init__(self, ctx: ApiContext, who: Principal, sandbox_id: str, base: str, generation: int,
                 env: dict[str, str]) -> None:
        self.ctx, self.who, self.sandbox_id, self.generation = ctx, who, sandbox_id, generation
        self.prefix = str(httpx.URL(base).copy_with(path=f"/internal/e2b/{sandbox_id}/process.Process/"))
        self.env = base64.b64encode(json.dumps(env).encode()).decode() if env else None

    def headers(self, content_type: str) -> dict[str, str]:
        out = {"content-type": content_type, "connect-protocol-version": "1",
               **self.ctx.node_headers(self.who.tenant_id, self.sandbox_id, self.generation, GrantKind.ENVD)}
        if self.env:
            out[_ENV_HEADER] = self.env
        return out

    async def unary(self, method: str, message: dict[str, Any]) -> None:
        r = await self.ctx.nodes_http.post(self.prefix + method, json=message, headers=self.headers("application/json"))
        if r.status_code != 200:
            raise Unavailable(f"the node refused {method}: {r.status_code} {r.text[:200]}")


async def _refuse(websocket: WebSocket, exc: PodbayError) -> None:
    body = {"error": {"code": exc.code, "message": exc.message, "details": exc.details or {}}}
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(body, status_code=exc.http_status))
    else:
        await websocket.close(code=4000 + exc.http_status, reason=exc.code)


@router.websocket("/v1/sandboxes/{sandbox_id}/pty")
async def pty(websocket: WebSocket, sandbox_id: str, cols: int = Query(80, ge=1, le=1000),
              rows: int = Query(24, ge=1, le=1000), csrf: str | None = Query(None, max_length=128)) -> None:
    """A shell on a PTY in ``sandbox_id`` (running, of the caller's tenant), bridged to this WebSocket."""
    ctx: ApiContext = websocket.app.state.ctx
    try:
        who = await websocket_principal(ctx.pool, websocket.headers, websocket.cookies, csrf)
        base, gen, env = await nodes_client.lookup(ctx, who, sandbox_id, SandboxCommand.EXEC,
                                                audit_action="sandbox.pty", audit_detail={"cols": cols, "rows": rows})
    except PodbayError as exc:
        await _refuse(websocket, exc)
        return
    node = _Node(ctx, who, sandbox_id, base, gen, env)
    start = {"process": _SHELL, "pty": {"size": {"cols": cols, "rows": rows}}}
    req = ctx.nodes_http.build_request("POST", node.prefix + "Start", content=envelope(start),
                                       headers=node.headers("application/connect+json"))
    try:
        resp = await ctx.nodes_http.send(req, stream=True)
    except httpx.HTTPError as exc:
        await _refuse(websocket, Unavailable(f"the node did not answer: {exc}"))
        return
    if resp.status_code != 200:
        text = (await resp.aread())[:300].decode(errors="replace")
        await resp.aclose()
        await _refuse(websocket, Unavailable(f"the node refused the terminal: {resp.status_code} {text}"))
        return
    await websocket.accept()
    pid: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def pump_out() -> int:
        """Node to browser; the close code once the stream ends."""
        async for flags, msg in read_envelopes(resp.aiter_bytes()):
            if flags & 2:
                return 1011 if msg.get("error") else 1000
            event = msg.get("event") or {}
            if "start" in event and not pid.done():
                pid.set_result(int(event["start"].get("pid", 0)))
            data = (event.get("data") or {}).get("pty")
            if data:
                await websocket.send_bytes(base64.b64decode(data))
            if "end" in event:
                return 1000
        return 1000

    async def pump_in() -> None:
        """Browser to node: keystrokes, pastes and resizes, in order."""
        the_pid = await pid
        while True:
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes"):
                data: bytes = msg["bytes"][:_MAX_INPUT]
                await node.unary("SendInput", {"process": {"pid": the_pid},
                                               "input": {"pty": base64.b64encode(data).decode()}})
            elif msg.get("text"):
                try:
                    size = Resize.model_validate_json(msg["text"])
                except ValidationError:
                    continue  # an unknown control message changes nothing
                await node.unary("Update", {"process": {"pid": the_pid},
                                            "pty": {"size": {"cols": size.cols, "rows": size.rows}}})

    out_task = asyncio.create_task(pump_out())
    in_task = asyncio.create_task(pump_in())
    code = 1011
    try:
        await asyncio.wait({out_task, in_task}, return_when=asyncio.FIRST_COMPLETED)
        if out_task.done() and out_task.exception() is None:
            code = out_task.result()
        else:
            failed = out_task.exception() if out_task.done() else (in_task.exception() if in_task.done() else None)
            if failed is not None:
                log.info("terminal of %s ended: %r", sandbox_id, failed)
    finally:
        shell_ended = out_task.done()
        for task in (out_task, in_task):
            task.cancel()
        for task in (out_task, in_task):
            with contextlib.suppress(BaseException):
                await task
        await resp.aclose()
        if pid.done() and not shell_ended:
            # The browser went away (or input failed) with the shell still running: nobody can reach it again.
            with contextlib.suppress(Exception):
                await node.unary("SendSignal", {"process": {"pid": pid.result()}, "signal": "SIGNAL_SIGKILL"})
        if websocket.client_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await websocket.close(code=code)
