"""A directory watch on the guest channel (op ``watch``, docs/channel.md): the host half.

    async with ch.watch("/home/user", recursive=True) as w:   # OPEN is sent at once
        await w.started()                                      # the guest took its first scan
        async for ev in w: ...                                 # WatchEvent(name, type, stat)

Leaving the context cancels the stream (guestd stops scanning). Iteration ends when the watched
directory goes away (RESULT). Events are JSON lines in DATA fd 3, validated one by one; a malformed line
fails the watch with ``GuestError``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pydantic import ValidationError

from podbay.channel.frames import FrameType
from podbay.channel.transport import ChannelClosed, Stream, Transport
from podbay.contracts.channel import Op, WatchEvent, WatchRequest
from podbay.errors import GuestError

__all__ = ["WatchOps", "DirWatch", "MAX_LINE_BYTES"]

# One event line holds a name and a FileStat: far below this. A longer partial line is a broken guest.
MAX_LINE_BYTES = 64 * 1024


class WatchOps(Transport):
    """Directory watches."""

    def watch(self, path: str, *, recursive: bool = False, interval_s: float = 0.1) -> DirWatch:
        """Watch directory ``path`` for changes (OPEN is sent at once); see ``DirWatch``."""
        req = WatchRequest(path=path, recursive=recursive, interval_s=interval_s)
        return DirWatch(self, self.open_stream(Op.WATCH, req.model_dump()))


class DirWatch:
    """Handle of one ``watch`` stream; made by ``WatchOps.watch``."""

    def __init__(self, channel: Transport, stream: Stream) -> None:
        self._ch = channel
        self._stream = stream
        self._started = False
        self._ended = False
        self._tail = b""
        self._pending: list[WatchEvent] = []

    async def __aenter__(self) -> DirWatch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the watch (CANCEL to the guest); idempotent."""
        if not self._stream.ended:
            self._ch.cancel_stream(self._stream)
            self._ch.end_stream(self._stream, ChannelClosed("watch closed"))

    async def started(self) -> None:
        """Wait until the guest has taken its first scan; changes after this are reported. Raises the
        guest's error (NotFound, InvalidRequest for a file, ...)."""
        while not self._started and not self._ended:
            await self._step()

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            if self._ended:
                raise StopAsyncIteration
            await self._step()
        return self._pending.pop(0)

    async def _step(self) -> None:
        frame = await self._ch.next_frame(self._stream, None)
        if frame.type is FrameType.STARTED:
            self._started = True
        elif frame.type is FrameType.RESULT:
            self._ended = True
        elif frame.type is FrameType.DATA:
            self._ch.consumed(self._stream, len(frame.payload) - 1)
            lines = (self._tail + frame.payload[1:]).split(b"\n")
            self._tail = lines.pop()
            if len(self._tail) > MAX_LINE_BYTES:
                await self.close()
                raise GuestError("watch event line too long")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    self._pending.append(WatchEvent.model_validate(json.loads(line)))
                except (ValueError, ValidationError) as exc:
                    await self.close()
                    raise GuestError(f"malformed watch event from the guest: {str(exc)[:300]}") from exc
