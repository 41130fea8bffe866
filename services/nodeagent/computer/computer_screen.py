"""Screen pictures for the computer API, made on the node: the X screen of a desktop read over VNC, and the
masking of fields in a picture (docs/computer-use.md "Screenshots").

* :func:`read_display`: a template with a display declares its VNC server with the label
  ``podbay.vnc-port=<guest port>`` (:data:`~podbay.contracts.computer.VNC_PORT_LABEL`; the ``desktop``
  template: websockify on 6080 relaying x11vnc). The node speaks RFB (RFC 6143) over that port's WebSocket
  (``/websockify``, subprotocol ``binary``, noVNC's convention) as a shared viewer: the version and the
  ``None`` security type, one non-incremental ``FramebufferUpdateRequest`` for the whole screen in the raw
  encoding at 32 bits per pixel, and returns the screen as RGB (Pillow's :class:`~PIL.Image.Image`).
  Nothing runs in the guest for it and nothing is installed there.
* :func:`paint_masks`: opaque rectangles (:data:`MASK_RGB`) over boxes given in image pixels, on the node,
  after the picture left the guest: neither the page's script nor the guest sees a mask.

The guest is untrusted: the server's screen size is bounded (:data:`MAX_SIDE`), every read has a deadline,
rectangles outside the screen or in another encoding end the capture with :class:`GuestError`.
"""

from __future__ import annotations

import asyncio
import io
import math
import struct
from collections.abc import Iterable
from socket import socket

from PIL import Image, ImageDraw
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException
from websockets.typing import Subprotocol

from podbay.errors import GuestError, NoBrowser

__all__ = ["MASK_RGB", "MAX_SIDE", "read_display", "paint_masks", "to_png", "from_png"]

#: The colour of a mask: opaque black, (R, G, B).
MASK_RGB = (0, 0, 0)
#: Bound on the guest's screen width and height, pixels.
MAX_SIDE = 8192
#: Bound on the whole capture (handshake and one full frame; 3.5 MiB at 1280x720 through the guest's relay).
CAPTURE_TIMEOUT_S = 60.0
# SetPixelFormat: 32 bpp, depth 24, little-endian, true colour, 8 bits a channel, red at bit 16, green 8,
# blue 0: each pixel arrives as the bytes B, G, R, padding (Pillow's raw mode "BGRX").
_PIXEL_FORMAT = struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 1, 255, 255, 255, 16, 8, 0)


class _Reader:
    """Exact-length reads over a WebSocket whose binary messages split the RFB stream anywhere."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.buf = bytearray()

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            msg = await self.ws.recv()
            self.buf += msg if isinstance(msg, bytes) else msg.encode()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


async def _rfb_frame(ws: ClientConnection) -> Image.Image:
    r = _Reader(ws)
    version = await r.read(12)
    if not version.startswith(b"RFB 003."):
        raise GuestError("the display's VNC server did not greet with an RFB version")
    minor = int(version[8:11]) if version[8:11].isdigit() else 0
    mine = b"RFB 003.008\n" if minor >= 8 else b"RFB 003.003\n"
    await ws.send(mine)
    if mine == b"RFB 003.003\n":
        (sec,) = struct.unpack(">I", await r.read(4))
        if sec != 1:
            raise GuestError(f"the display's VNC server asks for security type {sec}; podbay reads it without one")
    else:
        (count,) = await r.read(1)
        types = await r.read(count)
        if 1 not in types:
            raise GuestError(f"the display's VNC server offers security types {list(types)}, not None (1)")
        await ws.send(b"\x01")
        (result,) = struct.unpack(">I", await r.read(4))
        if result != 0:
            raise GuestError("the display's VNC server refused the connection")
    await ws.send(b"\x01")  # ClientInit: shared, so a person's viewer stays connected
    width, height = struct.unpack(">HH", await r.read(4))
    await r.read(16)  # the server's pixel format: replaced below
    (name_len,) = struct.unpack(">I", await r.read(4))
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE) or name_len > 4096:
        raise GuestError(f"the display's VNC server announced a {width}x{height} screen")
    await r.read(name_len)
    await ws.send(b"\x00\x00\x00\x00" + _PIXEL_FORMAT)
    await ws.send(struct.pack(">BxHi", 2, 1, 0))  # SetEncodings: raw only
    await ws.send(struct.pack(">BBHHHH", 3, 0, 0, 0, width, height))
    frame = bytearray(width * height * 4)
    covered = 0
    while covered < width * height:
        (kind,) = await r.read(1)
        if kind == 0:  # FramebufferUpdate
            (rects,) = struct.unpack(">xH", await r.read(3))
            for _ in range(rects):
                x, y, w, h, enc = struct.unpack(">HHHHi", await r.read(12))
                if enc != 0 or x + w > width or y + h > height:
                    raise GuestError(f"the display's VNC server sent a rectangle it was not asked for "
                                     f"(encoding {enc}, {w}x{h} at {x},{y})")
                data = await r.read(w * h * 4)
                for row in range(h):
                    at = ((y + row) * width + x) * 4
                    frame[at:at + w * 4] = data[row * w * 4:(row + 1) * w * 4]
                covered += w * h
        elif kind == 2:  # Bell
            continue
        elif kind == 3:  # ServerCutText
            (n,) = struct.unpack(">3xI", await r.read(7))
            if n > 1 << 20:
                raise GuestError("the display's VNC server sent an oversized clipboard")
            await r.read(n)
        else:
            raise GuestError(f"the display's VNC server sent message type {kind}")
    return Image.frombuffer("RGB", (width, height), bytes(frame), "raw", "BGRX", 0, 1)


async def read_display(addr: str, port: int, sock: socket) -> Image.Image:
    """The guest's X screen, read from its VNC WebSocket at ``addr:port`` over the connected ``sock``, as an
    RGB image of the screen's size. ``NoBrowser`` (409) when the port does not take a WebSocket,
    ``GuestError`` (502) on a protocol error or no full frame within :data:`CAPTURE_TIMEOUT_S`."""
    try:
        async with asyncio.timeout(CAPTURE_TIMEOUT_S):
            async with connect(f"ws://{addr}:{port}/websockify", sock=sock, subprotocols=[Subprotocol("binary")],
                               max_size=16 << 20, compression=None, ping_interval=None,
                               user_agent_header=None) as ws:
                return await _rfb_frame(ws)
    except TimeoutError as exc:
        raise GuestError(f"the display did not send its screen within {CAPTURE_TIMEOUT_S:g} s") from exc
    except (WebSocketException, OSError) as exc:
        raise NoBrowser(f"the display's VNC WebSocket on guest port {port} does not answer "
                        f"({type(exc).__name__})", details={"port": port}) from exc


def paint_masks(img: Image.Image, boxes: Iterable[tuple[float, float, float, float]]) -> int:
    """Paint :data:`MASK_RGB` over each ``(left, top, right, bottom)`` box of ``img`` (image pixels, edges
    widened outwards to whole pixels, clipped to the image; non-finite or empty boxes are skipped); returns
    how many boxes were painted."""
    draw = ImageDraw.Draw(img)
    n = 0
    for left, top, right, bottom in boxes:
        if not all(map(math.isfinite, (left, top, right, bottom))):
            continue
        x0, y0 = max(0, math.floor(left)), max(0, math.floor(top))
        x1, y1 = min(img.width, math.ceil(right)), min(img.height, math.ceil(bottom))
        if x1 > x0 and y1 > y0:
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=MASK_RGB)
            n += 1
    return n


def from_png(data: bytes) -> Image.Image:
    """A PNG's pixels as RGB; ``GuestError`` when the bytes are no PNG."""
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as im:
            return im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise GuestError("the browser's screenshot is not a PNG") from exc


def to_png(img: Image.Image) -> bytes:
    """``img`` as PNG bytes (zlib level 1: the node's CPU is shared with the guests; the picture is small)."""
    out = io.BytesIO()
    img.save(out, format="PNG", compress_level=1)
    return out.getvalue()
