"""The console terminal's pure parts (services/api/console/pty.py): Connect envelopes both ways, split anywhere
across chunks, and the resize control message's bounds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from podbay_api.console.pty import Resize, envelope, read_envelopes


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _read(data: bytes, size: int) -> list[tuple[int, dict[str, object]]]:
    async def run() -> list[tuple[int, dict[str, object]]]:
        return [item async for item in read_envelopes(_chunks(data, size))]

    return asyncio.run(run())


def test_envelopes_round_trip_whatever_the_chunking() -> None:
    msgs = [{"event": {"start": {"pid": 7}}}, {"event": {"data": {"pty": "aGk="}}}, {}]
    end = json.dumps({"error": {"code": "unavailable"}}).encode()
    stream = b"".join(envelope(m) for m in msgs) + bytes([2]) + len(end).to_bytes(4, "big") + end
    assert envelope({"a": 1})[:5] == bytes([0, 0, 0, 0, 8])
    for size in (1, 3, 5, 7, 64, len(stream)):
        got = _read(stream, size)
        assert got == [(0, m) for m in msgs] + [(2, {"error": {"code": "unavailable"}})], size


def test_a_truncated_envelope_yields_nothing() -> None:
    assert _read(envelope({"event": {}})[:-1], 4) == []


@pytest.mark.parametrize("text", ['{"type": "resize", "cols": 0, "rows": 24}', '{"type": "resize", "cols": 80}',
                                  '{"type": "resize", "cols": 1001, "rows": 24}', '{"type": "nope", "cols": 8, "rows": 8}',
                                  "not json"])
def test_bad_resizes_are_refused(text: str) -> None:
    with pytest.raises(ValidationError):
        Resize.model_validate_json(text)


def test_a_resize() -> None:
    assert Resize.model_validate_json('{"type": "resize", "cols": 120, "rows": 40}').cols == 120
