"""Processes on the guest channel (docs/channel.md): exec, and kept processes that outlive their stream.

    async with ch.exec(ExecSpec(shell="cat", stdin=True)) as proc:      # streaming; OPEN is sent at once
        await proc.write_stdin(b"hi"); await proc.close_stdin()
        async for kind, data in proc: ...                                # ("stdout" | "stderr", bytes)
        exit = await proc.wait()                                         # ExecExit(exit_code, timed_out, pid)
    out, err, exit = await ch.run(ExecSpec(argv=["python3", "-c", "print(42)"]))
    async with ch.exec(ExecSpec(shell="sleep 100", keep=True, tag="t")) as proc: ...   # outlives the stream
    [p.pid for p in await ch.procs()]                          # running kept processes
    async with ch.attach(pid) as proc: ...                     # its output (and exit) from now on
    await ch.proc_input(pid, b"data"); await ch.proc_close_stdin(pid)
    await ch.proc_signal(pid, 15); await ch.proc_resize(pid, cols=120, rows=40)

Errors: NotFound (no such running kept process), InvalidRequest (no stdin, no terminal, bad arguments),
GuestError, Timeout and ChannelClosed, as for every request (``podbay.channel.transport``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib

from pydantic import BaseModel

from podbay.channel import frames
from podbay.channel.frames import FrameType
from podbay.channel.transport import ChannelClosed, Stream, Transport, validate
from podbay.contracts.channel import ExecExit, ExecSpec, ExecStarted, KeptProcess, Op, ProcsResult
from podbay.errors import InvalidRequest, PodbayError

__all__ = ["ProcOps", "ExecProcess", "DEFAULT_RUN_OUTPUT_LIMIT", "INPUT_CHUNK_BYTES"]

DEFAULT_RUN_OUTPUT_LIMIT = 16 * 1024 * 1024
# guestd takes at most 64 KiB per proc_input call (base64 in a JSON OPEN frame).
INPUT_CHUNK_BYTES = 64 * 1024


class _Ack(BaseModel):
    model_config = {"extra": "ignore"}


class ProcOps(Transport):
    """Exec and kept processes."""

    def exec(self, spec: ExecSpec) -> ExecProcess:
        """Start a process (OPEN is sent at once) and return its handle; see ``ExecProcess``."""
        return ExecProcess(self, self.open_stream(Op.EXEC, spec.model_dump(exclude_none=True)), spec)

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

    async def procs(self) -> list[KeptProcess]:
        """The kept processes that run in the guest."""
        return (await self.unary(Op.PROCS, {}, ProcsResult)).processes

    def attach(self, pid: int) -> ExecProcess:
        """Receive kept process ``pid``'s output and exit on a new stream (OPEN is sent at once); the
        stream it had gets nothing more. Iterate and ``wait()`` as for ``exec``."""
        return ExecProcess(self, self.open_stream(Op.ATTACH, {"pid": int(pid)}), ExecSpec(argv=["attach"]))

    async def proc_input(self, pid: int, data: bytes) -> None:
        """Write ``data`` to the stdin (or terminal) of kept process ``pid``, in chunks."""
        for i in range(0, max(len(data), 1), INPUT_CHUNK_BYTES):
            chunk = data[i:i + INPUT_CHUNK_BYTES]
            await self.unary(Op.PROC_INPUT, {"pid": int(pid), "data_b64": base64.b64encode(chunk).decode()}, _Ack)

    async def proc_close_stdin(self, pid: int) -> None:
        """EOF on kept process ``pid``'s stdin."""
        await self.unary(Op.PROC_CLOSE_STDIN, {"pid": int(pid)}, _Ack)

    async def proc_signal(self, pid: int, signum: int) -> None:
        """Send ``signum`` to kept process ``pid``'s process group."""
        await self.unary(Op.PROC_SIGNAL, {"pid": int(pid), "signal": int(signum)}, _Ack)

    async def proc_resize(self, pid: int, *, cols: int, rows: int) -> None:
        """Resize kept process ``pid``'s terminal."""
        await self.unary(Op.PROC_RESIZE, {"pid": int(pid), "cols": int(cols), "rows": int(rows)}, _Ack)


class ExecProcess:
    """A process started by ``exec`` (or ``attach``): an async context manager and an async iterator of
    ``("stdout" | "stderr", bytes)`` events. Leaving the context before the process ended kills its
    process group (CANCEL). ``pid`` is known once the first event (or ``started()``) arrived."""

    def __init__(self, channel: Transport, stream: Stream, spec: ExecSpec) -> None:
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
            self._ch.cancel_stream(self._stream)
            self._ch.end_stream(self._stream, ChannelClosed("exec abandoned"))

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
        frame = await self._ch.next_frame(self._stream, timeout)
        if frame.type is FrameType.DATA:
            fd, data = frames.parse_data(frame.payload)
            self._ch.consumed(self._stream, len(data))
            if fd in (frames.FD_STDOUT, frames.FD_STDERR):
                return ("stdout" if fd == frames.FD_STDOUT else "stderr", data)
        elif frame.type is FrameType.STARTED:
            self.pid = validate(ExecStarted, frame.payload, "exec start").pid
        elif frame.type is FrameType.RESULT:
            self.exit = validate(ExecExit, frame.payload, "exec result")
        return None

    async def started(self) -> int:
        """Wait until the guest reports the pid -> pid. Output that arrives first is dropped (the guest
        sends STARTED before any output, so normally nothing is)."""
        while self.pid is None and self.exit is None:
            await self._step()
        return self.pid if self.pid is not None else self.exit.pid  # type: ignore[union-attr]  # the loop ends with pid or exit set, so exit is not None here

    async def write_stdin(self, data: bytes) -> None:
        """Stream bytes to the process's stdin (needs ``ExecSpec.stdin``), within the flow-control window."""
        if not self.spec.stdin:
            raise InvalidRequest("exec was started without stdin=True")
        await self._ch.send_data(self._stream, frames.FD_STDIN, data, None)

    async def close_stdin(self) -> None:
        """Send EOF on stdin."""
        if not self.spec.stdin:
            raise InvalidRequest("exec was started without stdin=True")
        if not self._stream.ended:
            self._ch.send(frames.encode_eof(self._stream.id, frames.FD_STDIN))

    async def _feed(self, data: bytes | None) -> None:
        if data:
            await self.write_stdin(data)
        await self.close_stdin()

    async def signal(self, signum: int) -> None:
        """Send signal ``signum`` to the process group."""
        if not self._stream.ended:
            self._ch.send(frames.encode_signal(self._stream.id, int(signum)))

    async def wait(self) -> ExecExit:
        """Wait for the exit. Output not yet read is read and dropped, so the process never stalls on a
        full pipe: iterate first to keep it. Raises the guest's error, ``Timeout`` or ``ChannelClosed``."""
        async for _ in self:
            pass
        assert self.exit is not None
        return self.exit
