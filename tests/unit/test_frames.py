"""Property tests of the guest channel codec (podbay.channel.frames)."""

from __future__ import annotations

import itertools
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from podbay.channel import frames
from podbay.channel.frames import Decoder, Frame, FrameType, encode_frame

SMALL = 4096  # a small max payload keeps the truncation examples fast

frame_st = st.builds(
    Frame,
    type=st.sampled_from(list(FrameType)),
    stream=st.integers(0, 0xFFFFFFFF),
    payload=st.binary(max_size=600),
)
# Random bytes practically never contain a header with a valid CRC-32, so garbage can be arbitrary.
garbage_st = st.binary(min_size=1, max_size=3000)


def _enc(frame: Frame) -> bytes:
    return encode_frame(frame.type, frame.stream, frame.payload)


def _feed_in_pieces(dec: Decoder, data: bytes, cuts: list[int]) -> list[Frame]:
    out: list[Frame] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(points):
        out += dec.feed(data[a:b])
    return out


def _raw_header(ftype: int, stream: int, length: int, payload_crc: int, version: int = frames.VERSION) -> bytes:
    head = struct.pack(">2sBBIII", frames.MAGIC, version, ftype, stream, length, payload_crc)
    return head + zlib.crc32(head).to_bytes(4, "big")


@given(st.lists(frame_st, max_size=20), st.lists(st.integers(0, 1 << 20), max_size=30))
def test_round_trip_in_arbitrary_pieces(sent: list[Frame], cuts: list[int]) -> None:
    data = b"".join(_enc(f) for f in sent)
    dec = Decoder()
    assert _feed_in_pieces(dec, data, cuts) == sent
    assert dec.garbage_bytes == 0 and dec.bad_frames == 0
    assert dec.buffered == 0


@given(garbage_st, st.lists(st.integers(0, 1 << 20), max_size=10))
def test_garbage_never_raises_nor_yields(garbage: bytes, cuts: list[int]) -> None:
    dec = Decoder()
    assert _feed_in_pieces(dec, garbage, cuts) == []
    assert dec.buffered <= dec.max_buffer


@given(garbage_st, st.lists(frame_st, min_size=1, max_size=10), st.lists(st.integers(0, 1 << 20), max_size=10))
def test_resync_after_garbage(garbage: bytes, sent: list[Frame], cuts: list[int]) -> None:
    dec = Decoder()
    data = garbage + b"".join(_enc(f) for f in sent)
    assert _feed_in_pieces(dec, data, cuts) == sent
    assert dec.garbage_bytes >= 1


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(frame_st, min_size=1, max_size=4),
    st.data(),
    st.lists(frame_st, min_size=1, max_size=6),
)
def test_truncated_frame_then_new_frames(torn: list[Frame], data: st.DataObject, sent: list[Frame]) -> None:
    """The tail of an old connection's frame, then a new connection's frames: only whole frames come out."""
    old = b"".join(_enc(f) for f in torn)
    cut = data.draw(st.integers(1, len(old) - 1), label="cut")
    new = b"".join(_enc(f) for f in sent)
    dec = Decoder(max_payload=SMALL)
    got = dec.feed(old[:cut] + new)
    # Padding completes any torn frame still waiting for its payload; its CRC then fails and the decoder
    # rescans the bytes behind its header.
    got += dec.feed(b"\0" * (frames.HEADER_SIZE + SMALL))
    whole_old, end = [], 0
    torn_frame, rest = None, b""
    for frame in torn:
        enc = _enc(frame)
        if end + len(enc) <= cut:
            whole_old.append(frame)
        elif torn_frame is None:
            torn_frame, rest = frame, enc[cut - end :]
        end += len(enc)
    if torn_frame is not None and new.startswith(rest):
        # The new bytes happen to complete the torn frame exactly: it is delivered (it was sent), and the
        # new connection loses the frames those bytes belonged to; the host re-sends its HELLO for this.
        assert got[: len(whole_old) + 1] == [*whole_old, torn_frame]
        tail = got[len(whole_old) + 1 :]
        assert tail == sent[len(sent) - len(tail) :]
    else:
        assert got == whole_old + sent


def test_truncated_payload_is_dropped_and_following_frame_found() -> None:
    first = encode_frame(FrameType.DATA, 7, b"\x01" + b"x" * 1000)
    hello = encode_frame(FrameType.HELLO, 0, b'{"session":"s"}')
    dec = Decoder()
    assert dec.feed(first[:500] + hello) == []  # still waiting for the rest of frame 7
    assert dec.partial
    assert dec.feed(b"\0" * 600) == [Frame(FrameType.HELLO, 0, b'{"session":"s"}')]
    assert dec.bad_frames == 1


def test_abandon_partial_only_with_a_hello_behind() -> None:
    first = encode_frame(FrameType.DATA, 7, b"\x01" + b"x" * 100_000)
    dec = Decoder()
    data = encode_frame(FrameType.DATA, 9, b"\x01abc")
    assert dec.feed(first[:1000] + data) == []
    assert dec.abandon_partial() == []  # no HELLO behind it: keep waiting, it may just be slow
    assert dec.partial
    hello = encode_frame(FrameType.HELLO, 0, b"{}")
    assert dec.feed(hello) == []
    assert dec.abandon_partial() == [Frame(FrameType.DATA, 9, b"\x01abc"), Frame(FrameType.HELLO, 0, b"{}")]
    assert not dec.partial and dec.buffered == 0


def test_abandon_partial_without_requirement() -> None:
    dec = Decoder()
    dec.feed(encode_frame(FrameType.DATA, 7, b"\x01" + b"x" * 100)[:50])
    assert dec.partial
    assert dec.abandon_partial(require_hello=False) == []
    assert not dec.partial


@given(st.integers(frames.MAX_PAYLOAD + 1, 0xFFFFFFFF), st.lists(frame_st, min_size=1, max_size=5))
def test_oversized_length_is_skipped(length: int, sent: list[Frame]) -> None:
    bogus = _raw_header(FrameType.DATA, 1, length, 0)
    dec = Decoder()
    assert dec.feed(bogus + b"".join(_enc(f) for f in sent)) == sent
    assert dec.buffered == 0


@given(st.integers(0, 255), st.integers(0, 255), st.lists(frame_st, min_size=1, max_size=3))
def test_unknown_type_or_version_is_skipped_whole(ftype: int, version: int, sent: list[Frame]) -> None:
    known = {int(t) for t in FrameType}
    if ftype in known and version == frames.VERSION:
        ftype = 200
    payload = b"PB" + b"\x00" * 30  # payload that looks like the start of a frame must not confuse it
    alien = _raw_header(ftype, 3, len(payload), zlib.crc32(payload), version=version) + payload
    dec = Decoder()
    assert dec.feed(alien + b"".join(_enc(f) for f in sent)) == sent
    assert dec.skipped_frames == 1


def test_corrupt_payload_is_not_delivered() -> None:
    good = bytearray(encode_frame(FrameType.RESULT, 5, b'{"ok":true}'))
    good[-1] ^= 0xFF
    dec = Decoder()
    assert dec.feed(bytes(good)) == []
    assert dec.bad_frames == 1


def test_buffer_is_capped_under_a_flood() -> None:
    dec = Decoder()
    # A valid header claiming the maximum payload, then far more bytes than that without a valid frame.
    dec.feed(_raw_header(FrameType.DATA, 1, frames.MAX_PAYLOAD, 0))
    for _ in range(40):
        assert dec.feed(b"P" * 65536) == []
        assert dec.buffered <= dec.max_buffer
    assert dec.garbage_bytes > 0


def test_encode_limits() -> None:
    with pytest.raises(frames.FrameError):
        encode_frame(FrameType.DATA, 1, b"x" * (frames.MAX_PAYLOAD + 1))
    with pytest.raises(frames.FrameError):
        encode_frame(FrameType.DATA, 1 << 32, b"")
    with pytest.raises(frames.FrameError):
        frames.encode_credit(1, 0)
    with pytest.raises(frames.FrameError):
        frames.encode_signal(1, 0)
    assert len(encode_frame(FrameType.CANCEL, 1)) == frames.HEADER_SIZE


def test_payload_helpers() -> None:
    assert frames.parse_data(b"\x02err") == (2, b"err")
    assert frames.parse_u32(frames.encode_credit(1, 1 << 20)[frames.HEADER_SIZE :]) == 1 << 20
    assert frames.parse_signal(b"\x0f") == 15
    assert frames.parse_json(frames.json_payload({"a": [1, "é"]})) == {"a": [1, "é"]}
    for bad in (b"", b"\xff", b"[1]", b"{", b"1"):
        with pytest.raises(frames.FrameError):
            frames.parse_json(bad)
    with pytest.raises(frames.FrameError):
        frames.parse_data(b"")
    with pytest.raises(frames.FrameError):
        frames.parse_u32(b"\0\0\0\0")
    with pytest.raises(frames.FrameError):
        frames.parse_fd(b"")


def test_frames_module_uses_only_the_standard_library() -> None:
    """The codec is copied into the guest image beside guestd, which has no third-party packages."""
    import ast
    import sys
    from pathlib import Path

    allowed = set(sys.stdlib_module_names) | {"__future__"}
    for path in [Path(frames.__file__), *sorted(Path(frames.__file__).parents[3].joinpath("guestd").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in allowed or name in ("podbay.channel", "podbay.channel.frames"), (path.name, name)
