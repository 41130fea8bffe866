"""The channel server: decodes frames, tracks sessions and streams, runs each operation in its own thread.

Threads: one reader (decode and dispatch; it never blocks on anything but the port and the write lock) and
a pool of workers, one per open stream (the operation; exec with stdin takes a second one). Workers are
kept and reused because starting a thread costs milliseconds in a guest under TCG while handing work to
an idle worker costs a fraction of one. ``INLINE_OPS`` (ping, hello: no I/O, no blocking) are answered on
the reader thread itself. Frames are written whole under one lock.

Sessions: the host opens every connection with HELLO ``{"version", "session"}``. A new session token means
the host reconnected (restore, node-agent restart), which the guest cannot otherwise see: every stream of the
old session is orphaned (exec keeps running with its output discarded; file transfers are aborted) and no
frame of an orphaned stream is written any more, so stale stream ids never reach the new host.

Flow control (docs/channel.md): each side may send at most INITIAL_WINDOW DATA payload bytes per stream
beyond what the receiver has credited back with CREDIT frames. A host that overruns the window fails that
stream with ``invalid``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from podbay.channel import frames
from podbay.channel.frames import Frame, FrameType

from .errors import OpError
from .port import Port

__all__ = ["Stream", "Server", "Handler", "Workers", "MAX_STREAMS", "INLINE_OPS", "IDLE_READ_S"]

log = logging.getLogger("guestd")

MAX_STREAMS = 4096
# A partial frame older than this, with a complete HELLO buffered behind it, is a torn frame of a host that
# went away mid-frame (see Decoder.abandon_partial).
PARTIAL_STALL_S = 0.5
_POLL_S = 0.25
# With nothing partial to time out and no stop event to watch, the reader sleeps until data or a host comes
# (the port wakes it for both); the bound is only a safety net. Under TCG each wakeup of an idle guest is
# emulated: polling every 0.25 s was a third of an idle guest's own CPU time.
IDLE_READ_S = 30.0
# Operations cheap and non-blocking enough to answer on the reader thread.
INLINE_OPS = frozenset({"ping", "hello"})
# Idle workers kept beyond this many exit; PRESTART_WORKERS exist from the start (so they are part of a
# template snapshot and a restored guest starts no thread for its first requests).
MAX_IDLE_WORKERS = 16
PRESTART_WORKERS = 4

Handler = Callable[["Stream", dict[str, Any]], dict[str, Any] | None]


class Stream:
    """One operation's stream, as seen by its handler thread.

    ``next_frame`` yields the host's DATA/EOF frames (None once cancelled or orphaned); ``send_data``
    blocks for flow-control credit; ``consumed`` returns credit to the host for bytes it sent.
    """

    def __init__(self, server: Server, stream_id: int, session: str | None, op: str) -> None:
        self.server = server
        self.id = stream_id
        self.session = session
        self.op = op
        self.inbox: queue.SimpleQueue[Frame | None] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.send_window = frames.INITIAL_WINDOW
        self.recv_window = frames.INITIAL_WINDOW
        self.unacked = 0
        self.cancelled = threading.Event()
        self.orphaned = False
        self.ended = False
        self.on_signal: Callable[[int], None] | None = None
        self.on_cancel: Callable[[bool], None] | None = None

    @property
    def forwarding(self) -> bool:
        """True while frames of this stream still reach the host."""
        return not (self.cancelled.is_set() or self.ended)

    def send(self, data: bytes) -> None:
        """Write one encoded frame of this stream (dropped when the stream is orphaned or ended)."""
        self.server.write_frame(data, self)

    def send_json(self, ftype: FrameType, obj: Any) -> None:
        self.send(frames.encode_json(ftype, self.id, obj))

    def wait_window(self, want: int, timeout_s: float | None = None) -> int:
        """Block until some send credit is available; return how many bytes (at most ``want``) may be
        sent now, or 0 when the stream stopped forwarding (or ``timeout_s`` passed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while self.send_window <= 0 and self.forwarding:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return 0
                self.cond.wait(remaining if remaining is not None else 1.0)
            if not self.forwarding:
                return 0
            return min(want, self.send_window)

    def send_data(self, fd: int, data: bytes) -> bool:
        """Send ``data`` as DATA frames on ``fd``, waiting for credit as needed. Returns False (and sends
        nothing more) once the stream stops forwarding."""
        view = memoryview(data)
        while view:
            n = self.wait_window(min(len(view), frames.CHUNK_SIZE))
            if n <= 0:
                return False
            with self.cond:
                self.send_window -= n
            self.send(frames.encode_data(self.id, fd, bytes(view[:n])))
            view = view[n:]
        return True

    def add_credit(self, n: int) -> None:
        with self.cond:
            self.send_window = min(self.send_window + n, 1 << 31)
            self.cond.notify_all()

    def consumed(self, n: int, *, flush: bool = False) -> None:
        """Tell the host that ``n`` bytes it sent were used; CREDIT goes out in batches."""
        with self.cond:
            self.unacked += n
            if self.unacked < frames.CREDIT_BATCH and not (flush and self.unacked):
                return
            grant, self.unacked = self.unacked, 0
            self.recv_window += grant
        self.send(frames.encode_credit(self.id, grant))

    def next_frame(self, timeout_s: float | None = None) -> Frame | None:
        """The next DATA/EOF frame from the host; None once cancelled/orphaned. Raises ``queue.Empty`` on
        timeout."""
        if self.cancelled.is_set():
            return None
        item = self.inbox.get(timeout=timeout_s)
        return None if item is None or self.cancelled.is_set() else item

    def cancel(self, *, orphan: bool) -> None:
        """Stop the stream: a host CANCEL (``orphan=False``) or a new session (``orphan=True``)."""
        if orphan:
            self.orphaned = True
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        self.inbox.put(None)
        with self.cond:
            self.cond.notify_all()
        if self.on_cancel is not None:
            try:
                self.on_cancel(orphan)
            except Exception:  # noqa: BLE001 - a failing cancel hook must not kill the reader
                log.exception("cancel hook of stream %d", self.id)


class Workers:
    """A pool of daemon threads running ``fn(*args)`` jobs; grows when no worker is idle, keeps at most
    ``max_idle`` idle ones. Exceptions of a job are logged."""

    def __init__(self, max_idle: int = MAX_IDLE_WORKERS) -> None:
        self.max_idle = max_idle
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._count = 0

    def prestart(self, n: int) -> None:
        """Start ``n`` idle workers now."""
        for _ in range(n):
            self._start(None)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` on an idle worker, or on a new one when none is idle."""
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1  # reserve it: each reservation is matched by exactly one job below
        if reuse:
            self._jobs.put((fn, args, kwargs))
        else:
            self._start((fn, args, kwargs))

    def _start(self, job: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None) -> None:
        with self._lock:
            self._count += 1
            n = self._count
        threading.Thread(target=self._loop, args=(job,), name=f"worker-{n}", daemon=True).start()

    def _loop(self, job: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None) -> None:
        while True:
            if job is not None:
                fn, args, kwargs = job
                try:
                    fn(*args, **kwargs)
                except Exception:  # noqa: BLE001 - a failing job must not kill the worker
                    log.exception("worker job %s failed", getattr(fn, "__name__", fn))
                job = None  # drop references before idling
            with self._lock:
                if self._idle >= self.max_idle:
                    return
                self._idle += 1
            job = self._jobs.get()


class Server:
    """Serves the channel on ``port`` with ``handlers`` (op name -> function(stream, args) -> result).

    ``state`` is shared by operations (after_restore env, freeze state, the system interface).
    """

    def __init__(self, port: Port, handlers: dict[str, Handler], state: Any) -> None:
        self.port = port
        self.handlers = handlers
        self.state = state
        self.decoder = frames.Decoder()
        self.streams: dict[int, Stream] = {}
        self.streams_lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.session: str | None = None
        self.info: Callable[[str | None], dict[str, Any]] = lambda session: {"session": session}
        self.ignored_frames = 0
        self.workers = Workers()

    def spawn(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` on a worker thread (operations' helpers: stdin pumps, drains)."""
        self.workers.submit(fn, *args, **kwargs)

    # -- writing ---------------------------------------------------------------------------------

    def write_frame(self, data: bytes, stream: Stream | None = None) -> None:
        """Write one encoded frame whole; frames of orphaned or ended streams are dropped."""
        with self.write_lock:
            if stream is not None and (stream.orphaned or stream.ended):
                return
            try:
                self.port.write(data)
            except OSError as exc:
                log.error("write to port failed: %s", exc)

    def _error(self, stream_id: int, code: str, message: str) -> None:
        self.write_frame(frames.encode_json(FrameType.ERROR, stream_id, {"code": code, "message": message[:4096]}))

    # -- reading ---------------------------------------------------------------------------------

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Read, decode and dispatch until ``stop`` is set."""
        partial_since: float | None = None
        while stop is None or not stop.is_set():
            data = self.port.read(_POLL_S if stop is not None or partial_since is not None else IDLE_READ_S)
            out: list[Frame] = []
            now = time.monotonic()
            if data:
                before = self.decoder.frames
                out = self.decoder.feed(data)
                if not self.decoder.partial:
                    partial_since = None
                elif partial_since is None or self.decoder.frames != before:
                    partial_since = now
            if partial_since is not None and now - partial_since >= PARTIAL_STALL_S:
                out += self.decoder.abandon_partial(require_hello=True)
                if out:
                    log.warning("dropped a torn frame before a new HELLO")
                    partial_since = now if self.decoder.partial else None
            for frame in out:
                try:
                    self.dispatch(frame)
                except Exception:  # noqa: BLE001 - never die on one bad frame
                    log.exception("dispatch of %s on stream %d", frame.type.name, frame.stream)

    def dispatch(self, frame: Frame) -> None:
        """Handle one frame from the host (reader thread)."""
        ftype = frame.type
        if ftype is FrameType.HELLO:
            self._hello(frame)
            return
        if ftype is FrameType.OPEN:
            self._open(frame)
            return
        with self.streams_lock:
            stream = self.streams.get(frame.stream)
        if stream is None:
            self.ignored_frames += 1
            return
        try:
            if ftype is FrameType.DATA:
                _, chunk = frames.parse_data(frame.payload)
                with stream.cond:
                    stream.recv_window -= len(chunk)
                    overrun = stream.recv_window < 0
                if overrun:
                    self._fail(stream, "invalid", "flow control window exceeded")
                    return
                stream.inbox.put(frame)
            elif ftype is FrameType.EOF:
                frames.parse_fd(frame.payload)
                stream.inbox.put(frame)
            elif ftype is FrameType.CREDIT:
                stream.add_credit(frames.parse_u32(frame.payload))
            elif ftype is FrameType.SIGNAL:
                signum = frames.parse_signal(frame.payload)
                if stream.on_signal is not None:
                    stream.on_signal(signum)
            elif ftype is FrameType.CANCEL:
                stream.cancel(orphan=False)
            else:
                self.ignored_frames += 1
        except frames.FrameError as exc:
            self._fail(stream, "invalid", str(exc))

    def _fail(self, stream: Stream, code: str, message: str) -> None:
        log.warning("stream %d (%s): %s", stream.id, stream.op, message)
        self.write_frame(
            frames.encode_json(FrameType.ERROR, stream.id, {"code": code, "message": message}), stream
        )
        stream.ended = True
        stream.cancel(orphan=False)

    def _hello(self, frame: Frame) -> None:
        try:
            req = frames.parse_json(frame.payload)
            session = req.get("session")
            if not isinstance(session, str) or not session:
                raise frames.FrameError("HELLO lacks a session")
        except frames.FrameError as exc:
            self._error(frame.stream, "invalid", str(exc))
            return
        old: list[Stream] = []
        with self.write_lock:
            if session != self.session:
                with self.streams_lock:
                    old = list(self.streams.values())
                    self.streams.clear()
                for stream in old:
                    stream.orphaned = True
                self.session = session
        if old:
            log.info("new session: abandoning %d stream(s) of the previous one", len(old))
        for stream in old:
            stream.cancel(orphan=True)
        self.write_frame(frames.encode_json(FrameType.HELLO, frames.CONNECTION_STREAM, self.info(session)))

    def _open(self, frame: Frame) -> None:
        sid = frame.stream
        if sid == frames.CONNECTION_STREAM:
            self.ignored_frames += 1
            return
        try:
            req = frames.parse_json(frame.payload)
        except frames.FrameError as exc:
            self._error(sid, "invalid", str(exc))
            return
        op, args = req.get("op"), req.get("args", {})
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None or not isinstance(op, str):
            self._error(sid, "invalid", f"unknown op {op!r}")
            return
        if not isinstance(args, dict):
            self._error(sid, "invalid", "args must be an object")
            return
        with self.streams_lock:
            if sid in self.streams:
                log.warning("OPEN for stream %d already open: ignored", sid)
                self.ignored_frames += 1
                return
            if len(self.streams) >= MAX_STREAMS:
                self._error(sid, "io_error", "too many open streams")
                return
            stream = Stream(self, sid, self.session, op)
            self.streams[sid] = stream
        if op in INLINE_OPS:
            self._run(stream, handler, args)
        else:
            self.workers.submit(self._run, stream, handler, args)

    def _run(self, stream: Stream, handler: Handler, args: dict[str, Any]) -> None:
        try:
            result = handler(stream, args)
            if stream.cancelled.is_set():
                raise OpError("cancelled", "cancelled by the host")
            stream.send_json(FrameType.RESULT, result or {})
        except OpError as exc:
            stream.send_json(FrameType.ERROR, {"code": exc.code, "message": exc.message[:4096]})
        except frames.FrameError as exc:
            stream.send_json(FrameType.ERROR, {"code": "internal", "message": f"answer too large: {exc}"})
        except Exception as exc:  # noqa: BLE001 - report, log, keep serving
            log.exception("op %s on stream %d failed", stream.op, stream.id)
            stream.send_json(FrameType.ERROR, {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
        finally:
            stream.ended = True
            with self.streams_lock:
                if self.streams.get(stream.id) is stream:
                    del self.streams[stream.id]
