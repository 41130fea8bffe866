"""Kept processes: execs started with ``keep`` outlive the stream (and the host session) that started them.

A kept process is listed by ``procs``; ``attach {pid}`` makes a new stream its output target (STARTED,
DATA 1/2 from then on, RESULT with the exit when it ends: the host reconnected, or wants the output on
another stream); ``proc_input`` writes to its stdin (or its terminal), ``proc_close_stdin`` closes it,
``proc_signal`` signals its process group and ``proc_resize`` sets its terminal's size. A CANCEL or a
lost session never kills a kept process: only a signal does. It leaves the registry when it exits.
Output produced while no stream is attached is read and dropped, so the process never blocks on it.
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import select
import threading
from typing import Any

from podbay.channel.frames import FrameType

from .errors import OpError, from_oserror
from .server import Stream
from .spawn import Child, set_winsize

__all__ = ["Kept", "REGISTRY", "Registry", "PROC_OPS", "MAX_INPUT_BYTES"]

MAX_INPUT_BYTES = 64 * 1024
_INPUT_TIMEOUT_S = 10.0


class Kept:
    """One kept process: its ``Child``, how it was started (for listings), and the stream its output goes
    to (``target``; swapped by ``attach``). ``done`` is set with ``exit`` when it has ended."""

    def __init__(self, child: Child, stream: Stream, info: dict[str, Any]) -> None:
        self.child = child
        self.info = info
        self.target = stream
        self.lock = threading.Lock()
        self.stdin_lock = threading.Lock()
        self.done = threading.Event()
        self.exit: dict[str, Any] | None = None

    def finish(self, exit_info: dict[str, Any]) -> None:
        self.exit = exit_info
        self.done.set()


class Registry:
    """Kept processes by pid (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: dict[int, Kept] = {}

    def add(self, kept: Kept) -> None:
        with self._lock:
            self._procs[kept.child.pid] = kept

    def remove(self, pid: int) -> None:
        with self._lock:
            self._procs.pop(pid, None)

    def list(self) -> list[Kept]:
        with self._lock:
            return list(self._procs.values())

    def find(self, args: dict[str, Any]) -> Kept:
        """The process named by ``{"pid"}`` or ``{"tag"}``; ``OpError`` not_found or invalid."""
        pid, tag = args.get("pid"), args.get("tag")
        with self._lock:
            if isinstance(pid, int) and not isinstance(pid, bool):
                kept = self._procs.get(pid)
            elif isinstance(tag, str) and tag:
                kept = next((k for k in self._procs.values() if k.info.get("tag") == tag), None)
            else:
                raise OpError("invalid", "give a pid (integer) or a tag (string)")
        if kept is None:
            raise OpError("not_found", f"no running process {pid if pid is not None else tag!r}")
        return kept


REGISTRY = Registry()


def op_procs(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``procs`` -> ``{"processes": [{pid, tag, argv, env, cwd, pty}]}``, kept processes that run."""
    return {"processes": [{"pid": k.child.pid, **k.info} for k in REGISTRY.list() if not k.done.is_set()]}


def op_attach(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``attach {pid | tag}``: STARTED ``{"pid"}``, then the process's output on this stream until it ends
    -> ExecExit. The stream it replaces gets no more output."""
    kept = REGISTRY.find(args)
    with kept.lock:
        kept.target = stream
    stream.on_signal = kept.child.signal_group
    stream.send_json(FrameType.STARTED, {"pid": kept.child.pid})
    while not kept.done.wait(0.5):
        if stream.cancelled.is_set():
            raise OpError("cancelled", "cancelled")
    return dict(kept.exit or {})


def _data(args: dict[str, Any]) -> bytes:
    raw = args.get("data_b64", "")
    if not isinstance(raw, str):
        raise OpError("invalid", "data_b64 must be a string")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OpError("invalid", "data_b64 is not base64") from exc
    if len(data) > MAX_INPUT_BYTES:
        raise OpError("invalid", f"at most {MAX_INPUT_BYTES} bytes per call")
    return data


def op_proc_input(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``proc_input {pid | tag, data_b64}``: write to the process's stdin (its terminal with a PTY)
    -> ``{"written"}``. invalid when it has no stdin (or it was closed); io_error when it does not read
    for 10 s."""
    kept = REGISTRY.find(args)
    data = _data(args)
    child = kept.child
    fd = child.stdout if child.pty else child.stdin
    if fd is None:
        raise OpError("invalid", "the process was started without stdin, or its stdin is closed")
    view = memoryview(data)
    with kept.stdin_lock:
        while view:
            if not select.select([], [fd], [], _INPUT_TIMEOUT_S)[1]:
                raise OpError("io_error", "the process does not read its input")
            try:
                view = view[os.write(fd, view[:4096]):]
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EBADF, errno.EIO):
                    raise OpError("invalid", "the process's input is closed") from exc
                raise from_oserror(exc) from exc
    return {"written": len(data)}


def op_proc_close_stdin(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``proc_close_stdin {pid | tag}``: EOF on the process's stdin (not for a PTY: send Ctrl-D)."""
    kept = REGISTRY.find(args)
    if kept.child.pty:
        raise OpError("invalid", "a terminal has no separate stdin to close; send Ctrl-D (0x04)")
    with kept.stdin_lock:
        fd, kept.child.stdin = kept.child.stdin, None
    if fd is not None:
        os.close(fd)
    return {"closed": True}


def op_proc_signal(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``proc_signal {pid | tag, signal}``: send the signal to the process group."""
    kept = REGISTRY.find(args)
    signum = args.get("signal")
    if isinstance(signum, bool) or not isinstance(signum, int) or not 1 <= signum <= 64:
        raise OpError("invalid", "signal must be an integer in 1..64")
    kept.child.signal_group(signum)
    return {"signalled": True}


def op_proc_resize(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``proc_resize {pid | tag, cols, rows}``: set the size of the process's terminal."""
    kept = REGISTRY.find(args)
    cols, rows = args.get("cols"), args.get("rows")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 10000 for v in (cols, rows)):
        raise OpError("invalid", "cols and rows must be integers in 1..10000")
    if not kept.child.pty:
        raise OpError("invalid", "the process has no terminal")
    try:
        set_winsize(kept.child.stdout, cols, rows)  # type: ignore[arg-type]
    except OSError as exc:
        raise from_oserror(exc) from exc
    return {"cols": cols, "rows": rows}


PROC_OPS = {
    "procs": op_procs,
    "attach": op_attach,
    "proc_input": op_proc_input,
    "proc_close_stdin": op_proc_close_stdin,
    "proc_signal": op_proc_signal,
    "proc_resize": op_proc_resize,
}
