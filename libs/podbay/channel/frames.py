"""The guest channel frame codec. Standard library only: this file is copied into the guest image.

Frame layout (all integers big-endian), ``HEADER_SIZE`` = 20 bytes, then ``length`` payload bytes::

    offset size field
    0      2    magic          b"PB"
    2      1    version        VERSION (1)
    3      1    type           FrameType
    4      4    stream id      u32; 0 is the connection itself (HELLO)
    8      4    length         u32 payload length, at most MAX_PAYLOAD (256 KiB)
    12     4    payload crc    CRC-32 (zlib) of the payload
    16     4    header crc     CRC-32 (zlib) of bytes 0..15

The two checksums let a reader resynchronise on a byte stream that carries the tail of an older
connection's frame followed by a new connection's bytes (a virtio-serial port does not tell the guest that
the host reconnected): a candidate header must have the magic, a valid header CRC and a sane length, and a
frame is only delivered when its payload CRC matches; otherwise the decoder skips one byte and scans on.
That rescan stays linear in the input: checking the payload of a candidate that turns out bad is paid from a
budget of ``CHECK_BUDGET_PER_BYTE`` bytes per byte received, and a candidate the budget cannot pay for is
dropped unchecked (``Decoder``), so crafted headers nested in each other cannot make the reader CRC the same
bytes over and over.

Payload conventions per type (see docs/channel.md): OPEN/RESULT/ERROR/HELLO/STARTED are UTF-8 JSON
objects; DATA is one fd byte (0 stdin, 1 stdout, 2 stderr, 3 file bytes) then data; EOF is one fd byte;
CREDIT is a u32 byte count; SIGNAL is one byte (signal number); CANCEL is empty.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "CHUNK_SIZE",
    "CHECK_BUDGET_PER_BYTE",
    "INITIAL_WINDOW",
    "CREDIT_BATCH",
    "CONNECTION_STREAM",
    "FD_STDIN",
    "FD_STDOUT",
    "FD_STDERR",
    "FD_FILE",
    "FrameType",
    "Frame",
    "FrameError",
    "Decoder",
    "encode_frame",
    "encode_json",
    "encode_data",
    "encode_eof",
    "encode_credit",
    "encode_signal",
    "json_payload",
    "parse_json",
    "parse_data",
    "parse_fd",
    "parse_u32",
    "parse_signal",
]

MAGIC = b"PB"
VERSION = 1
_HEADER = struct.Struct(">2sBBIIII")
HEADER_SIZE = _HEADER.size  # 20
MAX_PAYLOAD = 256 * 1024
# DATA chunks carry at most this many data bytes (plus the fd byte), so several streams interleave fairly.
CHUNK_SIZE = 64 * 1024
# Per-stream flow-control window, in DATA payload bytes, granted to each side when a stream opens.
INITIAL_WINDOW = 1024 * 1024
# Receivers return credit once this many bytes are consumed, to keep CREDIT frames rare.
CREDIT_BATCH = 256 * 1024
CONNECTION_STREAM = 0
# Payload bytes of bad candidate frames the decoder may CRC per byte it is fed (module docstring): a torn
# frame is checked once out of the budget its own bytes brought, while a stream of nested bogus headers
# claiming large payloads runs out of budget and is dropped unchecked.
CHECK_BUDGET_PER_BYTE = 4
_MAX_U32 = 0xFFFFFFFF

FD_STDIN = 0
FD_STDOUT = 1
FD_STDERR = 2
FD_FILE = 3


class FrameType(enum.IntEnum):
    """Frame types; the payload of each is described in the module docstring."""

    HELLO = 1
    OPEN = 2
    DATA = 3
    EOF = 4
    RESULT = 5
    ERROR = 6
    CREDIT = 7
    SIGNAL = 8
    CANCEL = 9
    STARTED = 10


_KNOWN_TYPES = frozenset(int(t) for t in FrameType)
_TYPE_OF = {int(t): t for t in FrameType}  # a dict lookup is much cheaper than FrameType(n) in the guest


class FrameError(ValueError):
    """A frame or payload that cannot be built or parsed (bad size, bad JSON, bad fd byte)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: ``type``, ``stream`` (u32) and ``payload`` (at most ``MAX_PAYLOAD`` bytes)."""

    type: FrameType
    stream: int
    payload: bytes = b""


def encode_frame(
    ftype: FrameType | int, stream: int, payload: bytes = b"", *, max_payload: int = MAX_PAYLOAD
) -> bytes:
    """Encode one frame to bytes (header + payload).

    Raises ``FrameError`` when the payload is longer than ``max_payload`` or the stream id is not a u32.
    """
    if not 0 <= stream <= _MAX_U32:
        raise FrameError(f"stream id {stream} is not a u32")
    if len(payload) > max_payload:
        raise FrameError(f"payload of {len(payload)} bytes exceeds {max_payload}")
    head = _HEADER.pack(MAGIC, VERSION, int(ftype), stream, len(payload), zlib.crc32(payload), 0)
    header_crc = zlib.crc32(head[:16])
    return head[:16] + header_crc.to_bytes(4, "big") + bytes(payload)


def json_payload(obj: Any) -> bytes:
    """Compact UTF-8 JSON bytes for an OPEN/RESULT/ERROR/HELLO/STARTED payload."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def encode_json(ftype: FrameType, stream: int, obj: Any) -> bytes:
    """Encode a frame whose payload is ``obj`` as JSON. Raises ``FrameError`` if it is too large."""
    return encode_frame(ftype, stream, json_payload(obj))


def encode_data(stream: int, fd: int, data: bytes) -> bytes:
    """Encode a DATA frame: fd byte then ``data`` (at most ``MAX_PAYLOAD - 1`` bytes)."""
    if not 0 <= fd <= 255:
        raise FrameError(f"fd {fd} is not a byte")
    return encode_frame(FrameType.DATA, stream, bytes((fd,)) + bytes(data))


def encode_eof(stream: int, fd: int) -> bytes:
    """Encode an EOF frame for ``fd`` (0 stdin, 3 file)."""
    return encode_frame(FrameType.EOF, stream, bytes((fd,)))


def encode_credit(stream: int, nbytes: int) -> bytes:
    """Encode a CREDIT frame granting ``nbytes`` (1..2**32-1) more DATA payload bytes."""
    if not 0 < nbytes <= _MAX_U32:
        raise FrameError(f"credit {nbytes} is not a positive u32")
    return encode_frame(FrameType.CREDIT, stream, nbytes.to_bytes(4, "big"))


def encode_signal(stream: int, signum: int) -> bytes:
    """Encode a SIGNAL frame carrying signal number ``signum`` (1..255)."""
    if not 0 < signum <= 255:
        raise FrameError(f"signal {signum} out of range")
    return encode_frame(FrameType.SIGNAL, stream, bytes((signum,)))


def parse_json(payload: bytes) -> dict[str, Any]:
    """Decode a JSON object payload. Raises ``FrameError`` on bad UTF-8, bad JSON or a non-object."""
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"bad JSON payload: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError("JSON payload is not an object")
    return obj


def parse_data(payload: bytes) -> tuple[int, bytes]:
    """Split a DATA payload into ``(fd, data)``. Raises ``FrameError`` when it is empty."""
    if not payload:
        raise FrameError("DATA payload lacks the fd byte")
    return payload[0], payload[1:]


def parse_fd(payload: bytes) -> int:
    """The fd byte of an EOF payload. Raises ``FrameError`` unless the payload is exactly one byte."""
    if len(payload) != 1:
        raise FrameError("EOF payload must be one fd byte")
    return payload[0]


def parse_u32(payload: bytes) -> int:
    """The byte count of a CREDIT payload. Raises ``FrameError`` unless it is exactly 4 bytes, non-zero."""
    if len(payload) != 4:
        raise FrameError("CREDIT payload must be 4 bytes")
    value = int.from_bytes(payload, "big")
    if value == 0:
        raise FrameError("CREDIT of zero")
    return value


def parse_signal(payload: bytes) -> int:
    """The signal number of a SIGNAL payload. Raises ``FrameError`` unless it is one non-zero byte."""
    if len(payload) != 1 or payload[0] == 0:
        raise FrameError("SIGNAL payload must be one non-zero byte")
    return payload[0]


class Decoder:
    """Incremental frame decoder for an untrusted byte stream; never raises on bad input.

    ``feed(data) -> list[Frame]`` returns every complete, valid frame. Bytes that are not part of a valid
    frame are skipped and counted in ``garbage_bytes``; candidate frames (magic and header CRC valid) that are
    not delivered count in ``bad_frames``: a payload CRC that fails, a length over ``max_payload``, or a
    candidate whose payload the check budget cannot pay for, and each ``max_buffer`` bytes of garbage in a
    row; ``consecutive_bad`` counts bad frames since the last delivered one (a reader drops a connection past
    a limit of its own). Well-formed frames of another
    version or an unknown type count in ``skipped_frames``. The buffer never holds more than
    ``HEADER_SIZE + max_payload`` bytes after a ``feed``.

    Work is linear in the input: ``work`` counts the bytes examined (bytes scanned for the magic, 20 per
    header parsed, payload bytes CRC'd). Per byte fed that is at most 1 scanned, ``HEADER_SIZE / 2`` of
    headers (a magic needs two bytes), 1 of a delivered payload and ``CHECK_BUDGET_PER_BYTE`` of bad
    payloads; per ``feed`` call at most ``2 * HEADER_SIZE`` more (the pending header and the kept tail are
    looked at again). tests/security/test_frame_decoder_fuzz.py checks this bound.
    """

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self.max_buffer = HEADER_SIZE + max_payload
        self._buf = bytearray()
        self._budget = 0
        self.garbage_bytes = 0
        self.bad_frames = 0
        self.consecutive_bad = 0
        self._garbage_run = 0
        self.skipped_frames = 0
        self.frames = 0
        self.work = 0

    @property
    def buffered(self) -> int:
        """Bytes held, waiting for the rest of a frame."""
        return len(self._buf)

    @property
    def partial(self) -> bool:
        """True when the buffer starts with a valid header whose payload has not fully arrived."""
        head = self._header_at(0) if self._buf else None
        return head is not None and head[0] != -2

    def feed(self, data: bytes) -> list[Frame]:
        """Add bytes; return the frames completed by them, in order."""
        self._buf += data
        # Capped (at what one maximal frame brings) so that a long stream does not bank a budget which a
        # later burst of bogus headers could spend at once.
        self._budget = min(self._budget + CHECK_BUDGET_PER_BYTE * len(data), CHECK_BUDGET_PER_BYTE * self.max_buffer)
        return self._drain()

    def abandon_partial(self, *, require_hello: bool = True) -> list[Frame]:
        """Give up on a pending partial frame and rescan the bytes buffered behind its header.

        Used by a reader that has waited too long for the rest of a frame: the writer of that frame is
        probably gone (a host that disconnected mid-frame) and a new one has started. With
        ``require_hello`` (the default), the partial frame is only abandoned when the buffered bytes behind
        its header hold a complete valid HELLO frame, the first frame of every new connection, so a frame
        that is merely slow is never dropped. Returns the frames found by the rescan.
        """
        if not self.partial:
            return []
        if require_hello and not self._holds_hello(1):
            return []
        del self._buf[:1]
        self._bad()
        self.garbage_bytes += 1
        return self._drain()

    def _bad(self) -> None:
        self.bad_frames += 1
        self.consecutive_bad += 1

    def _garbage(self, n: int) -> None:
        """Count ``n`` skipped bytes; every ``max_buffer`` of them since the last delivered frame counts as a
        bad frame too (a torn frame leaves less than that), so a flood without headers also ends a reader's
        patience."""
        self.garbage_bytes += n
        self._garbage_run += n
        while self._garbage_run >= self.max_buffer:
            self._garbage_run -= self.max_buffer
            self._bad()

    def _holds_hello(self, start: int) -> bool:
        pos = start
        while True:
            pos = self._buf.find(MAGIC, pos)
            if pos < 0:
                return False
            head = self._header_at(pos)
            if head is not None:
                ftype, _, length, pcrc = head
                end = pos + HEADER_SIZE + length
                if (
                    ftype == FrameType.HELLO
                    and end <= len(self._buf)
                    and zlib.crc32(memoryview(self._buf)[pos + HEADER_SIZE : end]) == pcrc
                ):
                    return True
            pos += 1

    def _header_at(self, pos: int) -> tuple[int, int, int, int] | None:
        """Parse a header at ``pos``: ``(type, stream, length, payload_crc)`` or None if invalid/short; the
        type is -1 for a valid header of another version or an unknown type, -2 for one whose length is over
        ``max_payload``."""
        if len(self._buf) - pos < HEADER_SIZE:
            return None
        magic, version, ftype, stream, length, pcrc, hcrc = _HEADER.unpack_from(self._buf, pos)
        if magic != MAGIC or zlib.crc32(memoryview(self._buf)[pos : pos + 16]) != hcrc:
            return None
        if length > self.max_payload:
            return (-2, stream, length, pcrc)
        if version != VERSION or ftype not in _KNOWN_TYPES:
            # Valid per checksum but not ours: return it so the caller can skip it whole.
            return (-1, stream, length, pcrc)
        return (ftype, stream, length, pcrc)

    def _drain(self) -> list[Frame]:
        out: list[Frame] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while True:
            if n - pos < HEADER_SIZE:
                # A header may still be arriving; keep at most HEADER_SIZE - 1 bytes of a possible start.
                keep = self._tail_candidate(pos)
                self.work += n - pos
                self._garbage(keep - pos)
                pos = keep
                break
            if buf[pos : pos + 2] != MAGIC:
                nxt = buf.find(MAGIC, pos + 1)
                if nxt < 0:
                    # Keep a trailing b"P" that may begin the next magic.
                    nxt = n - 1 if buf[n - 1 : n] == MAGIC[:1] else n
                self.work += nxt - pos
                self._garbage(nxt - pos)
                pos = nxt
                continue
            self.work += HEADER_SIZE
            head = self._header_at(pos)
            if head is None:
                self._garbage(1)
                pos += 1
                continue
            ftype, stream, length, pcrc = head
            if ftype == -2:  # a checked header claiming more than the limit: never waited for
                self._bad()
                self._garbage(1)
                pos += 1
                continue
            end = pos + HEADER_SIZE + length
            if end > n:
                break  # wait for the payload
            if length > self._budget:
                # Not affordable: the budget went on bogus candidates just before (a well-behaved stream
                # keeps it full), so this one is dropped unchecked and the bytes behind its header rescanned.
                self._bad()
                self._garbage(1)
                pos += 1
                continue
            self.work += length
            with memoryview(buf) as view:
                good = zlib.crc32(view[pos + HEADER_SIZE : end]) == pcrc
            if not good:
                # Torn frame (e.g. the writer went away mid-frame): rescan from the next byte.
                self._budget -= length
                self._bad()
                self._garbage(1)
                pos += 1
                continue
            payload = bytes(buf[pos + HEADER_SIZE : end])
            pos = end
            if ftype < 0:
                self.skipped_frames += 1
                continue
            self.frames += 1
            self.consecutive_bad = 0
            self._garbage_run = 0
            out.append(Frame(_TYPE_OF[ftype], stream, payload))
        if pos:
            del buf[:pos]
        return out

    def _tail_candidate(self, pos: int) -> int:
        """Index of the first byte in ``buf[pos:]`` that could start a header (a magic prefix)."""
        buf = self._buf
        i = buf.find(MAGIC, pos)
        if i >= 0:
            return i
        n = len(buf)
        return n - 1 if n > pos and buf[n - 1 : n] == MAGIC[:1] else n
