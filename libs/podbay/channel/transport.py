"""The guest channel's transport: one multiplexed connection to a guest's guestd, in asyncio.

Framing (``podbay.channel.frames``), the HELLO exchange, streams with per-stream flow control, and the
mapping of guest errors. The operations (exec and kept processes, files, watches, system) are in
``procs``, ``files``, ``watch`` and ``system``, each a subclass of :class:`Transport` that uses its public
stream methods; ``podbay.channel.client.GuestChannel`` combines them.

The guest is untrusted (docs/channel.md): frames are size-limited by the codec, every answer is validated
with ``podbay.contracts.channel``, DATA beyond the flow-control window or a flood of control frames fails only
that request, frames for unknown streams are counted and dropped, and unary requests have timeouts.

Errors: a guest ERROR becomes ``NotFound`` (not_found), ``Conflict`` (exists), ``InvalidRequest`` (invalid,
is_a_directory, not_a_directory), ``PermissionDenied`` (permission_denied), ``NoSpace`` (no_space) or
``GuestError`` (any other code); the code is in ``details["guest_code"]``;
a malformed answer is ``GuestError``; a lost connection fails every pending request with ``ChannelClosed``
(a retryable ``GuestError``), after which ``connect`` may be called again; a request timeout is ``Timeout``.
A guest that sends ``max_bad_frames`` bad frames in a row (``frames.Decoder``: torn, oversized or unpaid
candidates, or a run of garbage as long as a maximal frame) has its connection dropped, logged once: every
pending and later request on it fails with ``ChannelBroken`` (``guest_channel_broken``, a ``ChannelClosed``)
naming why, instead of waiting on a reader that decodes garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ValidationError

from podbay.channel import frames
from podbay.channel.frames import Frame, FrameType
from podbay.config import get_settings
from podbay.contracts.channel import PROTOCOL_VERSION, ChannelErrorBody, GuestInfo, Op
from podbay.errors import (Conflict, GuestError, InvalidRequest, NoSpace, NotFound, PermissionDenied, PodbayError,
                           Timeout)

__all__ = ["Transport", "Stream", "ChannelClosed", "ChannelBroken", "DEFAULT_MAX_BAD_FRAMES", "validate"]

log = logging.getLogger("podbay.channel")

M = TypeVar("M", bound=BaseModel)

# A stream gets a handful of control frames (STARTED, two EOFs, RESULT); more is a misbehaving guest.
_MAX_CONTROL_FRAMES = 16
#: Bad frames in a row after which the connection is dropped, when neither the caller nor the settings
#: (``PODBAY_CHANNEL_MAX_BAD_FRAMES``) say otherwise. A host reconnect leaves at most one torn frame
#: (docs/channel.md, Resynchronisation), so a handful in a row is a guest writing garbage on purpose.
DEFAULT_MAX_BAD_FRAMES = 8
# HELLO is re-sent after 50 ms, then at doubling intervals up to 250 ms: a guest that has just been
# restored answers the first HELLO within tens of ms, and re-sending only matters in the rare case where a
# torn frame of the previous host swallowed it (docs/channel.md, Resynchronisation).
_HELLO_RETRY_FIRST_S = 0.05
_HELLO_RETRY_MAX_S = 0.25
# is_a_directory / not_a_directory are the caller's mistake (a directory where a file is expected, or the
# reverse), so they are client errors like invalid; the guest code stays in details["guest_code"].
_ERROR_CLASSES: dict[str, type[PodbayError]] = {
    "not_found": NotFound,
    "exists": Conflict,
    "invalid": InvalidRequest,
    "is_a_directory": InvalidRequest,
    "not_a_directory": InvalidRequest,
    "permission_denied": PermissionDenied,
    "no_space": NoSpace,
}


class ChannelClosed(GuestError):
    """The connection to guestd is gone (closed, reset, or the guest restored); retry after reconnecting."""

    retryable = True


class ChannelBroken(ChannelClosed):
    """The host dropped the connection because the guest sent bad frames (``details.bad_frames``); the
    message says so. Another ``connect`` may work if the guest recovers."""

    code = "guest_channel_broken"


def _guest_error(payload: bytes) -> PodbayError:
    try:
        body = ChannelErrorBody.model_validate(frames.parse_json(payload))
    except (frames.FrameError, ValidationError):
        return GuestError("malformed ERROR frame from the guest")
    cls = _ERROR_CLASSES.get(body.code, GuestError)
    return cls(body.message[:1000] or body.code, details={"guest_code": body.code[:64]})


def validate(model: type[M], payload: bytes, what: str) -> M:
    """``payload`` (a JSON frame body) as ``model``; ``GuestError`` when it is not one."""
    try:
        return model.model_validate(frames.parse_json(payload))
    except (frames.FrameError, ValidationError) as exc:
        raise GuestError(f"malformed {what} from the guest: {str(exc)[:300]}") from exc


class Stream:
    """Host-side state of one stream; frames for it queue in ``queue`` in arrival order (an error that
    ended the stream is queued last)."""

    def __init__(self, sid: int) -> None:
        self.id = sid
        self.queue: asyncio.Queue[Frame | PodbayError] = asyncio.Queue()
        self.send_window = frames.INITIAL_WINDOW
        self.recv_window = frames.INITIAL_WINDOW
        self.unacked = 0
        self.control = 0
        self.window_changed = asyncio.Event()
        self.ended_event = asyncio.Event()
        self.error: PodbayError | None = None
        self.ended = False


class Transport:
    """One connection to guestd; many concurrent streams. Create with ``await <class>.connect(...)``.

    The operation classes (``podbay.channel.procs``, ``files``, ``watch``, ``system``) extend it and use only
    its public methods: ``open_stream``, ``next_frame``, ``finish``, ``unary``, ``send``, ``send_data``,
    ``consumed``, ``cancel_stream``, ``end_stream``, ``violation`` and ``next_chunk``.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, request_timeout_s: float,
                 max_bad_frames: int = DEFAULT_MAX_BAD_FRAMES) -> None:
        self._reader = reader
        self._writer = writer
        self.request_timeout_s = request_timeout_s
        self.max_bad_frames = max_bad_frames
        self._decoder = frames.Decoder()
        self._close_error: ChannelClosed | None = None
        self._streams: dict[int, Stream] = {}
        self._next_id = secrets.randbelow(1 << 31) + 1
        self._closed = False
        self._session = secrets.token_hex(8)
        self._hello: asyncio.Future[GuestInfo] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read_loop(), name="guest-channel-reader")
        self.info: GuestInfo | None = None
        self.ignored_frames = 0

    # -- connection ------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, socket_path: Path, *, timeout_s: float, request_timeout_s: float = 30.0,
                      max_bad_frames: int | None = None) -> Self:
        """Connect to the unix socket of a guest's channel and exchange HELLO, retrying (socket missing,
        refused, or no answer yet) until ``timeout_s`` passes. ``max_bad_frames``: bad frames in a row that
        drop the connection (module docstring); None takes the settings' ``channel_max_bad_frames``.

        Raises ``Timeout`` when no HELLO answer arrives in time, ``GuestError`` when the guest answers
        with a malformed or incompatible HELLO.
        """
        if max_bad_frames is None:
            max_bad_frames = get_settings().channel_max_bad_frames
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: BaseException | None = None
        while (remaining := deadline - loop.time()) > 0:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(str(socket_path), limit=frames.MAX_PAYLOAD * 2), remaining
                )
            except (TimeoutError, OSError) as exc:
                last = exc
                await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
                continue
            ch = cls(reader, writer, request_timeout_s=request_timeout_s, max_bad_frames=max_bad_frames)
            try:
                await ch._say_hello(deadline)
                return ch
            except ChannelClosed as exc:
                last = exc
                await ch.close()
            except BaseException:
                await ch.close()
                raise
        raise Timeout(f"guest channel {socket_path}: no answer within {timeout_s} s", details={"last": repr(last)})

    async def _say_hello(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        hello = frames.encode_json(FrameType.HELLO, frames.CONNECTION_STREAM,
                                   {"version": PROTOCOL_VERSION, "session": self._session})
        retry = _HELLO_RETRY_FIRST_S
        while True:
            self.send(hello)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Timeout("no HELLO answer from the guest")
            try:
                self.info = await asyncio.wait_for(asyncio.shield(self._hello), min(retry, remaining))
                return
            except TimeoutError:
                retry = min(retry * 2, _HELLO_RETRY_MAX_S)

    @property
    def closed(self) -> bool:
        """True once the connection is closed or lost; a new ``connect`` is then needed."""
        return self._closed

    async def close(self) -> None:
        """Close the connection; pending requests fail with ``ChannelClosed``."""
        self._shutdown(ChannelClosed("guest channel closed"))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    def _shutdown(self, exc: ChannelClosed) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_error = exc
        self._writer.close()
        if not self._hello.done():
            self._hello.set_exception(exc)
            self._hello.exception()  # mark retrieved: nobody may be waiting
        for stream in list(self._streams.values()):
            self.end_stream(stream, exc)

    # -- frames in ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        error = ChannelClosed("guest channel connection lost")
        try:
            while data := await self._reader.read(frames.MAX_PAYLOAD):
                for frame in self._decoder.feed(data):
                    try:
                        self._dispatch(frame)
                    except Exception:  # noqa: BLE001 - a bad frame must never stop the reader
                        log.exception("guest frame %s on stream %d", frame.type.name, frame.stream)
                if self._decoder.consecutive_bad >= self.max_bad_frames:
                    bad = self._decoder.consecutive_bad
                    # Logged here only: the loop ends, and the connection with it.
                    log.warning("guest channel dropped: %d bad frames in a row (%d garbage bytes)", bad,
                                self._decoder.garbage_bytes)
                    error = ChannelBroken(f"guest channel dropped: the guest sent {bad} bad frames in a row",
                                          details={"bad_frames": bad})
                    break
        except (OSError, asyncio.IncompleteReadError) as exc:
            error = ChannelClosed(f"guest channel connection lost: {exc}")
        self._shutdown(error)

    def _dispatch(self, frame: Frame) -> None:
        if frame.stream == frames.CONNECTION_STREAM:
            if frame.type is FrameType.HELLO and not self._hello.done():
                try:
                    info = validate(GuestInfo, frame.payload, "HELLO")
                except GuestError as exc:
                    self._hello.set_exception(exc)
                    return
                if info.session == self._session:
                    if info.version != frames.VERSION:
                        self._hello.set_exception(GuestError(f"guest speaks protocol {info.version}"))
                    else:
                        self._hello.set_result(info)
            return
        stream = self._streams.get(frame.stream)
        if stream is None:
            self.ignored_frames += 1
            return
        if frame.type is FrameType.CREDIT:
            try:
                stream.send_window += frames.parse_u32(frame.payload)
            except frames.FrameError:
                self.violation(stream, "malformed CREDIT")
                return
            stream.window_changed.set()
            return
        if frame.type is FrameType.DATA:
            if not frame.payload:
                self.violation(stream, "DATA without an fd byte")
                return
            stream.recv_window -= len(frame.payload) - 1
            if stream.recv_window < 0:
                self.violation(stream, "guest exceeded the flow-control window")
                return
        else:
            stream.control += 1
            if stream.control > _MAX_CONTROL_FRAMES:
                self.violation(stream, "too many control frames")
                return
        stream.queue.put_nowait(frame)
        if frame.type in (FrameType.RESULT, FrameType.ERROR):
            self._streams.pop(stream.id, None)
            stream.ended = True
            stream.ended_event.set()
            stream.window_changed.set()

    def violation(self, stream: Stream, why: str) -> None:
        log.warning("guest stream %d: %s", stream.id, why)
        self.cancel_stream(stream)
        self.end_stream(stream, GuestError(why))

    def end_stream(self, stream: Stream, exc: PodbayError) -> None:
        self._streams.pop(stream.id, None)
        if not stream.ended:
            stream.ended = True
            stream.error = exc
            stream.queue.put_nowait(exc)
        stream.ended_event.set()
        stream.window_changed.set()

    # -- frames out -----------------------------------------------------------------------------

    def _closed_error(self) -> ChannelClosed:
        """What a call on the closed connection raises: why it closed (a copy, so tracebacks do not pile up)."""
        why = self._close_error
        if why is None:
            return ChannelClosed("guest channel closed")
        return type(why)(why.message, details=why.details)

    def send(self, data: bytes) -> None:
        if self._closed:
            raise self._closed_error()
        self._writer.write(data)

    def open_stream(self, op: Op, args: dict[str, Any]) -> Stream:
        if self._closed:
            raise self._closed_error()
        while self._next_id in self._streams or self._next_id == 0:
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        sid, self._next_id = self._next_id, (self._next_id + 1) & 0xFFFFFFFF
        try:
            data = frames.encode_json(FrameType.OPEN, sid, {"op": op.value, "args": args})
        except frames.FrameError as exc:
            raise InvalidRequest(f"{op.value} request too large: {exc}") from exc
        stream = Stream(sid)
        self._streams[sid] = stream
        self.send(data)
        return stream

    def cancel_stream(self, stream: Stream) -> None:
        if not self._closed:
            self._writer.write(frames.encode_frame(FrameType.CANCEL, stream.id))

    def consumed(self, stream: Stream, n: int) -> None:
        stream.unacked += n
        if stream.unacked >= frames.CREDIT_BATCH and not stream.ended and not self._closed:
            grant, stream.unacked = stream.unacked, 0
            stream.recv_window += grant
            self._writer.write(frames.encode_credit(stream.id, grant))

    async def send_data(self, stream: Stream, fd: int, data: bytes, timeout_s: float | None) -> None:
        """Send ``data`` as DATA frames within the stream's window, waiting (``timeout_s`` per wait)."""
        view = memoryview(data)
        while view:
            while stream.send_window <= 0 and not stream.ended:
                stream.window_changed.clear()
                try:
                    await asyncio.wait_for(stream.window_changed.wait(), timeout_s)
                except TimeoutError:
                    raise Timeout("guest granted no flow-control credit in time") from None
            if stream.ended:
                return  # the answer (result or error) is in the queue
            n = min(len(view), stream.send_window, frames.CHUNK_SIZE)
            stream.send_window -= n
            self.send(frames.encode_data(stream.id, fd, bytes(view[:n])))
            view = view[n:]
            try:
                await self._writer.drain()
            except (OSError, RuntimeError) as exc:
                raise ChannelClosed(f"guest channel connection lost: {exc}") from exc

    async def next_frame(self, stream: Stream, timeout_s: float | None) -> Frame:
        """Next frame of the stream; raises the stream's error, or ``Timeout`` (after cancelling it)."""
        if stream.error is not None and stream.queue.empty():
            raise stream.error
        try:
            item = await asyncio.wait_for(stream.queue.get(), timeout_s)
        except TimeoutError:
            self.cancel_stream(stream)
            self.end_stream(stream, Timeout("guest request timed out"))
            raise Timeout(f"guest did not answer within {timeout_s} s") from None
        if isinstance(item, PodbayError):
            raise item
        if item.type is FrameType.ERROR:
            stream.error = _guest_error(item.payload)
            raise stream.error
        return item

    async def finish(self, stream: Stream, timeout_s: float | None) -> Frame:
        """Wait for RESULT, skipping STARTED; DATA here is a protocol error."""
        while True:
            frame = await self.next_frame(stream, timeout_s)
            if frame.type is FrameType.RESULT:
                return frame
            if frame.type is FrameType.DATA:
                self.violation(stream, "unexpected DATA")
                raise GuestError("unexpected DATA from the guest")

    async def unary(self, op: Op, args: dict[str, Any], model: type[M], timeout_s: float | None = None) -> M:
        stream = self.open_stream(op, args)
        frame = await self.finish(stream, timeout_s or self.request_timeout_s)
        return validate(model, frame.payload, f"{op.value} result")


    async def next_chunk(self, stream: Stream, source: AsyncIterator[bytes]) -> bytes | None:
        """The caller's next chunk, or None at its end or once the stream ended (its answer or error is
        then in the queue), so a stalled source never hides a lost connection."""
        if stream.ended:
            return None
        nxt = asyncio.ensure_future(anext(source))
        ended = asyncio.ensure_future(stream.ended_event.wait())
        try:
            await asyncio.wait({nxt, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
        if not nxt.done() or nxt.cancelled():
            return None
        try:
            return nxt.result()
        except StopAsyncIteration:
            return None
