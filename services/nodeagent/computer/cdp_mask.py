"""Masks in the screenshots an agent takes itself over CDP, once a credential was filled into its sandbox's page
(docs/credentials.md, "Screenshots after a fill").

The API's screenshots are masked on the node (:mod:`.computer`). An agent driving the browser over CDP through
the port edge (Playwright's ``page.screenshot``, browser-use's vision) asks the browser for
``Page.captureScreenshot`` itself, and the picture of a text field a fill typed into shows the value. So, for
one relayed CDP connection of a sandbox with fills, :class:`ScreenshotMasker`:

1. on each ``Page.captureScreenshot`` the client sends, first sends a probe of its own in the same session
   (``Runtime.evaluate`` with an id from :data:`PROBE_ID_BASE` up): the viewport's width and scroll offsets and
   the boxes (``getBoundingClientRect``, CSS pixels) of the page's password fields and of the fields fills typed
   into. The browser answers a session's commands in order, so the probe's answer comes before the picture;
2. swallows the probe's answer (the client never sees it);
3. paints the boxes black on the picture in the answer to the client's command, in its own format (PNG, JPEG
   or WebP), mapped to the picture's pixels with the command's ``clip`` (both readings of a clip, relative to
   the viewport and to the document, are masked when the page is scrolled: a few black boxes too many rather
   than one too few), widened by :data:`~.computer.MASK_MARGIN_PX`.

It fails closed: when the probe failed or its answer is missing, or the picture cannot be read, the client gets
a CDP error for its command rather than the picture. Limits, as for the API's screenshots, and beyond them: the
probe runs in the page's main world, so a page script can lie to it (the trust model in docs/credentials.md
already gives such a script the value); ``Page.screencastFrame`` events and PDFs (``Page.printToPDF``) are not
masked.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from .computer import MASK_MARGIN_PX, MAX_MASKED_FIELDS, PASSWORD_FIELDS, guest_number
from .computer_screen import paint_masks, to_png

__all__ = ["PROBE_ID_BASE", "RelayFilter", "ScreenshotMasker"]

log = logging.getLogger("podbay.nodeagent.cdp_mask")

#: Ids of the masker's own probes: far above what CDP clients count up to from 1 (Playwright, Puppeteer,
#: chromedp), below 2**31 (Chromium reads ids as int32).
PROBE_ID_BASE = 1_900_000_000
#: Screenshots awaiting their answer on one connection; beyond it a screenshot is refused, not left unmasked.
MAX_PENDING = 64
#: What the client is told when its picture cannot be masked (a CDP error: JSON-RPC's server error range).
UNMASKABLE = {"code": -32000, "message": "podbay: this screenshot could not be masked after a credential fill in "
              "this sandbox; POST /v1/sandboxes/{id}/computer/screenshot gives a masked one"}

_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


@dataclass(frozen=True)
class RelayFilter:
    """The two transforms of one relayed WebSocket (:func:`podbay.asgiproxy.relay_websocket`): ``to_upstream``
    turns each client message into the messages sent on (in order), ``to_client`` each upstream message into
    the one the client gets (None: none)."""

    to_upstream: Callable[[str | bytes], list[str | bytes]]
    to_client: Callable[[str | bytes], str | bytes | None]


def _probe_expression(selectors: list[str]) -> str:
    """JavaScript returning ``{w, sx, sy, r: [[left, top, right, bottom], ...]}`` (CSS pixels, viewport-relative
    boxes of the rendered elements ``selectors`` match, at most :data:`MAX_MASKED_FIELDS`); a selector the
    page's engine refuses matches nothing."""
    return ("(() => { const out = [], seen = new Set();"
            f" for (const s of {json.dumps(selectors)}) {{ let els; try {{ els = document.querySelectorAll(s); }}"
            " catch (e) { continue; }"
            f" for (const e of els) {{ if (seen.has(e) || out.length >= {MAX_MASKED_FIELDS}) continue; seen.add(e);"
            " const b = e.getBoundingClientRect(); if (b.width > 0 && b.height > 0)"
            " out.push([b.left, b.top, b.right, b.bottom]); } }"
            " return {w: innerWidth, sx: scrollX, sy: scrollY, r: out}; })()")


def picture_boxes(probe: dict[str, Any], params: dict[str, Any], width_px: int) -> list[tuple[float, float, float,
                                                                                                float]]:
    """The probe's boxes in the pixels of a picture ``width_px`` wide taken with ``params`` (the command's:
    ``clip`` ``{x, y, width, height}`` in CSS pixels, else the viewport), each widened by MASK_MARGIN_PX. A clip
    and a scrolled page give two placements per box (see the module docstring)."""
    sx, sy = guest_number(probe.get("sx")), guest_number(probe.get("sy"))
    clip = params.get("clip") if isinstance(params.get("clip"), dict) else None
    if clip is not None:
        css_w = guest_number(clip.get("width"))
        cx, cy = guest_number(clip.get("x")), guest_number(clip.get("y"))
        origins = {(cx, cy), (cx - sx, cy - sy)}
    else:
        css_w = guest_number(probe.get("w"))
        origins = {(0.0, 0.0), (-sx, -sy)}  # the viewport; the document from its top (captureBeyondViewport)
    scale = width_px / css_w if css_w > 0 else 1.0
    m = MASK_MARGIN_PX
    boxes = []
    for r in probe.get("r") or []:
        if not isinstance(r, list) or len(r) != 4:
            continue
        left, top, right, bottom = (guest_number(v) for v in r)
        for ox, oy in origins:
            boxes.append(((left - ox) * scale - m, (top - oy) * scale - m, (right - ox) * scale + m,
                          (bottom - oy) * scale + m))
    return boxes


def mask_picture(data_b64: str, params: dict[str, Any], probe: dict[str, Any]) -> str:
    """``data_b64`` (a ``Page.captureScreenshot`` answer's ``data``) with the probe's boxes painted, in the
    command's format; ValueError when it is no picture of that format."""
    fmt = _FORMATS.get(str(params.get("format") or "png"), "PNG")
    try:
        raw = base64.b64decode(data_b64, validate=True)
        with Image.open(io.BytesIO(raw), formats=[fmt]) as im:
            img = im.convert("RGB")
    except (OSError, binascii.Error, Image.DecompressionBombError) as exc:
        raise ValueError(f"not a {fmt} picture: {exc}") from exc
    paint_masks(img, picture_boxes(probe, params, img.width))
    if fmt == "PNG":
        return base64.b64encode(to_png(img)).decode("ascii")
    out = io.BytesIO()
    img.save(out, format=fmt, quality=int(guest_number(params.get("quality")) or 80))
    return base64.b64encode(out.getvalue()).decode("ascii")


class ScreenshotMasker:
    """The masking of one relayed CDP connection (module docstring). ``selectors()`` gives the sandbox's filled
    fields, or None while nothing was filled (then messages pass untouched)."""

    def __init__(self, selectors: Callable[[], set[str] | None]) -> None:
        self._selectors = selectors
        self._next = PROBE_ID_BASE
        # (session id, command id) -> (the command's params, its probe's id)
        self._pending: OrderedDict[tuple[str | None, int], tuple[dict[str, Any], int]] = OrderedDict()
        # probe id -> its answer's result value, or None when it failed
        self._probes: dict[int, dict[str, Any] | None] = {}

    def to_upstream(self, data: str | bytes) -> list[str | bytes]:
        """The client's message, preceded by a probe when it is a ``Page.captureScreenshot`` after a fill."""
        if not isinstance(data, str) or "Page.captureScreenshot" not in data:
            return [data]
        selectors = self._selectors()
        if selectors is None:
            return [data]
        try:
            msg = json.loads(data)
        except ValueError:
            return [data]
        if not isinstance(msg, dict) or msg.get("method") != "Page.captureScreenshot" or not isinstance(
                msg.get("id"), int):
            return [data]
        session = msg.get("sessionId") if isinstance(msg.get("sessionId"), str) else None
        raw_params = msg.get("params")
        params: dict[str, Any] = raw_params if isinstance(raw_params, dict) else {}
        key = (session, int(msg["id"]))
        if len(self._pending) >= MAX_PENDING:
            self._pending[key] = (params, -1)  # answered with UNMASKABLE: never a picture unmasked
            return [data]
        probe_id, self._next = self._next, self._next + 1
        self._pending[key] = (params, probe_id)
        self._probes[probe_id] = None
        probe: dict[str, Any] = {"id": probe_id, "method": "Runtime.evaluate", "params": {
            "expression": _probe_expression([PASSWORD_FIELDS, *sorted(selectors)]), "returnByValue": True}}
        if session is not None:
            probe["sessionId"] = session
        return [json.dumps(probe), data]

    def to_client(self, data: str | bytes) -> str | bytes | None:
        """The browser's message as the client gets it: a probe's answer swallowed (None), a screenshot's
        answer masked (or turned into :data:`UNMASKABLE`), anything else untouched."""
        if not self._pending or not isinstance(data, str) or '"id"' not in data[:64] and '"id"' not in data[-64:]:
            return data
        try:
            msg = json.loads(data)
        except ValueError:
            return data
        if not isinstance(msg, dict) or not isinstance(msg.get("id"), int):
            return data
        msg_id = int(msg["id"])
        session = msg.get("sessionId") if isinstance(msg.get("sessionId"), str) else None
        if msg_id in self._probes:
            value = ((msg.get("result") or {}).get("result") or {}).get("value") if "exceptionDetails" not in (
                msg.get("result") or {}) else None
            self._probes[msg_id] = value if isinstance(value, dict) else None
            return None
        entry = self._pending.pop((session, msg_id), None)
        if entry is None:
            return data
        params, probe_id = entry
        probe = self._probes.pop(probe_id, None)
        result = msg.get("result")
        if not isinstance(result, dict) or "data" not in result:
            return data  # the browser's own error: no picture to mask
        try:
            if probe is None:
                raise ValueError("the probe of the page's fields failed")
            result["data"] = mask_picture(str(result["data"]), params, probe)
        except ValueError as exc:
            log.warning("a CDP screenshot could not be masked, refused: %s", exc)
            answer: dict[str, Any] = {"id": msg_id, "error": dict(UNMASKABLE)}
            if session is not None:
                answer["sessionId"] = session
            return json.dumps(answer)
        return json.dumps(msg)
