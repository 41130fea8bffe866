"""Computer use on this node: a sandbox's browser driven over the DevTools protocol (CDP) from outside the guest.

A template declares its browser with the label ``podbay.cdp-port=<guest port>`` (the ``browser`` template:
headless Chromium on 9222, templates/browser/Dockerfile). For a running sandbox of such a template the node
connects to that port on the guest's address (the sandbox's tap, with the ports proxy's marked sockets,
services/nodeagent/net/ports.py, so the node's ruleset lets the connection in) and:

* ``POST /internal/v1/sandboxes/{id}/computer/screenshot`` -> ``image/png``: ``Page.captureScreenshot`` of
  the first page target (a new ``about:blank`` one when the agent closed them all); for a template with a
  display (the label ``podbay.vnc-port``, the ``desktop`` template) the whole X screen instead, read over
  VNC (:mod:`.computer_screen`). The header ``x-podbay-screenshot-source`` says which (``page``,
  ``display``). From a sandbox's first credential fill on (:mod:`.computer_fill`), the boxes of its password
  fields and of the fields fills typed into, taken with ``DOM.getBoxModel`` just before and just after the
  capture, are painted over on the node (:func:`.computer_screen.paint_masks`), also after the sandbox was
  woken, moved, forked or the node agent restarted (:mod:`.fill_memory`);
* ``POST .../computer/mouse`` and ``.../computer/keyboard``: ``Input.dispatchMouseEvent``,
  ``Input.dispatchKeyEvent`` and ``Input.insertText`` (:class:`~podbay.contracts.computer.MouseAction`,
  :class:`~podbay.contracts.computer.KeyboardAction`) -> ``{"events": n}``;
* ``GET .../computer/cdp``: the browser-wide WebSocket path and version (:class:`CdpTarget`), from which the
  API builds the URL a CDP client uses through the port edge.

Each call opens its own CDP WebSocket to the page (``websockets``, the library the ports proxy relays with)
and closes it: one TCP and WebSocket handshake on the node's own link to the guest, small beside what
Chromium takes to render a screenshot, and no session state to go stale across pause, restore or migration.

Errors: a sandbox whose template declares no browser, or whose browser does not answer, is 409
``no_browser`` (:class:`~podbay.errors.NoBrowser`); a CDP error answer is 502 ``guest_error``. The guest is
untrusted: its JSON is bounded, target ids are checked before they go into a URL, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request, Response
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from podbay.contracts.computer import (CDP_PORT_LABEL, SCREENSHOT_SOURCE_HEADER, VNC_PORT_LABEL, CdpTarget, ComputerResult, KeyboardAction,
                                      MouseAction)
from podbay.errors import GuestError, InvalidRequest, NoBrowser, Unavailable

from ..build.defaults import ExecDefaults
from .computer_screen import from_png, paint_masks, read_display, to_png
from .fill_memory import FillMemory, PgFillRecord
from ..net.ports import connect_guest, guest_http_client

if TYPE_CHECKING:
    from ..ops.sandboxes import SandboxManager

__all__ = ["Computer", "CdpSession", "add_computer_routes", "key_events", "guest_number", "MASK_MARGIN_PX",
           "MAX_MASKED_FIELDS", "PASSWORD_FIELDS"]

log = logging.getLogger("podbay.nodeagent.computer")

#: Bound on one CDP call (a screenshot of a large page under TCG takes a while), seconds.
CALL_TIMEOUT_S = 60.0
#: Bound on a CDP message from the guest (a full-page screenshot of a long page is tens of MiB), bytes.
MAX_MESSAGE_BYTES = 64 << 20
_TARGET_ID = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_BROWSER_PATH = re.compile(r"^/devtools/browser/[A-Za-z0-9-]{1,64}$")
_BUTTONS = {"left": 1, "right": 2, "middle": 4}
_MODIFIERS = {"Alt": 1, "Control": 2, "Ctrl": 2, "Meta": 4, "Command": 4, "Shift": 8}
# Non-printing keys: DOM key -> (code, Windows virtual key code). Printing keys are derived (key_events).
_SPECIAL: dict[str, tuple[str, int]] = {
    "Enter": ("Enter", 13), "Tab": ("Tab", 9), "Backspace": ("Backspace", 8), "Escape": ("Escape", 27),
    "Delete": ("Delete", 46), "Insert": ("Insert", 45), "Home": ("Home", 36), "End": ("End", 35),
    "PageUp": ("PageUp", 33), "PageDown": ("PageDown", 34), "ArrowLeft": ("ArrowLeft", 37),
    "ArrowUp": ("ArrowUp", 38), "ArrowRight": ("ArrowRight", 39), "ArrowDown": ("ArrowDown", 40),
    "Alt": ("AltLeft", 18), "Control": ("ControlLeft", 17), "Shift": ("ShiftLeft", 16), "Meta": ("MetaLeft", 91),
    **{f"F{i}": (f"F{i}", 111 + i) for i in range(1, 13)},
}
_TEXT = {"Enter": "\r", "Tab": "\t"}
#: What a screenshot masks once a fill happened, beside the fields fills typed into.
PASSWORD_FIELDS = "input[type=password]"
#: Bound on the fields masked in one screenshot (the page is untrusted).
MAX_MASKED_FIELDS = 200
#: Pixels added on each side of a masked field's border box (focus rings and antialiased edges).
MASK_MARGIN_PX = 2


def guest_number(v: Any) -> float:
    """A finite number from the guest's JSON, else 0."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else 0.0


class CdpSession:
    """One CDP WebSocket: :meth:`call` sends a command and waits for its answer (events in between are
    dropped)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._next = 0

    async def call(self, method: str, params: dict[str, Any] | None = None,
                   timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """The ``result`` of ``method``; raises :class:`GuestError` on a CDP error answer, a closed
        connection or no answer within ``timeout_s``."""
        self._next += 1
        msg_id = self._next
        try:
            await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
            async with asyncio.timeout(timeout_s):
                while True:
                    msg = json.loads(await self.ws.recv())
                    if isinstance(msg, dict) and msg.get("id") == msg_id:
                        break
        except TimeoutError as exc:
            raise GuestError(f"the browser did not answer {method} within {timeout_s:g} s") from exc
        except (WebSocketException, OSError, ValueError) as exc:
            raise GuestError(f"CDP connection to the browser failed during {method}: {type(exc).__name__}") from exc
        if "error" in msg:
            err = msg["error"] if isinstance(msg["error"], dict) else {}
            raise GuestError(f"{method}: {str(err.get('message', 'error'))[:300]}",
                             details={"cdp_code": err.get("code")})
        result = msg.get("result")
        return result if isinstance(result, dict) else {}


def key_events(combo: str) -> list[dict[str, Any]]:
    """The ``Input.dispatchKeyEvent`` parameters that press and release ``combo`` (``Enter``, ``a``,
    ``Control+a``, ``Shift+Tab``). Raises ``ValueError`` for an unknown key name."""
    *mods, key = combo.split("+") if combo != "+" else ["+"]
    if not key:
        raise ValueError(f"no key in {combo!r}")
    flags = 0
    for m in mods:
        if m not in _MODIFIERS:
            raise ValueError(f"unknown modifier {m!r} in {combo!r} (Alt, Control, Meta, Shift)")
        flags |= _MODIFIERS[m]
    if key in _SPECIAL:
        code, vk = _SPECIAL[key]
        text = _TEXT.get(key, "")
    elif len(key) == 1:
        if flags & _MODIFIERS["Shift"] and key.isalpha():
            key = key.upper()  # Shift+a is "A", as a keyboard types it
        up = key.upper()
        code = f"Key{up}" if up.isalpha() and up.isascii() else (f"Digit{key}" if key.isdigit() else "")
        vk = ord(up) if (up.isascii() and up.isalnum()) else (32 if key == " " else 0)
        text = key
    else:
        raise ValueError(f"unknown key {key!r} (a DOM key name such as Enter, Tab, ArrowDown, or one character)")
    if flags & (_MODIFIERS["Control"] | _MODIFIERS["Meta"] | _MODIFIERS["Alt"]):
        text = ""  # a shortcut types nothing (Control+a selects all)
    down: dict[str, Any] = {"type": "keyDown" if text else "rawKeyDown", "key": key, "code": code,
                            "windowsVirtualKeyCode": vk, "modifiers": flags}
    if text:
        down |= {"text": text, "unmodifiedText": text}
    press = [{"type": "rawKeyDown", "key": m, "code": _SPECIAL.get(m, (m, 0))[0],
              "windowsVirtualKeyCode": _SPECIAL.get(m, (m, 0))[1], "modifiers": flags} for m in mods]
    release = [{"type": "keyUp", "key": m, "code": _SPECIAL.get(m, (m, 0))[0],
                "windowsVirtualKeyCode": _SPECIAL.get(m, (m, 0))[1], "modifiers": 0} for m in reversed(mods)]
    return [*press, down, {"type": "keyUp", "key": key, "code": code, "windowsVirtualKeyCode": vk,
                           "modifiers": flags}, *release]


class Computer:
    """CDP to the browsers of this node's sandboxes (see the module docstring)."""

    def __init__(self, manager: SandboxManager, defaults: ExecDefaults) -> None:
        self.m = manager
        self.defaults = defaults
        self.http = guest_http_client()
        #: What credential fills put into each sandbox's page (:mod:`.fill_memory`): a sandbox with a filled
        #: set has its screenshots masked (:meth:`screenshot`) and its CDP stream redacted (:mod:`.computer_fill`).
        self.fills = FillMemory(PgFillRecord(manager.pool, manager.settings).load)

    async def _label_port(self, sandbox_id: str, label: str) -> int | None:
        """The guest port the sandbox's template names in ``label``, or None."""
        cfg = await self.defaults.get(sandbox_id)
        port_s = (cfg.labels if cfg is not None else {}).get(label, "")
        return int(port_s) if port_s.isdigit() and 0 < int(port_s) <= 65535 else None

    async def _where(self, sandbox_id: str, generation: int | None) -> tuple[str, int]:
        """``(guest address, CDP port)`` of a running sandbox with a browser; ``NoBrowser`` otherwise (and
        the channel's ``NotFound``/``StaleGeneration``/``Unavailable``)."""
        self.m.channel(sandbox_id, generation)  # running here, at this generation
        port = await self._label_port(sandbox_id, CDP_PORT_LABEL)
        if port is None:
            raise NoBrowser(f"sandbox {sandbox_id}'s template runs no browser (no {CDP_PORT_LABEL} label); "
                            "create it from the browser template", details={"sandbox_id": sandbox_id})
        lease = self.m.net.leased().get(sandbox_id)
        if lease is None:
            raise Unavailable(f"sandbox {sandbox_id} has no network")
        return lease.guest_addr, port

    async def _json(self, addr: str, port: int, path: str, method: str = "GET") -> Any:
        try:
            r = await self.http.request(method, f"http://{addr}:{port}{path}", timeout=CALL_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise NoBrowser(f"the browser does not answer on guest port {port} ({type(exc).__name__})",
                            details={"port": port}) from exc
        if r.status_code != 200 or len(r.content) > 1 << 20:
            raise GuestError(f"the browser answered {path} with HTTP {r.status_code}")
        try:
            return r.json()
        except ValueError as exc:
            raise GuestError(f"the browser answered {path} with no JSON") from exc

    async def target(self, sandbox_id: str, generation: int | None) -> CdpTarget:
        """The browser-wide CDP endpoint (``/json/version``)."""
        addr, port = await self._where(sandbox_id, generation)
        info = await self._json(addr, port, "/json/version")
        ws = str(info.get("webSocketDebuggerUrl", "")) if isinstance(info, dict) else ""
        path = "/" + ws.split("://", 1)[-1].partition("/")[2]
        if not _BROWSER_PATH.match(path):
            raise GuestError("the browser's /json/version names no browser WebSocket")
        return CdpTarget(port=port, browser_path=path, browser=str(info.get("Browser", ""))[:200])

    @contextlib.asynccontextmanager
    async def page(self, sandbox_id: str, generation: int | None) -> AsyncIterator[CdpSession]:
        """A CDP session on the browser's first page (one is opened when there is none)."""
        addr, port = await self._where(sandbox_id, generation)
        targets = await self._json(addr, port, "/json/list")
        pages = [t for t in targets if isinstance(t, dict) and t.get("type") == "page"] if isinstance(
            targets, list) else []
        page = pages[0] if pages else await self._json(addr, port, "/json/new?about:blank", method="PUT")
        target_id = str(page.get("id", "")) if isinstance(page, dict) else ""
        if not _TARGET_ID.match(target_id):
            raise GuestError("the browser listed a page without a valid id")
        try:
            sock = await connect_guest(addr, port)
        except (OSError, TimeoutError) as exc:
            raise NoBrowser(f"the browser does not answer on guest port {port}", details={"port": port}) from exc
        try:
            async with connect(f"ws://{addr}:{port}/devtools/page/{target_id}", sock=sock, max_size=MAX_MESSAGE_BYTES,
                               compression=None, ping_interval=None, open_timeout=CALL_TIMEOUT_S,
                               user_agent_header=None) as ws:
                yield CdpSession(ws)
        except (WebSocketException, OSError, TimeoutError) as exc:
            raise GuestError(f"CDP connection to the browser failed: {type(exc).__name__}") from exc

    async def _field_boxes(self, cdp: CdpSession, selectors: set[str],
                           on_screen: bool) -> list[tuple[float, float, float, float]]:
        """``(left, top, right, bottom)`` in picture pixels of every rendered element of the page's main
        document that :data:`PASSWORD_FIELDS` or one of ``selectors`` matches (at most
        :data:`MAX_MASKED_FIELDS`), widened by :data:`MASK_MARGIN_PX`. The boxes come from the browser's
        layout (``DOM.getBoxModel``), not from the page's script. ``on_screen``: shifted to where the page's
        viewport sits on the X screen (``Browser.getWindowForTarget``: the window's place, its frame taken
        as being above the viewport; none under ``--kiosk``)."""
        metrics = await cdp.call("Page.getLayoutMetrics")
        css_w = guest_number((metrics.get("cssVisualViewport") or {}).get("clientWidth"))
        dev_w = guest_number((metrics.get("visualViewport") or {}).get("clientWidth"))
        css_h = guest_number((metrics.get("cssVisualViewport") or {}).get("clientHeight"))
        scale = dev_w / css_w if css_w > 0 and dev_w > 0 else 1.0  # device pixels per CSS pixel
        ox = oy = 0.0
        if on_screen:
            try:
                b = (await cdp.call("Browser.getWindowForTarget")).get("bounds") or {}
            except GuestError:
                b = {}
            frame_x = max(0.0, guest_number(b.get("width")) - css_w * scale) / 2
            ox = guest_number(b.get("left")) + frame_x
            oy = guest_number(b.get("top")) + max(0.0, guest_number(b.get("height")) - css_h * scale - frame_x)
        root = (await cdp.call("DOM.getDocument", {"depth": 0})).get("root", {}).get("nodeId")
        nodes: list[int] = []
        for sel in (PASSWORD_FIELDS, *sorted(selectors)):
            try:
                found = (await cdp.call("DOM.querySelectorAll", {"nodeId": root, "selector": sel})).get("nodeIds")
            except GuestError:
                continue  # a selector the current page's browser refuses matches nothing here
            nodes += [n for n in (found or []) if isinstance(n, int) and n not in nodes]
        boxes = []
        for node in nodes[:MAX_MASKED_FIELDS]:
            try:
                quad = (await cdp.call("DOM.getBoxModel", {"nodeId": node})).get("model", {}).get("border")
            except GuestError:
                continue  # not rendered (display: none): nothing to mask
            if not isinstance(quad, list) or len(quad) != 8:
                continue
            xs, ys = [guest_number(v) * scale + ox for v in quad[0::2]], [guest_number(v) * scale + oy for v in quad[1::2]]
            m = MASK_MARGIN_PX
            boxes.append((min(xs) - m, min(ys) - m, max(xs) + m, max(ys) + m))
        return boxes

    async def screenshot(self, sandbox_id: str, generation: int | None) -> tuple[bytes, str]:
        """``(PNG bytes, source)``: the X screen (``display``) for a template with :data:`VNC_PORT_LABEL`,
        else the page's viewport (``page``); masked after a fill (the module docstring)."""
        addr, port = await self._where(sandbox_id, generation)
        vnc_port = await self._label_port(sandbox_id, VNC_PORT_LABEL)
        await self.fills.arm(sandbox_id)  # fills made before a wake, a migration, a fork or a restart count too
        selectors = self.fills.selectors(sandbox_id)
        boxes: list[tuple[float, float, float, float]] = []
        async with self.page(sandbox_id, generation) as cdp:
            if selectors is not None:  # before and after: a field that moves meanwhile is covered at both places
                boxes += await self._field_boxes(cdp, selectors, on_screen=vnc_port is not None)
            if vnc_port is not None:
                try:
                    sock = await connect_guest(addr, vnc_port)
                except (OSError, TimeoutError) as exc:
                    raise NoBrowser(f"the display's VNC WebSocket on guest port {vnc_port} does not answer",
                                    details={"port": vnc_port}) from exc
                img = await read_display(addr, vnc_port, sock)
            else:
                res = await cdp.call("Page.captureScreenshot", {"format": "png"})
                try:
                    png = base64.b64decode(str(res.get("data", "")), validate=True)
                except ValueError as exc:
                    raise GuestError("the browser's screenshot is not base64") from exc
                if selectors is None:
                    return png, "page"
                img = from_png(png)
            if selectors is not None:
                boxes += await self._field_boxes(cdp, selectors, on_screen=vnc_port is not None)
        paint_masks(img, boxes)
        return to_png(img), "page" if vnc_port is None else "display"

    async def mouse(self, sandbox_id: str, generation: int | None, a: MouseAction) -> ComputerResult:
        events: list[dict[str, Any]] = []
        move = {"type": "mouseMoved", "x": a.x, "y": a.y}
        if a.action == "move":
            events.append(move)
        elif a.action == "click":
            btn = {"button": a.button, "buttons": _BUTTONS[a.button]}
            events.append(move)
            for n in range(1, a.clicks + 1):
                events.append({"type": "mousePressed", "x": a.x, "y": a.y, "clickCount": n, **btn})
                events.append({"type": "mouseReleased", "x": a.x, "y": a.y, "clickCount": n, **btn,
                               "buttons": 0})
        elif a.action == "drag":
            assert a.to_x is not None and a.to_y is not None
            btn = {"button": a.button, "buttons": _BUTTONS[a.button]}
            events += [move, {"type": "mousePressed", "x": a.x, "y": a.y, "clickCount": 1, **btn}]
            for i in range(1, a.steps + 1):
                f = i / a.steps
                events.append({"type": "mouseMoved", "x": a.x + (a.to_x - a.x) * f, "y": a.y + (a.to_y - a.y) * f,
                               **btn})
            events.append({"type": "mouseReleased", "x": a.to_x, "y": a.to_y, "clickCount": 1, **btn, "buttons": 0})
        else:
            events.append({"type": "mouseWheel", "x": a.x, "y": a.y, "deltaX": a.delta_x, "deltaY": a.delta_y})
        async with self.page(sandbox_id, generation) as cdp:
            for ev in events:
                await cdp.call("Input.dispatchMouseEvent", ev)
        return ComputerResult(events=len(events))

    async def keyboard(self, sandbox_id: str, generation: int | None, a: KeyboardAction) -> ComputerResult:
        if a.action == "type":
            async with self.page(sandbox_id, generation) as cdp:
                await cdp.call("Input.insertText", {"text": a.text or ""})
            return ComputerResult(events=1)
        events: list[dict[str, Any]] = []
        for combo in a.keys or []:
            try:
                events += key_events(combo)
            except ValueError as exc:
                raise InvalidRequest(str(exc), details={"key": combo[:64]}) from exc
        async with self.page(sandbox_id, generation) as cdp:
            for ev in events:
                await cdp.call("Input.dispatchKeyEvent", ev)
        return ComputerResult(events=len(events))

    async def aclose(self) -> None:
        await self.http.aclose()


def add_computer_routes(app: FastAPI, manager: SandboxManager, defaults: ExecDefaults) -> Computer:
    """Mount ``/internal/v1/sandboxes/{id}/computer/*`` (see the module docstring) on the data-plane app."""
    computer = Computer(manager, defaults)
    base = "/internal/v1/sandboxes/{sandbox_id}/computer"

    def _gen(request: Request) -> int | None:
        g = request.headers.get("x-podbay-generation")
        return int(g) if g and g.isdigit() else None

    @app.post(base + "/screenshot")
    async def screenshot(sandbox_id: str, request: Request) -> Response:
        png, source = await computer.screenshot(sandbox_id, _gen(request))
        return Response(png, media_type="image/png", headers={SCREENSHOT_SOURCE_HEADER: source})

    @app.post(base + "/mouse")
    async def mouse(sandbox_id: str, body: MouseAction, request: Request) -> ComputerResult:
        return await computer.mouse(sandbox_id, _gen(request), body)

    @app.post(base + "/keyboard")
    async def keyboard(sandbox_id: str, body: KeyboardAction, request: Request) -> ComputerResult:
        return await computer.keyboard(sandbox_id, _gen(request), body)

    @app.get(base + "/cdp")
    async def cdp(sandbox_id: str, request: Request) -> CdpTarget:
        return await computer.target(sandbox_id, _gen(request))

    return computer
