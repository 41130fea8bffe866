"""Upload bodies for ``files.write``: bytes, text, or a file-like object streamed in chunks.

A file-like object is read in ``CHUNK_BYTES`` pieces and sent with chunked transfer encoding, so a large
file never sits in memory whole. Text (``str``, or a text-mode file) is encoded as UTF-8.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

from podbay.errors import InvalidRequest

__all__ = ["CHUNK_BYTES", "FileData", "sync_body", "async_body"]

#: Size of one upload chunk read from a file-like object, in bytes.
CHUNK_BYTES = 256 * 1024

#: What ``files.write`` accepts.
FileData = bytes | bytearray | memoryview | str | IO[bytes] | IO[str] | Any


def _as_bytes(chunk: Any) -> bytes:
    if isinstance(chunk, str):
        return chunk.encode("utf-8")
    if isinstance(chunk, bytes | bytearray | memoryview):
        return bytes(chunk)
    raise InvalidRequest(f"file data chunks must be bytes or str, not {type(chunk).__name__}")


def _whole(data: Any) -> bytes | None:
    """Bytes for in-memory data; ``None`` for a file-like object; ``InvalidRequest`` for anything else."""
    if isinstance(data, str | bytes | bytearray | memoryview):
        return _as_bytes(data)
    if callable(getattr(data, "read", None)):
        return None
    raise InvalidRequest(f"file data must be bytes, str or a file-like object, not {type(data).__name__}")


def sync_body(data: FileData) -> bytes | Iterator[bytes]:
    """The request body for the sync client: the bytes, or an iterator over the file's chunks."""
    whole = _whole(data)
    if whole is not None:
        return whole

    reader: Any = data  # a file-like object: _whole returned None

    def chunks() -> Iterator[bytes]:
        while chunk := reader.read(CHUNK_BYTES):
            yield _as_bytes(chunk)

    return chunks()


def async_body(data: FileData) -> bytes | AsyncIterator[bytes]:
    """The request body for the async client; the file's ``read`` may be a coroutine (aiofiles, ...)."""
    whole = _whole(data)
    if whole is not None:
        return whole

    reader: Any = data  # a file-like object: _whole returned None

    async def chunks() -> AsyncIterator[bytes]:
        while True:
            chunk = reader.read(CHUNK_BYTES)
            if inspect.isawaitable(chunk):
                chunk = await chunk
            if not chunk:
                return
            yield _as_bytes(chunk)

    return chunks()
