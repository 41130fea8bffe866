"""envd's ``process.Process`` service on a sandbox's guest channel.

Every process started here is a guestd *kept* process (docs/channel.md): it outlives the RPC that
started it and the channel connection. Per sandbox, ``ProcessTable`` holds one guest stream per process
(the exec stream, or an ``attach`` stream after the node reconnected to the guest) and fans its output
out to every subscribed RPC (Start, Connect): each subscriber has its own queue, so a slow one never
stalls the process or the others. Before each call the table re-syncs with guestd's ``procs`` when the
channel is a new one (pause past the RAM-release grace, node-agent restart), attaching to the processes
that still run. Output produced while nobody is subscribed is dropped, as envd does.

A Start whose ``Connect-Timeout-Ms`` (the SDK's command ``timeout``, 60 s unless 0) passes while it streams
ends with DEADLINE_EXCEEDED *and* SIGKILLs the process's group (guestd's ``proc_signal``), as E2B's envd does
since E2B #500: a timed-out command must not keep running in the guest. A Connect's deadline only ends the
stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from podbay.channel.client import ExecProcess, GuestChannel
from podbay.contracts.channel import ExecSpec, KeptProcess, PtySize
from podbay.contracts.templates import ImageConfig
from podbay.errors import InvalidRequest, NotFound, PodbayError

from .filesystem import resolve_path
from .proto.process import process_pb as pb
from .proto.process.process_connect import Process
from .translate import (
    DEFAULT_USER,
    ENV_HEADER,
    connect_error,
    default_env,
    end_status,
    selector,
    user_from_authorization,
)

__all__ = ["ProcessService", "ProcessTable", "Proc", "close_tables", "KEEPALIVE_HEADER", "MAX_QUEUED_EVENTS"]

log = logging.getLogger("podbay.nodeagent.envd")

KEEPALIVE_HEADER = "keepalive-ping-interval"
_DEFAULT_KEEPALIVE_S = 30.0
# A subscriber that falls this many events behind is cut off (its RPC ends with RESOURCE_EXHAUSTED)
# rather than buffering without bound.
MAX_QUEUED_EVENTS = 4096
_SIGNALS = {pb.Signal.SIGTERM: signal.SIGTERM, pb.Signal.SIGKILL: signal.SIGKILL}

Event = pb.ProcessEvent | ConnectError


@dataclass
class Proc:
    """One process as the node sees it: how it was started and who listens to it."""

    pid: int
    config: pb.ProcessConfig
    tag: str | None
    pty: bool
    subscribers: set[asyncio.Queue[Event | None]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def subscribe(self) -> asyncio.Queue[Event | None]:
        q: asyncio.Queue[Event | None] = asyncio.Queue()
        self.subscribers.add(q)
        return q

    def publish(self, item: Event | None) -> None:
        for q in list(self.subscribers):
            if q.qsize() >= MAX_QUEUED_EVENTS and item is not None:
                self.subscribers.discard(q)
                q.put_nowait(ConnectError(Code.RESOURCE_EXHAUSTED, "subscriber too slow: output dropped"))
                q.put_nowait(None)
                continue
            q.put_nowait(item)


def _config_of(kp: KeptProcess) -> pb.ProcessConfig:
    cfg = pb.ProcessConfig(cmd=kp.argv[0], args=list(kp.argv[1:]), envs=dict(kp.env))
    if kp.cwd is not None:
        cfg.cwd = kp.cwd
    return cfg


class ProcessTable:
    """The processes of one sandbox, bound to the guest channel they were last synced on."""

    def __init__(self) -> None:
        self.channel: GuestChannel | None = None
        self.procs: dict[int, Proc] = {}
        self.lock = asyncio.Lock()

    async def sync(self, ch: GuestChannel) -> None:
        """Re-attach to guestd's kept processes when ``ch`` is a channel this table has not seen."""
        if self.channel is ch:
            return
        async with self.lock:
            if self.channel is ch:
                return
            for proc in self.procs.values():
                if proc.task is not None:
                    proc.task.cancel()
            self.procs.clear()
            for kp in await ch.procs():
                handle = ch.attach(kp.pid)
                try:
                    await handle.started()
                except NotFound:
                    await handle.__aexit__(None, None, None)
                    continue  # ended in between
                self.add(Proc(kp.pid, _config_of(kp), kp.tag, kp.pty is not None), handle)
            self.channel = ch

    def add(self, proc: Proc, handle: ExecProcess) -> None:
        """Track ``proc`` and start pumping ``handle``'s output to its subscribers."""
        self.procs[proc.pid] = proc
        proc.task = asyncio.create_task(self._pump(proc, handle), name=f"envd-proc-{proc.pid}")

    async def _pump(self, proc: Proc, handle: ExecProcess) -> None:
        end: Event
        try:
            async with handle:
                async for kind, data in handle:
                    proc.publish(data_event("pty" if proc.pty else kind, data))
                ex = await handle.wait()
            ended: Oneof[Literal["end"], pb.ProcessEvent.EndEvent] = Oneof("end", pb.ProcessEvent.EndEvent(
                exit_code=ex.exit_code, exited=ex.exit_code >= 0, status=end_status(ex.exit_code)))
            end = pb.ProcessEvent(event=ended)
        except asyncio.CancelledError:
            proc.publish(ConnectError(Code.UNAVAILABLE, "the node lost the guest connection; connect again"))
            proc.publish(None)
            raise
        except PodbayError as exc:
            # The channel is gone (ChannelClosed) or the guest failed: the process may still run; the
            # next call re-syncs and attaches again.
            end = ConnectError(Code.UNAVAILABLE, f"lost the process's output: {exc.message}")
            if self.procs.get(proc.pid) is proc:
                self.channel = None
        if self.procs.get(proc.pid) is proc and not isinstance(end, ConnectError):
            del self.procs[proc.pid]
        proc.publish(end)
        proc.publish(None)

    def find(self, process: Any) -> Proc:
        """The tracked process named by a ``ProcessSelector``; ``NotFound`` otherwise."""
        pid, tag = selector(process)
        found = self.procs.get(pid) if pid is not None else next(
            (p for p in self.procs.values() if p.tag == tag), None)
        if found is None:
            raise NotFound(f"process with {'pid ' + str(pid) if pid is not None else 'tag ' + repr(tag)} not found")
        return found


async def _stream(proc: Proc, q: asyncio.Queue[Event | None], first: pb.ProcessEvent,
                  keepalive_s: float, ctx: RequestContext[Any, Any],
                  on_deadline: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[pb.ProcessEvent]:
    """The events for one subscriber; ends with DEADLINE_EXCEEDED when the request's ``Connect-Timeout-Ms``
    passes, after awaiting ``on_deadline`` when given (Start: kill the process group)."""
    try:
        yield first
        while True:
            left = ctx.timeout_ms
            if left is not None and left <= 0:
                if on_deadline is not None:
                    await on_deadline()
                raise ConnectError(Code.DEADLINE_EXCEEDED, "the stream's deadline (Connect-Timeout-Ms) passed")
            wait_s = keepalive_s if left is None else min(keepalive_s, left / 1000.0)
            try:
                item = await asyncio.wait_for(q.get(), wait_s)
            except TimeoutError:
                if left is None or left / 1000.0 > keepalive_s:
                    alive: Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive] = Oneof(
                        "keepalive", pb.ProcessEvent.KeepAlive())
                    yield pb.ProcessEvent(event=alive)
                continue
            if item is None:
                return
            if isinstance(item, ConnectError):
                raise item
            yield item
    finally:
        proc.subscribers.discard(q)


def _keepalive_s(ctx: RequestContext[Any, Any]) -> float:
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    try:
        return min(max(float(raw), 1.0), 300.0) if raw else _DEFAULT_KEEPALIVE_S
    except ValueError:
        return _DEFAULT_KEEPALIVE_S


class ProcessService(Process):
    """The ``process.Process`` RPCs for every sandbox of a node. ``channel_for(ctx)`` returns the sandbox's
    guest channel and its table (raising ``PodbayError`` for an unknown, paused or fenced sandbox);
    ``defaults_for(ctx)``, when given, the sandbox's template config (a built template's WORKDIR, USER and
    ENV, as E2B's envd takes a template's default user and workdir)."""

    def __init__(self, channel_for: Callable[[RequestContext[Any, Any]], tuple[GuestChannel, ProcessTable]],
                 defaults_for: Callable[[RequestContext[Any, Any]], Awaitable[ImageConfig | None]] | None = None
                 ) -> None:
        self._channel_for = channel_for
        self._defaults_for = defaults_for

    async def _table(self, ctx: RequestContext[Any, Any]) -> tuple[GuestChannel, ProcessTable]:
        try:
            ch, table = self._channel_for(ctx)
            await table.sync(ch)
        except PodbayError as exc:
            raise connect_error(exc) from exc
        return ch, table

    async def list(self, request: pb.ListRequest, ctx: RequestContext[Any, Any]) -> pb.ListResponse:
        """Running processes started through envd (pid, tag, command)."""
        _, table = await self._table(ctx)
        out = []
        for p in sorted(table.procs.values(), key=lambda p: p.pid):
            info = pb.ProcessInfo(config=p.config, pid=p.pid)
            if p.tag is not None:
                info.tag = p.tag
            out.append(info)
        return pb.ListResponse(processes=out)

    async def start(self, request: pb.StartRequest, ctx: RequestContext[Any, Any]) -> AsyncIterator[pb.StartResponse]:
        """Start a process (as the template's user, else ``user``, in the template's workdir, else the
        user's home; the template's ENV under the sandbox's default environment from the ``x-podbay-e2b-env``
        header under the request's ``envs``) and stream start, data and end events."""
        ch, table = await self._table(ctx)
        cfg = request.process or pb.ProcessConfig()
        try:
            if not cfg.cmd:
                raise InvalidRequest("process.cmd is empty")
            tpl = await self._defaults_for(ctx) if self._defaults_for is not None else None
            user = (user_from_authorization(ctx.request_headers.get("authorization"))
                    or (tpl.user if tpl is not None and tpl.user else DEFAULT_USER))
            pty = request.pty.size if request.pty is not None else None
            env = {**(tpl.env if tpl is not None else {}), **default_env(ctx.request_headers.get(ENV_HEADER)),
                   **dict(cfg.envs)}
            # A relative cwd is taken from the user's home, as envd does.
            cwd = resolve_path(cfg.cwd, user) if cfg.cwd else (tpl.workdir if tpl is not None else None)
            spec = ExecSpec(argv=[cfg.cmd, *cfg.args], env=env, cwd=cwd, user=user,
                            stdin=bool(request.stdin), keep=True, tag=request.tag,
                            pty=PtySize(cols=pty.cols or 80, rows=pty.rows or 24) if pty is not None else None)
            handle = ch.exec(spec)
            try:
                pid = await handle.started()
            except BaseException:
                await handle.__aexit__(None, None, None)
                raise
        except PodbayError as exc:
            raise connect_error(exc) from exc
        except ValueError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from exc
        proc = Proc(pid, cfg, request.tag, pty is not None)
        q = proc.subscribe()
        table.add(proc, handle)
        first = start_event(pid)

        async def kill_group() -> None:
            # The command timed out: the process and its group go (E2B #500), whatever they do.
            try:
                await ch.proc_signal(pid, signal.SIGKILL)
                log.info("envd process %d: its start stream's deadline passed: process group killed", pid)
            except PodbayError as exc:  # ended meanwhile, or the guest went away: nothing left to kill here
                log.debug("envd process %d: kill at the deadline: %s", pid, exc.message)

        async for ev in _stream(proc, q, first, _keepalive_s(ctx), ctx, on_deadline=kill_group):
            yield pb.StartResponse(event=ev)

    async def connect(self, request: pb.ConnectRequest, ctx: RequestContext[Any, Any]
                      ) -> AsyncIterator[pb.ConnectResponse]:
        """Stream a running process's events from now on (first a start event with its pid)."""
        _, table = await self._table(ctx)
        try:
            proc = table.find(request.process)
        except PodbayError as exc:
            raise connect_error(exc) from exc
        q = proc.subscribe()
        first = start_event(proc.pid)
        async for ev in _stream(proc, q, first, _keepalive_s(ctx), ctx):
            yield pb.ConnectResponse(event=ev)

    async def _on(self, ctx: RequestContext[Any, Any], process: Any,
                  op: Callable[[GuestChannel, Proc], Any]) -> None:
        ch, table = await self._table(ctx)
        try:
            await op(ch, table.find(process))
        except PodbayError as exc:
            raise connect_error(exc) from exc

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any]) -> pb.SendInputResponse:
        """Write bytes to a process's stdin (or its terminal)."""
        data = request.input.input.value if request.input is not None and request.input.input is not None else b""
        await self._on(ctx, request.process, lambda ch, p: ch.proc_input(p.pid, data))
        return pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext[Any, Any]
                           ) -> pb.StreamInputResponse:
        """Input as a client stream: a start event naming the process, then data events."""
        target: Any = None
        async for msg in request:
            ev = msg.event
            if ev is None or ev.field == "keepalive":
                continue
            if ev.field == "start":
                target = ev.value.process
            elif target is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "send a start event naming the process first")
            else:
                inp = ev.value.input
                data = inp.input.value if inp is not None and inp.input is not None else b""
                await self._on(ctx, target, functools.partial(_send_input, data=data))
        return pb.StreamInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext[Any, Any]
                          ) -> pb.SendSignalResponse:
        """SIGTERM or SIGKILL to a process's group."""
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGTERM or SIGKILL")
        await self._on(ctx, request.process, lambda ch, p: ch.proc_signal(p.pid, signum))
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
                          ) -> pb.CloseStdinResponse:
        """EOF on a process's stdin (not for a PTY: send Ctrl-D)."""
        await self._on(ctx, request.process, lambda ch, p: ch.proc_close_stdin(p.pid))
        return pb.CloseStdinResponse()

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any]) -> pb.UpdateResponse:
        """Resize a process's terminal."""
        if request.pty is None or request.pty.size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "give pty.size")
        size = request.pty.size
        await self._on(ctx, request.process, lambda ch, p: ch.proc_resize(p.pid, cols=size.cols, rows=size.rows))
        return pb.UpdateResponse()


def close_tables(tables: dict[str, ProcessTable]) -> None:
    """Stop every pump (node shutdown); the guest's processes keep running."""
    for table in tables.values():
        for proc in table.procs.values():
            if proc.task is not None:
                with contextlib.suppress(Exception):
                    proc.task.cancel()


def start_event(pid: int) -> pb.ProcessEvent:
    """The first event of a process stream (envd's ``StartEvent`` with the pid)."""
    start: Oneof[Literal["start"], pb.ProcessEvent.StartEvent] = Oneof("start", pb.ProcessEvent.StartEvent(pid=pid))
    return pb.ProcessEvent(event=start)


def data_event(kind: str, data: bytes) -> pb.ProcessEvent:
    """An output event: ``kind`` ``pty``, ``stderr`` or (anything else) ``stdout``, the oneof field of envd's
    ``DataEvent``. Each field is spelled out so the type checker sees the generated oneof's literal names."""
    output: Oneof[Literal["stdout"], bytes] | Oneof[Literal["stderr"], bytes] | Oneof[Literal["pty"], bytes]
    if kind == "pty":
        pty: Oneof[Literal["pty"], bytes] = Oneof("pty", data)
        output = pty
    elif kind == "stderr":
        err: Oneof[Literal["stderr"], bytes] = Oneof("stderr", data)
        output = err
    else:
        out: Oneof[Literal["stdout"], bytes] = Oneof("stdout", data)
        output = out
    event: Oneof[Literal["data"], pb.ProcessEvent.DataEvent] = Oneof("data", pb.ProcessEvent.DataEvent(output=output))
    return pb.ProcessEvent(event=event)


async def _send_input(ch: GuestChannel, p: Proc, *, data: bytes) -> None:
    await ch.proc_input(p.pid, data)
