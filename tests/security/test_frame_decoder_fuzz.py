"""Guest vs host: the host's decoder of guest channel frames (podbay.channel.frames.Decoder) does work linear
in what the guest sends, whatever it sends, and the host drops a channel after N bad frames in a row
(podbay.channel.transport).

Work is counted, not timed: ``Decoder.work`` is the number of bytes the decoder examined (scanned for the
magic, parsed as headers, CRC'd as payloads). The bound asserted is the one the decoder's docstring states:
per byte fed 1 scanned + HEADER_SIZE / 2 of headers + 1 of delivered payload + CHECK_BUDGET_PER_BYTE of bad
payloads, and 2 * HEADER_SIZE per ``feed`` call. The decoder before this bound CRC'd every nested bogus
header's claimed payload: 13,000 bytes examined per byte fed on the nested stream below.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podbay.channel import frames
from podbay.channel.client import ChannelBroken, GuestChannel
from podbay.channel.frames import Decoder, FrameType

PER_BYTE = 1 + frames.HEADER_SIZE / 2 + 1 + frames.CHECK_BUDGET_PER_BYTE
PER_FEED = 2 * frames.HEADER_SIZE


def _header(length: int, payload_crc: int, *, ftype: int = FrameType.DATA, stream: int = 1) -> bytes:
    """A header with a valid header CRC claiming ``length`` payload bytes of CRC ``payload_crc``."""
    head = struct.pack(">2sBBIII", frames.MAGIC, frames.VERSION, ftype, stream, length, payload_crc)
    return head + zlib.crc32(head).to_bytes(4, "big")


def _bound(n_bytes: int, n_feeds: int) -> float:
    return PER_BYTE * n_bytes + PER_FEED * n_feeds


# Pieces an adversarial guest strings together: noise, magic runs, valid frames, bogus headers claiming up to
# the maximum payload (nested in each other when repeated), oversized lengths, and torn valid frames.
piece_st = st.one_of(
    st.binary(max_size=2000),
    st.integers(1, 3000).map(lambda n: b"PB" * n),
    st.builds(lambda p: frames.encode_frame(FrameType.DATA, 3, p), st.binary(max_size=3000)),
    st.builds(lambda n, k: _header(n, 0) * k, st.integers(0, frames.MAX_PAYLOAD), st.integers(1, 200)),
    st.builds(lambda n: _header(n, 0), st.integers(frames.MAX_PAYLOAD + 1, 0xFFFFFFFF)),
    st.builds(lambda p, c: frames.encode_frame(FrameType.RESULT, 5, p)[: c % (len(p) + 20)],
              st.binary(min_size=1, max_size=3000), st.integers(1, 1 << 16)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(piece_st, min_size=1, max_size=40), st.lists(st.integers(1, 1 << 18), min_size=1, max_size=40))
def test_work_per_input_byte_is_bounded(pieces: list[bytes], sizes: list[int]) -> None:
    data = b"".join(pieces)
    dec = Decoder()
    pos, feeds, i = 0, 0, 0
    while pos < len(data):
        step = sizes[i % len(sizes)]
        dec.feed(data[pos : pos + step])
        pos, feeds, i = pos + step, feeds + 1, i + 1
    assert dec.work <= _bound(len(data), feeds)
    assert dec.buffered <= dec.max_buffer


def test_nested_bogus_headers_cost_a_constant_per_byte() -> None:
    """4 MiB of headers 20 bytes apart, each claiming a maximal payload whose CRC fails: every one becomes
    checkable, nested in the previous ones; the old decoder CRC'd 256 KiB for every 20 bytes."""
    stream = _header(frames.MAX_PAYLOAD, 0) * (4 * 1024 * 1024 // frames.HEADER_SIZE)
    dec = Decoder()
    feeds = 0
    for at in range(0, len(stream), 65536):
        dec.feed(stream[at : at + 65536])
        feeds += 1
    assert dec.work <= _bound(len(stream), feeds)
    assert dec.work / len(stream) < 8  # measured 5.9
    assert dec.bad_frames > 1000 and dec.frames == 0


def test_byte_at_a_time_feeding_is_bounded_per_feed() -> None:
    stream = (_header(3000, 0) + b"PB" * 50) * 40
    dec = Decoder()
    for b in stream:
        dec.feed(bytes((b,)))
    assert dec.work <= _bound(len(stream), len(stream))


def test_frames_still_come_through_after_an_attack() -> None:
    """The budget is per byte received: once the bogus headers are gone, valid frames are checked again."""
    dec = Decoder()
    dec.feed(_header(frames.MAX_PAYLOAD, 0) * 30000)
    dec.feed(b"\0" * frames.MAX_PAYLOAD)  # completes every pending bogus candidate
    good = frames.encode_frame(FrameType.DATA, 3, b"\x01" + b"x" * 60000)
    assert [f.payload[1:] for f in dec.feed(good * 8)] == [b"x" * 60000] * 8
    assert dec.consecutive_bad == 0


@pytest.mark.parametrize("limit", [1, 4, 8])
def test_consecutive_bad_frames_are_counted_until_a_good_one(limit: int) -> None:
    dec = Decoder()
    bad = _header(4, 0) + b"abcd"
    dec.feed(bad * limit)
    assert dec.consecutive_bad == limit
    dec.feed(frames.encode_frame(FrameType.DATA, 3, b"\x01ok"))
    assert dec.consecutive_bad == 0 and dec.bad_frames == limit


async def _hostile_guest(path: Path, attack: bytes) -> asyncio.AbstractServer:
    """Answers the host's HELLO, then sends ``attack`` in reply to the first request."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = Decoder()
        while data := await reader.read(65536):
            for frame in dec.feed(data):
                if frame.type is FrameType.HELLO:
                    session = frames.parse_json(frame.payload)["session"]
                    writer.write(frames.encode_json(FrameType.HELLO, 0, {
                        "version": 1, "boot_id": "b", "uptime_s": 1.0, "pid": 1, "hostname": "h",
                        "session": session}))
                elif frame.type is FrameType.OPEN:
                    writer.write(attack)
        writer.close()

    return await asyncio.start_unix_server(serve, str(path))


@pytest.mark.parametrize("kind", ["torn", "oversized", "garbage"])
async def test_n_bad_frames_close_the_channel(tmp_path: Path, kind: str) -> None:
    limit = 4
    attack = {
        "torn": (_header(4, 0, ftype=FrameType.RESULT) + b"{}{}") * limit,
        "oversized": _header(1 << 30, 0) * limit,
        "garbage": b"\0" * (limit * (frames.HEADER_SIZE + frames.MAX_PAYLOAD)),
    }[kind]
    path = tmp_path / "ch.sock"
    server = await _hostile_guest(path, attack)
    try:
        ch = await GuestChannel.connect(path, timeout_s=10, request_timeout_s=30, max_bad_frames=limit)
        try:
            async with asyncio.timeout(10):  # well before the request timeout: no hang
                with pytest.raises(ChannelBroken):
                    await ch.ping()
            assert ch.closed
            with pytest.raises(ChannelBroken):
                await ch.ping()
        finally:
            await ch.close()
    finally:
        server.close()
        await server.wait_closed()
