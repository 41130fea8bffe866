"""The host side of the guest channel: one multiplexed connection to a guest's guestd, in asyncio.

    ch = await GuestChannel.connect(socket_path, timeout_s=5)     # retries until guestd answers HELLO
    info = await ch.ping()                                        # GuestInfo as a dict
    out, err, exit = await ch.run(ExecSpec(argv=["python3", "-c", "print(42)"]))
    async with ch.exec(ExecSpec(shell="cat", stdin=True)) as proc:   # streaming
        await proc.write_stdin(b"hi"); await proc.close_stdin()
        async for kind, data in proc: ...                         # ("stdout" | "stderr", bytes)
        exit = await proc.wait()                                  # ExecExit(exit_code, timed_out, pid)
    async for chunk in ch.read_file("/etc/hostname"): ...
    await ch.write_file("/tmp/x", b"data", mode=0o600)            # FileStat as a dict
    await ch.close()

The guest is untrusted (DESIGN.md §4): frames are size-limited by the codec, every answer is validated with
``podbay.contracts.channel``, DATA beyond the flow-control window or a flood of control frames fails only
that request, frames for unknown streams are counted and dropped, and unary requests have timeouts.

Errors: a guest ERROR becomes ``NotFound`` (not_found), ``Conflict`` (exists), ``InvalidRequest`` (invalid,
is_a_directory, not_a_directory) or ``GuestError`` (any other code); the code is in ``details["guest_code"]``;
a malformed answer is ``GuestError``; a lost connection fails every pending request with ``ChannelClosed``
(a retryable ``GuestError``), after which ``connect`` may be called again; a request timeout is ``Timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from podbay.channel import frames
from podbay.channel.frames import Frame, FrameType
from podbay.contracts.channel import (
    AfterRestoreRequest,
    AfterRestoreResult,
    GuestNet,
    ChannelErrorBody,
    ExecExit,
    ExecSpec,
    ExecStarted,
    FileStat,
    FreezeRequest,
    FreezeResult,
    GuestInfo,
    ListResult,
    MkdirRequest,
    MoveRequest,
    Op,
    ReadResult,
    RemoveRequest,
    RemoveResult,
)
from podbay.channel.procs import ProcOps
from podbay.errors import Conflict, GuestError, InvalidRequest, NotFound, PodbayError, Timeout

__all__ = ["GuestChannel", "ExecProcess", "ExecExit", "ExecSpec", "ChannelClosed", "DEFAULT_RUN_OUTPUT_LIMIT"]

log = logging.getLogger("podbay.channel")

M = TypeVar("M", bound=BaseModel)

DEFAULT_RUN_OUTPUT_LIMIT = 16 * 1024 * 1024
# A stream gets a handful of control frames (STARTED, two EOFs, RESULT); more is a misbehaving guest.
_MAX_CONTROL_FRAMES = 16
_LIST_LIMIT_BYTES = 64 * 1024 * 1024
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
}


class ChannelClosed(GuestError):
    """The connection to guestd is gone (closed, reset, or the guest restored); retry after reconnecting."""

    retryable = True


def _guest_error(payload: bytes) -> PodbayError:
    try:
        body = ChannelErrorBody.model_validate(frames.parse_json(payload))
    except (frames.FrameError, ValidationError):
        return GuestError("malformed ERROR frame from the guest")
    cls = _ERROR_CLASSES.get(body.code, GuestError)
    return cls(body.message[:1000] or body.code, details={"guest_code": body.code[:64]})


def _validate(model: type[M], payload: bytes, what: str) -> M:
    try:
        return model.model_validate(frames.parse_json(payload))
    except (frames.FrameError, ValidationError) as exc:
        raise GuestError(f"malformed {what} from the guest: {str(exc)[:300]}") from exc


class _Stream:
    """Host-side state of one stream; frames for it queue in ``queue`` in arrival order."""

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


class GuestChannel(ProcOps):
    """One connection to guestd; many concurrent streams. Create with ``await GuestChannel.connect(...)``.
    Kept processes and watches: ``podbay.channel.procs``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, request_timeout_s: float) -> None:
        self._reader = reader
        self._writer = writer
        self.request_timeout_s = request_timeout_s
        self._decoder = frames.Decoder()
        self._streams: dict[int, _Stream] = {}
        self._next_id = secrets.randbelow(1 << 31) + 1
        self._closed = False
        self._session = secrets.token_hex(8)
        self._hello: asyncio.Future[GuestInfo] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read_loop(), name="guest-channel-reader")
        self.info: GuestInfo | None = None
        self.ignored_frames = 0

    # -- connection ------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, socket_path: Path, *, timeout_s: float, request_timeout_s: float = 30.0) -> GuestChannel:
        """Connect to the unix socket of a guest's channel and exchange HELLO, retrying (socket missing,
        refused, or no answer yet) until ``timeout_s`` passes.

        Raises ``Timeout`` when no HELLO answer arrives in time, ``GuestError`` when the guest answers
        with a malformed or incompatible HELLO.
        """
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
            ch = cls(reader, writer, request_timeout_s=request_timeout_s)
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
        hello = frames.encode_json(FrameType.HELLO, frames.CONNECTION_STREAM, {"version": 1, "session": self._session})
        retry = _HELLO_RETRY_FIRST_S
        while True:
            self._write(hello)
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

    def _shutdown(self, exc: PodbayError) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        if not self._hello.done():
            self._hello.set_exception(exc)
            self._hello.exception()  # mark retrieved: nobody may be waiting
        for stream in list(self._streams.values()):
            self._end(stream, exc)

    # -- frames in ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        reason = "guest channel connection lost"
        try:
            while data := await self._reader.read(frames.MAX_PAYLOAD):
                for frame in self._decoder.feed(data):
                    try:
                        self._dispatch(frame)
                    except Exception:  # noqa: BLE001 - a bad frame must never stop the reader
                        log.exception("guest frame %s on stream %d", frame.type.name, frame.stream)
        except (OSError, asyncio.IncompleteReadError) as exc:
            reason = f"guest channel connection lost: {exc}"
        self._shutdown(ChannelClosed(reason))

    def _dispatch(self, frame: Frame) -> None:
        if frame.stream == frames.CONNECTION_STREAM:
            if frame.type is FrameType.HELLO and not self._hello.done():
                try:
                    info = _validate(GuestInfo, frame.payload, "HELLO")
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
                self._violation(stream, "malformed CREDIT")
                return
            stream.window_changed.set()
            return
        if frame.type is FrameType.DATA:
            if not frame.payload:
                self._violation(stream, "DATA without an fd byte")
                return
            stream.recv_window -= len(frame.payload) - 1
            if stream.recv_window < 0:
                self._violation(stream, "guest exceeded the flow-control window")
                return
        else:
            stream.control += 1
            if stream.control > _MAX_CONTROL_FRAMES:
                self._violation(stream, "too many control frames")
                return
        stream.queue.put_nowait(frame)
        if frame.type in (FrameType.RESULT, FrameType.ERROR):
            self._streams.pop(stream.id, None)
            stream.ended = True
            stream.ended_event.set()
            stream.window_changed.set()

    def _violation(self, stream: _Stream, why: str) -> None:
        log.warning("guest stream %d: %s", stream.id, why)
        self._cancel(stream)
        self._end(stream, GuestError(why))

    def _end(self, stream: _Stream, exc: PodbayError) -> None:
        self._streams.pop(stream.id, None)
        if not stream.ended:
            stream.ended = True
            stream.error = exc
            stream.queue.put_nowait(exc)
        stream.ended_event.set()
        stream.window_changed.set()

    # -- frames out -----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self._closed:
            raise ChannelClosed("guest channel closed")
        self._writer.write(data)

    def _open(self, op: Op, args: dict[str, Any]) -> _Stream:
        if self._closed:
            raise ChannelClosed("guest channel closed")
        while self._next_id in self._streams or self._next_id == 0:
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        sid, self._next_id = self._next_id, (self._next_id + 1) & 0xFFFFFFFF
        try:
            data = frames.encode_json(FrameType.OPEN, sid, {"op": op.value, "args": args})
        except frames.FrameError as exc:
            raise InvalidRequest(f"{op.value} request too large: {exc}") from exc
        stream = _Stream(sid)
        self._streams[sid] = stream
        self._write(data)
        return stream

    def _cancel(self, stream: _Stream) -> None:
        if not self._closed:
            self._writer.write(frames.encode_frame(FrameType.CANCEL, stream.id))

    def _consumed(self, stream: _Stream, n: int) -> None:
        stream.unacked += n
        if stream.unacked >= frames.CREDIT_BATCH and not stream.ended and not self._closed:
            grant, stream.unacked = stream.unacked, 0
            stream.recv_window += grant
            self._writer.write(frames.encode_credit(stream.id, grant))

    async def _send_data(self, stream: _Stream, fd: int, data: bytes, timeout_s: float | None) -> None:
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
            self._write(frames.encode_data(stream.id, fd, bytes(view[:n])))
            view = view[n:]
            try:
                await self._writer.drain()
            except (OSError, RuntimeError) as exc:
                raise ChannelClosed(f"guest channel connection lost: {exc}") from exc

    async def _next(self, stream: _Stream, timeout_s: float | None) -> Frame:
        """Next frame of the stream; raises the stream's error, or ``Timeout`` (after cancelling it)."""
        if stream.error is not None and stream.queue.empty():
            raise stream.error
        try:
            item = await asyncio.wait_for(stream.queue.get(), timeout_s)
        except TimeoutError:
            self._cancel(stream)
            self._end(stream, Timeout("guest request timed out"))
            raise Timeout(f"guest did not answer within {timeout_s} s") from None
        if isinstance(item, PodbayError):
            raise item
        if item.type is FrameType.ERROR:
            stream.error = _guest_error(item.payload)
            raise stream.error
        return item

    async def _finish(self, stream: _Stream, timeout_s: float | None) -> Frame:
        """Wait for RESULT, skipping STARTED; DATA here is a protocol error."""
        while True:
            frame = await self._next(stream, timeout_s)
            if frame.type is FrameType.RESULT:
                return frame
            if frame.type is FrameType.DATA:
                self._violation(stream, "unexpected DATA")
                raise GuestError("unexpected DATA from the guest")

    async def _unary(self, op: Op, args: dict[str, Any], model: type[M], timeout_s: float | None = None) -> M:
        stream = self._open(op, args)
        frame = await self._finish(stream, timeout_s or self.request_timeout_s)
        return _validate(model, frame.payload, f"{op.value} result")

    # -- operations -----------------------------------------------------------------------------

    async def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Round trip to guestd -> GuestInfo as a dict (version, boot_id, uptime_s, pid, hostname)."""
        return (await self._unary(Op.PING, {}, GuestInfo, timeout_s)).model_dump()

    def exec(self, spec: ExecSpec) -> ExecProcess:
        """Start a process (OPEN is sent at once) and return its handle; see ``ExecProcess``."""
        return ExecProcess(self, self._open(Op.EXEC, spec.model_dump(exclude_none=True)), spec)

    async def run(
        self, spec: ExecSpec, *, stdin: bytes | None = None, max_output_bytes: int = DEFAULT_RUN_OUTPUT_LIMIT
    ) -> tuple[bytes, bytes, ExecExit]:
        """Run to completion, capturing stdout and stderr up to ``max_output_bytes`` each (the rest is read
        and dropped, and ``ExecExit.output_truncated`` says so). ``stdin`` bytes are streamed in."""
        if stdin is not None and not spec.stdin:
            spec = spec.model_copy(update={"stdin": True})
        out = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = False
        async with self.exec(spec) as proc:
            feeder = asyncio.create_task(proc._feed(stdin)) if spec.stdin else None
            try:
                async for kind, data in proc:
                    buf = out[kind]
                    room = max_output_bytes - len(buf)
                    truncated |= len(data) > room
                    buf += data[: max(room, 0)]
                result = await proc.wait()
            finally:
                if feeder is not None:
                    feeder.cancel()
                    with contextlib.suppress(asyncio.CancelledError, PodbayError):
                        await feeder
        if truncated:
            result = result.model_copy(update={"output_truncated": True})
        return bytes(out["stdout"]), bytes(out["stderr"]), result

    async def read_file(self, path: str, *, offset: int = 0, length: int | None = None) -> AsyncIterator[bytes]:
        """Stream a file's bytes in chunks (at most 64 KiB each). Raises NotFound, InvalidRequest
        (is_a_directory), GuestError (permission_denied, ...) or Timeout when the guest stalls for
        ``request_timeout_s``."""
        stream = self._open(Op.READ, {"path": path, "offset": offset, "length": length})
        try:
            while True:
                frame = await self._next(stream, self.request_timeout_s)
                if frame.type is FrameType.RESULT:
                    _validate(ReadResult, frame.payload, "read result")
                    return
                if frame.type is FrameType.DATA:
                    self._consumed(stream, len(frame.payload) - 1)
                    yield frame.payload[1:]
        finally:
            if not stream.ended:
                self._cancel(stream)
                self._end(stream, ChannelClosed("read abandoned"))

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        mode: int = 0o644,
        *,
        append: bool = False,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """Write a file atomically (temp file + rename; ``append`` writes in place) -> FileStat dict.
        Raises NotFound (missing parent), InvalidRequest (is_a_directory, not_a_directory, an existing
        path that is not a regular file), GuestError (permission_denied, ...), Timeout."""
        args: dict[str, Any] = {"path": path, "mode": mode, "append": append}
        if user is not None:
            args["user"] = user
        stream = self._open(Op.WRITE, args)
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                await self._send_data(stream, frames.FD_FILE, bytes(data), self.request_timeout_s)
            else:
                source = aiter(data)
                while (chunk := await self._next_chunk(stream, source)) is not None:
                    await self._send_data(stream, frames.FD_FILE, bytes(chunk), self.request_timeout_s)
            if not stream.ended:
                self._write(frames.encode_eof(stream.id, frames.FD_FILE))
            frame = await self._finish(stream, self.request_timeout_s)
        except BaseException:
            if not stream.ended:
                self._cancel(stream)
                self._end(stream, ChannelClosed("write abandoned"))
            raise
        return _validate(FileStat, frame.payload, "write result").model_dump()

    async def _next_chunk(self, stream: _Stream, source: AsyncIterator[bytes]) -> bytes | None:
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

    async def stat(self, path: str) -> FileStat:
        """Metadata of ``path`` (symlinks not followed). Raises NotFound."""
        return await self._unary(Op.STAT, {"path": path}, FileStat)

    async def list_dir(self, path: str) -> list[FileStat]:
        """The entries of a directory, one level, sorted by name. Raises NotFound, InvalidRequest
        (not_a_directory), GuestError."""
        stream = self._open(Op.LIST, {"path": path})
        lines: list[bytes] = []
        total = 0
        tail = b""
        while True:
            frame = await self._next(stream, self.request_timeout_s)
            if frame.type is FrameType.DATA:
                total += len(frame.payload)
                if total > _LIST_LIMIT_BYTES:
                    self._violation(stream, "directory listing too large")
                    raise GuestError("directory listing too large")
                self._consumed(stream, len(frame.payload) - 1)
                parts = (tail + frame.payload[1:]).split(b"\n")
                tail = parts.pop()
                lines.extend(parts)
            elif frame.type is FrameType.RESULT:
                result = _validate(ListResult, frame.payload, "list result")
                break
        try:
            entries = [FileStat.model_validate(json.loads(line)) for line in [*lines, tail] if line.strip()]
        except (ValueError, ValidationError) as exc:
            raise GuestError(f"malformed list entry from the guest: {str(exc)[:300]}") from exc
        if len(entries) != result.count:
            raise GuestError(f"guest listed {len(entries)} entries but counted {result.count}")
        return entries

    async def mkdir(self, path: str, *, parents: bool = True, exist_ok: bool = True, mode: int = 0o755,
                    user: str | int | None = None) -> FileStat:
        """Create a directory (with parents by default; owned by ``user`` when given). Raises Conflict
        (exists), NotFound, InvalidRequest (not_a_directory: a file on the way), GuestError."""
        req = MkdirRequest(path=path, parents=parents, exist_ok=exist_ok, mode=mode, user=user)
        return await self._unary(Op.MKDIR, req.model_dump(exclude_none=True), FileStat)

    async def move(self, source: str, destination: str) -> FileStat:
        """Rename ``source`` to ``destination`` (rename(2)) -> FileStat of the destination. Raises
        NotFound (source or destination parent), InvalidRequest (non-empty directory in the way, ...)."""
        req = MoveRequest(source=source, destination=destination)
        return await self._unary(Op.MOVE, req.model_dump(), FileStat)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, link or directory (``recursive`` for a non-empty one). Raises NotFound."""
        await self._unary(Op.REMOVE, RemoveRequest(path=path, recursive=recursive).model_dump(), RemoveResult)

    async def after_restore(
        self,
        *,
        hostname: str | None = None,
        seed: bytes | None = None,
        time_ns: int | None = None,
        env: dict[str, str] | None = None,
        access_token: str | None = None,
        net: GuestNet | None = None,
    ) -> AfterRestoreResult:
        """Post-restore hygiene: new hostname, RNG seed (credited), wall clock, exec env and access token
        (DESIGN.md §3), and with ``net`` the guest's address, route, resolver and sandbox CA."""
        req = AfterRestoreRequest(
            hostname=hostname,
            seed_b64=base64.b64encode(seed).decode() if seed is not None else None,
            time_ns=time_ns,
            env=env,
            access_token=access_token,
            net=net,
        )
        return await self._unary(Op.AFTER_RESTORE, req.model_dump(exclude_none=True), AfterRestoreResult)

    async def freeze(self, mounts: list[str] | None = None, *, timeout_s: float = 30.0) -> list[str]:
        """sync + FIFREEZE the mounts (default ["/"]); guestd thaws by itself after ``timeout_s``."""
        req = FreezeRequest(mounts=mounts or ["/"], timeout_s=timeout_s)
        return (await self._unary(Op.FREEZE, req.model_dump(), FreezeResult)).mounts

    async def thaw(self, mounts: list[str] | None = None) -> list[str]:
        """FITHAW the mounts (default ["/"]); thawing a mount that is not frozen is fine."""
        return (await self._unary(Op.THAW, {"mounts": mounts or ["/"]}, FreezeResult)).mounts


class ExecProcess:
    """A process started by ``GuestChannel.exec``: an async context manager and an async iterator of
    ``("stdout" | "stderr", bytes)`` events. Leaving the context before the process ended kills its
    process group (CANCEL). ``pid`` is known once the first event (or ``started()``) arrived."""

    def __init__(self, channel: GuestChannel, stream: _Stream, spec: ExecSpec) -> None:
        self._ch = channel
        self._stream = stream
        self.spec = spec
        self.pid: int | None = None
        self.exit: ExecExit | None = None
        loop = asyncio.get_running_loop()
        # The guest enforces timeout_s; the host bound only catches a guest that stopped answering.
        self._deadline = None if spec.timeout_s is None else loop.time() + spec.timeout_s + channel.request_timeout_s

    async def __aenter__(self) -> ExecProcess:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.exit is None and not self._stream.ended:
            self._ch._cancel(self._stream)
            self._ch._end(self._stream, ChannelClosed("exec abandoned"))

    def __aiter__(self) -> ExecProcess:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        while self.exit is None:
            event = await self._step()
            if event is not None:
                return event
        raise StopAsyncIteration

    async def _step(self) -> tuple[str, bytes] | None:
        """Handle the next frame: an output event, or None (STARTED, RESULT, stray fds)."""
        timeout = None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())
        frame = await self._ch._next(self._stream, timeout)
        if frame.type is FrameType.DATA:
            fd, data = frames.parse_data(frame.payload)
            self._ch._consumed(self._stream, len(data))
            if fd in (frames.FD_STDOUT, frames.FD_STDERR):
                return ("stdout" if fd == frames.FD_STDOUT else "stderr", data)
        elif frame.type is FrameType.STARTED:
            self.pid = _validate(ExecStarted, frame.payload, "exec start").pid
        elif frame.type is FrameType.RESULT:
            self.exit = _validate(ExecExit, frame.payload, "exec result")
        return None

    async def started(self) -> int:
        """Wait until the guest reports the pid -> pid. Output that arrives first is dropped (the guest
        sends STARTED before any output, so normally nothing is)."""
        while self.pid is None and self.exit is None:
            await self._step()
        return self.pid if self.pid is not None else self.exit.pid  # type: ignore[union-attr]

    async def write_stdin(self, data: bytes) -> None:
        """Stream bytes to the process's stdin (needs ``ExecSpec.stdin``), within the flow-control window."""
        if not self.spec.stdin:
            raise InvalidRequest("exec was started without stdin=True")
        await self._ch._send_data(self._stream, frames.FD_STDIN, data, None)

    async def close_stdin(self) -> None:
        """Send EOF on stdin."""
        if not self.spec.stdin:
            raise InvalidRequest("exec was started without stdin=True")
        if not self._stream.ended:
            self._ch._write(frames.encode_eof(self._stream.id, frames.FD_STDIN))

    async def _feed(self, data: bytes | None) -> None:
        if data:
            await self.write_stdin(data)
        await self.close_stdin()

    async def signal(self, signum: int) -> None:
        """Send signal ``signum`` to the process group."""
        if not self._stream.ended:
            self._ch._write(frames.encode_signal(self._stream.id, int(signum)))

    async def wait(self) -> ExecExit:
        """Wait for the exit. Output not yet read is read and dropped, so the process never stalls on a
        full pipe: iterate first to keep it. Raises the guest's error, ``Timeout`` or ``ChannelClosed``."""
        async for _ in self:
            pass
        assert self.exit is not None
        return self.exit
