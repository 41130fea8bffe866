"""Kept processes and directory watches on the guest channel (docs/channel.md): the host half, mixed into
``GuestChannel``.

    async with ch.exec(ExecSpec(shell="sleep 100", keep=True, tag="t")) as proc: ...   # outlives the stream
    [p.pid for p in await ch.procs()]                          # running kept processes
    async with ch.attach(pid) as proc: ...                     # its output (and exit) from now on
    await ch.proc_input(pid, b"data"); await ch.proc_close_stdin(pid)
    await ch.proc_signal(pid, 15); await ch.proc_resize(pid, cols=120, rows=40)

Errors: NotFound (no such running kept process), InvalidRequest (no stdin, no terminal, bad arguments),
GuestError, Timeout, as for every request.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from podbay.channel.watch import DirWatch
from podbay.contracts.channel import ExecSpec, KeptProcess, Op, ProcsResult, WatchRequest

if TYPE_CHECKING:
    from podbay.channel.client import ExecProcess

__all__ = ["ProcOps", "INPUT_CHUNK_BYTES"]

# guestd takes at most 64 KiB per proc_input call (base64 in a JSON OPEN frame).
INPUT_CHUNK_BYTES = 64 * 1024


class _Ack(BaseModel):
    model_config = {"extra": "ignore"}


class ProcOps:
    """Operations on kept processes and watches; ``GuestChannel`` provides ``_open`` and ``_unary``."""

    # Declared only (no class attribute), so the methods of GuestChannel, which mixes this in, are used.
    _open: Callable[[Op, dict[str, Any]], Any]
    _unary: Callable[..., Awaitable[Any]]

    def _exec_handle(self, stream: Any, spec: ExecSpec) -> ExecProcess:
        from podbay.channel.client import ExecProcess

        return ExecProcess(self, stream, spec)  # type: ignore[arg-type]

    def watch(self, path: str, *, recursive: bool = False, interval_s: float = 0.1) -> DirWatch:
        """Watch directory ``path`` for changes (OPEN is sent at once); see ``podbay.channel.watch``."""
        req = WatchRequest(path=path, recursive=recursive, interval_s=interval_s)
        return DirWatch(self, self._open(Op.WATCH, req.model_dump()))

    async def procs(self) -> list[KeptProcess]:
        """The kept processes that run in the guest."""
        return (await self._unary(Op.PROCS, {}, ProcsResult)).processes  # type: ignore[no-any-return]

    def attach(self, pid: int) -> ExecProcess:
        """Receive kept process ``pid``'s output and exit on a new stream (OPEN is sent at once); the
        stream it had gets nothing more. Iterate and ``wait()`` as for ``exec``."""
        return self._exec_handle(self._open(Op.ATTACH, {"pid": int(pid)}), ExecSpec(argv=["attach"]))

    async def proc_input(self, pid: int, data: bytes) -> None:
        """Write ``data`` to the stdin (or terminal) of kept process ``pid``, in chunks."""
        for i in range(0, max(len(data), 1), INPUT_CHUNK_BYTES):
            chunk = data[i:i + INPUT_CHUNK_BYTES]
            await self._unary(Op.PROC_INPUT, {"pid": int(pid), "data_b64": base64.b64encode(chunk).decode()}, _Ack)

    async def proc_close_stdin(self, pid: int) -> None:
        """EOF on kept process ``pid``'s stdin."""
        await self._unary(Op.PROC_CLOSE_STDIN, {"pid": int(pid)}, _Ack)

    async def proc_signal(self, pid: int, signum: int) -> None:
        """Send ``signum`` to kept process ``pid``'s process group."""
        await self._unary(Op.PROC_SIGNAL, {"pid": int(pid), "signal": int(signum)}, _Ack)

    async def proc_resize(self, pid: int, *, cols: int, rows: int) -> None:
        """Resize kept process ``pid``'s terminal."""
        await self._unary(Op.PROC_RESIZE, {"pid": int(pid), "cols": int(cols), "rows": int(rows)}, _Ack)
