"""Computer use: the bodies and answers of ``/v1/sandboxes/{id}/computer/*`` (docs/computer-use.md).

A sandbox of a template that declares a browser (the ``podbay.cdp-port`` label, :data:`CDP_PORT_LABEL`)
takes screenshots, mouse and keyboard input through the API; the node drives the browser over the DevTools
protocol (CDP) from outside the guest. ``GET .../computer/cdp`` gives a WebSocket URL for a CDP client of
one's own (Playwright's ``connect_over_cdp``, Puppeteer's ``connect``).

Coordinates are CSS pixels of the page's viewport, from its top-left corner.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CDP_PORT_LABEL", "VNC_PORT_LABEL", "SCREENSHOT_SOURCE_HEADER", "MouseAction", "KeyboardAction",
           "ComputerResult", "CdpEndpoint", "CdpTarget",
           "FillRequest", "FillResult"]

#: The template label (``LABEL podbay.cdp-port=9222``) naming the guest port its browser serves CDP on.
CDP_PORT_LABEL = "podbay.cdp-port"
#: The template label (``LABEL podbay.vnc-port=6080``) naming the guest port of a VNC server behind a WebSocket
#: (websockify, path ``/websockify``) that shows the sandbox's X screen: a template with it has a display, and
#: the API's screenshot is of that screen rather than of the browser's page.
VNC_PORT_LABEL = "podbay.vnc-port"
#: The screenshot answer's header saying what the picture is: ``display`` (the X screen) or ``page`` (the
#: browser page's viewport).
SCREENSHOT_SOURCE_HEADER = "x-podbay-screenshot-source"

_Coord = Field(ge=0, le=100_000, description="CSS pixels from the viewport's left or top edge.")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MouseAction(_Strict):
    """``POST .../computer/mouse``.

    - ``move``: the pointer to ``(x, y)``;
    - ``click``: press and release ``button`` at ``(x, y)``, ``clicks`` times (2: a double click);
    - ``drag``: press at ``(x, y)``, move to ``(to_x, to_y)`` in ``steps`` moves, release there;
    - ``scroll``: the wheel at ``(x, y)`` by ``(delta_x, delta_y)`` CSS pixels (positive: right, down).
    """

    action: Literal["move", "click", "drag", "scroll"]
    x: float = _Coord
    y: float = _Coord
    button: Literal["left", "right", "middle"] = "left"
    clicks: int = Field(1, ge=1, le=3)
    to_x: float | None = Field(None, ge=0, le=100_000)
    to_y: float | None = Field(None, ge=0, le=100_000)
    steps: int = Field(8, ge=1, le=100, description="Intermediate moves of a drag.")
    delta_x: float = Field(0, ge=-100_000, le=100_000)
    delta_y: float = Field(0, ge=-100_000, le=100_000)

    @model_validator(mode="after")
    def _drag_has_end(self) -> MouseAction:
        if self.action == "drag" and (self.to_x is None or self.to_y is None):
            raise ValueError("a drag needs to_x and to_y")
        return self


class KeyboardAction(_Strict):
    """``POST .../computer/keyboard``.

    - ``type``: insert ``text`` at the focus (as typed; no key events for each character);
    - ``keys``: press each of ``keys`` in turn: a key name as in the DOM's ``KeyboardEvent.key``
      (``Enter``, ``Tab``, ``Backspace``, ``ArrowDown``, ``a``, ...), with modifiers joined by ``+``
      (``Control+a``, ``Shift+Tab``; ``Control``, ``Alt``, ``Shift``, ``Meta``).
    """

    action: Literal["type", "keys"]
    text: str | None = Field(None, max_length=65_536)
    keys: list[str] | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _has_input(self) -> KeyboardAction:
        if self.action == "type" and self.text is None:
            raise ValueError("type needs text")
        if self.action == "keys" and not self.keys:
            raise ValueError("keys needs keys")
        return self


class ComputerResult(_Strict):
    """The answer of a mouse or keyboard action: what was done, in CDP input events."""

    events: int = Field(description="Input events dispatched to the page.")


class CdpTarget(_Strict):
    """The node's view of a sandbox's browser (``GET /internal/v1/sandboxes/{id}/computer/cdp``)."""

    port: int = Field(description="Guest port of CDP.")
    browser_path: str = Field(description="Path of the browser-wide CDP WebSocket, ``/devtools/browser/<id>``.")
    browser: str = Field(description="The browser's product and version, e.g. ``Chrome/138.0.7204.157``.")


class CdpEndpoint(_Strict):
    """``GET /v1/sandboxes/{id}/computer/cdp``: where a CDP client connects (through the API's port edge).

    ``url`` carries the sandbox's traffic token in its query (``?podbay_token=``), which the edge checks and
    removes, so it works as it is with ``playwright.chromium.connect_over_cdp(url)``; ``ws_url`` is the same
    without the token, for clients that send it as the ``X-Podbay-Access-Token`` header instead."""

    url: str
    ws_url: str
    token: str
    port: int
    browser: str


class FillRequest(_Strict):
    """``POST .../computer/fill``: type credential ``credential`` (its name) into the element ``selector``
    matches in the page's main document, if the page's origin is one of the credential's hosts."""

    credential: str = Field(min_length=1, max_length=128)
    selector: str = Field(min_length=1, max_length=1024, description="A CSS selector, e.g. ``input[name=password]``.")


class FillResult(_Strict):
    """What a fill did: never the value."""

    credential: str
    origin: str = Field(description="The page's origin the value was typed on, e.g. ``https://example.com``.")
    selector: str
    audit_id: int = Field(description="The ``credential.fill`` audit row.")
