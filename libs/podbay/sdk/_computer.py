"""Computer use in the SDK (docs/computer-use.md): screenshots, mouse, keyboard and the CDP URL of a sandbox's
browser. Builders are shared by the sync and async clients, like ``podbay.sdk._calls``."""

from __future__ import annotations

from typing import Any

import httpx

from podbay.contracts.computer import CdpEndpoint, ComputerResult, FillRequest, FillResult, KeyboardAction, MouseAction
from podbay.sdk._calls import Call, _model, _sandbox_path, _validate

__all__ = ["screenshot_call", "mouse_call", "keyboard_call", "fill_call", "cdp_call"]


def _bytes(resp: httpx.Response) -> bytes:
    return resp.content


def screenshot_call(sandbox_id: str) -> Call[bytes]:
    """``POST /v1/sandboxes/{id}/computer/screenshot``: the page's viewport as PNG bytes."""
    return Call("POST", _sandbox_path(sandbox_id, "/computer/screenshot"), _bytes)


def mouse_call(sandbox_id: str, action: str, x: float, y: float, **kw: Any) -> Call[ComputerResult]:
    """``POST .../computer/mouse``: ``action`` move, click, drag (``to_x``, ``to_y``) or scroll (``delta_x``,
    ``delta_y``) at ``(x, y)``; other fields of :class:`MouseAction` (``button``, ``clicks``, ``steps``) as
    keywords. Raises :class:`podbay.errors.InvalidRequest` for a bad action before sending."""
    body = _validate(MouseAction, {"action": action, "x": x, "y": y, **kw}, "mouse action")
    return Call("POST", _sandbox_path(sandbox_id, "/computer/mouse"), _model(ComputerResult),
                json=body.model_dump(mode="json"))


def keyboard_call(sandbox_id: str, *, text: str | None = None, keys: list[str] | None = None) -> Call[ComputerResult]:
    """``POST .../computer/keyboard``: ``text`` typed at the focus, or ``keys`` pressed in turn (one of them)."""
    if (text is None) == (keys is None):
        raise ValueError("give text or keys, not both")
    body = KeyboardAction(action="type", text=text) if text is not None else KeyboardAction(action="keys", keys=keys)
    return Call("POST", _sandbox_path(sandbox_id, "/computer/keyboard"), _model(ComputerResult),
                json=body.model_dump(mode="json", exclude_none=True))


def fill_call(sandbox_id: str, credential: str, selector: str) -> Call[FillResult]:
    """``POST .../computer/fill``: the node types credential ``credential`` into ``selector``'s element."""
    body = FillRequest(credential=credential, selector=selector)
    return Call("POST", _sandbox_path(sandbox_id, "/computer/fill"), _model(FillResult), json=body.model_dump())


def cdp_call(sandbox_id: str) -> Call[CdpEndpoint]:
    """``GET .../computer/cdp``: the browser's CDP WebSocket URL (token included) through the API."""
    return Call("GET", _sandbox_path(sandbox_id, "/computer/cdp"), _model(CdpEndpoint))
