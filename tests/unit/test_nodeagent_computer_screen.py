"""services/nodeagent/computer/computer_screen.py: the X screen read over a VNC WebSocket (a small RFB 3.8 server on
loopback speaking as x11vnc behind websockify does) and masks painted on a picture."""

from __future__ import annotations

import socket
import struct

import pytest
from PIL import Image
from podbay_nodeagent.computer.computer_screen import MASK_RGB, from_png, paint_masks, read_display, to_png
from websockets.asyncio.server import ServerConnection, serve

from podbay.errors import GuestError

W, H = 5, 3


def _pixel(x: int, y: int) -> tuple[int, int, int]:
    return (10 * x, 20 * y, 7)


async def _rfb_server(ws: ServerConnection, *, encoding: int = 0) -> None:
    """An RFB 3.8 server with no security and a WxH screen, sent as two raw rectangles (top row, then the
    rest) in messages split at odd places, as a relay may split them."""
    await ws.send(b"RFB 003.008\n")
    assert await ws.recv() == b"RFB 003.008\n"
    await ws.send(b"\x02\x02\x01")  # two types offered: VNC auth and None
    assert await ws.recv() == b"\x01"
    await ws.send(struct.pack(">I", 0))
    assert await ws.recv() == b"\x01"  # shared
    await ws.send(struct.pack(">HH", W, H) + bytes(16) + struct.pack(">I", 4) + b"test")
    assert (await ws.recv())[0] == 0  # SetPixelFormat
    assert (await ws.recv())[0] == 2  # SetEncodings
    assert await ws.recv() == struct.pack(">BBHHHH", 3, 0, 0, 0, W, H)

    def raw(y0: int, h: int) -> bytes:
        return b"".join(bytes((b, g, r, 0)) for y in range(y0, y0 + h) for x in range(W)
                        for r, g, b in [_pixel(x, y)])

    stream = (b"\x02"  # a bell first
              + struct.pack(">BxH", 0, 2) + struct.pack(">HHHHi", 0, 0, W, 1, encoding) + raw(0, 1)
              + struct.pack(">HHHHi", 0, 1, W, H - 1, 0) + raw(1, H - 1))
    for i in range(0, len(stream), 7):
        await ws.send(stream[i:i + 7])
    await ws.wait_closed()


async def _capture(encoding: int = 0) -> tuple[tuple[int, int], list[tuple[int, int, int]]]:
    """The captured screen's size and its pixels, row by row."""
    async with serve(lambda ws: _rfb_server(ws, encoding=encoding), "127.0.0.1", 0,
                     subprotocols=["binary"]) as server:  # type: ignore[list-item]
        port = next(iter(server.sockets)).getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port))
        img = await read_display("127.0.0.1", port, sock)
        return img.size, [img.getpixel((x, y)) for y in range(img.height) for x in range(img.width)]


async def test_the_screen_is_read_over_rfb_in_raw_pixels() -> None:
    size, pixels = await _capture()
    assert size == (W, H)
    assert pixels == [_pixel(x, y) for y in range(H) for x in range(W)]


async def test_a_rectangle_in_an_encoding_not_asked_for_is_refused() -> None:
    with pytest.raises(GuestError):
        await _capture(encoding=16)


def test_masks_cover_their_boxes_and_survive_png() -> None:
    img = Image.new("RGB", (40, 20), (255, 255, 255))
    assert paint_masks(img, [(2.5, 3.2, 10.1, 8.0), (float("nan"), 0, 1, 1), (50, 50, 60, 60)]) == 1
    back = from_png(to_png(img))
    assert all(back.getpixel((x, y)) == MASK_RGB for x in range(2, 11) for y in range(3, 8))
    assert back.getpixel((11, 5)) == (255, 255, 255) and back.getpixel((5, 8)) == (255, 255, 255)
    with pytest.raises(GuestError):
        from_png(b"not a png")
