"""envd's ``filesystem.Filesystem`` service on a sandbox's guest channel.

Paths may be absolute, or relative to the user's home (``~`` too). Directories made here belong to the
caller's user (default ``user``). ``WatchDir`` streams guestd ``watch`` events; the polling watchers
(``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher``, used by the synchronous SDK) keep a guestd
watch open on the node and buffer its events (at most ``MAX_BUFFERED_EVENTS``) until they are fetched; a
watcher not fetched for ``WATCHER_IDLE_S`` is stopped.

The synchronous SDK reads a watcher right after its own write returns (``files.write`` then
``get_new_events``), and envd answers with that write's events. Here the events take a detour (guestd
batches inotify events a few milliseconds apart, then the channel), so the node remembers, per watcher, the
end of the last change made through envd under the watched path (uploads, MakeDir, Move, Remove:
:meth:`FilesystemService.note_change`); ``GetWatcherEvents`` waits (at most ``WATCHER_SETTLE_S``) until an
event received after that change is buffered, plus ``_QUIET_S`` for the rest of its batch. A poll with no
such change pending answers at once.

A symlink's entry (Stat, ListDir) has its target's type and ``symlink_target``, the absolute path it
resolves to, as envd reports them; the node resolves it in the guest with ``realpath -e`` (an argv, no
shell).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from podbay.channel.client import GuestChannel
from podbay.channel.watch import DirWatch
from podbay.contracts.channel import ExecSpec, FileStat
from podbay.errors import InvalidRequest, NotFound, PodbayError

from .proto.filesystem import filesystem_pb as pb
from .proto.filesystem.filesystem_connect import Filesystem
from .translate import DEFAULT_USER, METADATA_XATTR_PREFIX, connect_error, entry_info, filesystem_event, user_from_authorization

__all__ = ["FilesystemService", "resolve_path", "home_of", "MAX_BUFFERED_EVENTS", "MAX_LIST_DEPTH", "WATCHER_IDLE_S",
           "WATCHER_SETTLE_S"]

log = logging.getLogger(__name__)

MAX_BUFFERED_EVENTS = 10000
# A polling watcher nobody fetched for this long is stopped and forgotten.
WATCHER_IDLE_S = 60.0
_IDLE_CHECK_S = 5.0
MAX_LIST_DEPTH = 16
_KEEPALIVE_S = 30.0
# How long GetWatcherEvents waits for the events of a change made through envd just before it; then the
# rest of that batch (guestd sends a batch 20 ms after its first event).
WATCHER_SETTLE_S = 2.0
_QUIET_S = 0.03
_RESOLVE_TIMEOUT_S = 10.0


def home_of(user: str) -> str:
    """The home directory of ``user`` in podbay's templates (``/root`` for root, else ``/home/<user>``)."""
    return "/root" if user in ("root", "0") else f"/home/{user}"


def resolve_path(path: str, user: str) -> str:
    """An absolute, normalised path: relative ones (and ``~``) are taken from ``user``'s home.
    Raises ``InvalidRequest`` for an empty path or one with a NUL byte."""
    if not path or "\0" in path:
        raise InvalidRequest("path must be a non-empty string without NUL bytes")
    if path == "~" or path.startswith("~/"):
        path = home_of(user) + path[1:]
    elif not path.startswith("/"):
        path = f"{home_of(user)}/{path}"
    return posixpath.normpath(path) if path != "/" else "/"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass
class _Watcher:
    sandbox_id: str
    root: str
    watch: DirWatch
    include_entry: bool
    events: list[pb.FilesystemEvent] = field(default_factory=list)
    error: ConnectError | None = None
    task: asyncio.Task[None] | None = None
    last_poll: float = field(default_factory=time.monotonic)
    # monotonic time the last event arrived, and the end of the last change through envd under ``root``
    # whose events a poll still waits for (0: none)
    last_event: float = 0.0
    change: float = 0.0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class FilesystemService(Filesystem):
    """The ``filesystem.Filesystem`` RPCs for every sandbox of a node. ``channel_for(ctx)`` returns
    ``(sandbox_id, channel)`` or raises ``PodbayError``."""

    def __init__(self, channel_for: Callable[[RequestContext[Any, Any]], tuple[str, GuestChannel]]) -> None:
        self._channel_for = channel_for
        self._watchers: dict[str, _Watcher] = {}

    def _ctx(self, ctx: RequestContext[Any, Any]) -> tuple[str, GuestChannel, str]:
        try:
            sandbox_id, ch = self._channel_for(ctx)
            user = user_from_authorization(ctx.request_headers.get("authorization")) or DEFAULT_USER
        except PodbayError as exc:
            raise connect_error(exc) from exc
        return sandbox_id, ch, user

    def note_change(self, sandbox_id: str, *paths: str) -> None:
        """A change through envd (an upload, MakeDir, Move, Remove) of ``paths`` just ended: the next poll
        of each watcher of the sandbox over one of them waits for its events (module docstring)."""
        now = time.monotonic()
        for w in self._watchers.values():
            if w.sandbox_id == sandbox_id and any(_under(p, w.root) for p in paths):
                w.change = now

    async def _settle(self, w: _Watcher) -> None:
        """Wait until an event that arrived after ``w.change`` is buffered (at most WATCHER_SETTLE_S), then
        _QUIET_S for the rest of its batch; at once when no change is pending or the watch ended."""
        if not w.change:
            return
        deadline = time.monotonic() + WATCHER_SETTLE_S
        while w.last_event < w.change and w.error is None and w.task is not None and not w.task.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            w.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.arrived.wait(), left)
        if w.last_event >= w.change:
            await asyncio.sleep(_QUIET_S)
        w.change = 0.0

    async def _entry(self, ch: GuestChannel, st: FileStat) -> pb.EntryInfo:
        """``entry_info`` of ``st``, a symlink's resolved in the guest first (``realpath -e``, as envd's
        EvalSymlinks: every link on the way followed, the result absolute; unresolvable -> the link's path)."""
        if st.type != "symlink":
            return entry_info(st)
        target: FileStat | None = None
        resolved = st.path
        try:
            out, _, ex = await ch.run(ExecSpec(argv=["realpath", "-e", "--", st.path], timeout_s=_RESOLVE_TIMEOUT_S))
            if ex.exit_code == 0 and out.strip():
                resolved = out.decode(errors="replace").rstrip("\n")
                target = await ch.stat(resolved)
        except PodbayError as exc:
            log.debug("cannot resolve the symlink %s: %s", st.path, exc.message)
            resolved, target = st.path, None
        return entry_info(st, (resolved, target))

    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any]) -> pb.StatResponse:
        """Metadata of a path (NOT_FOUND when missing); a symlink's as envd shows it (module docstring)."""
        _, ch, user = self._ctx(ctx)
        try:
            st = await ch.stat(resolve_path(request.path, user), xattrs=METADATA_XATTR_PREFIX)
            return pb.StatResponse(entry=await self._entry(ch, st))
        except PodbayError as exc:
            raise connect_error(exc) from exc

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any]) -> pb.MakeDirResponse:
        """Create a directory and its parents, owned by the user; ALREADY_EXISTS when it exists."""
        sandbox_id, ch, user = self._ctx(ctx)
        path = resolve_path(request.path, user)
        try:
            st = await ch.mkdir(path, parents=True, exist_ok=False, user=user)
        except PodbayError as exc:
            raise connect_error(exc) from exc
        finally:
            self.note_change(sandbox_id, path)
        return pb.MakeDirResponse(entry=entry_info(st))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any]) -> pb.MoveResponse:
        """Rename ``source`` to ``destination`` -> the destination's entry with its metadata (rename keeps the
        inode, so its ``user.e2b.*`` attributes go with it)."""
        sandbox_id, ch, user = self._ctx(ctx)
        source, destination = resolve_path(request.source, user), resolve_path(request.destination, user)
        try:
            await ch.move(source, destination)
            st = await ch.stat(destination, xattrs=METADATA_XATTR_PREFIX)
            return pb.MoveResponse(entry=await self._entry(ch, st))
        except PodbayError as exc:
            raise connect_error(exc) from exc
        finally:
            self.note_change(sandbox_id, source, destination)

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any]) -> pb.ListDirResponse:
        """Entries under a directory down to ``depth`` levels (0 and 1: its own entries), by path."""
        _, ch, user = self._ctx(ctx)
        depth = min(max(int(request.depth), 1), MAX_LIST_DEPTH)
        root = resolve_path(request.path, user)
        out: list[pb.EntryInfo] = []
        try:
            level = [root]
            for _ in range(depth):
                nxt: list[str] = []
                for d in level:
                    try:
                        entries = await ch.list_dir(d, xattrs=METADATA_XATTR_PREFIX)
                    except NotFound:
                        if d == root:
                            raise
                        continue  # removed while listing
                    out.extend([await self._entry(ch, e) for e in entries])
                    nxt.extend(e.path for e in entries if e.type == "dir")
                level = nxt
        except PodbayError as exc:
            raise connect_error(exc) from exc
        return pb.ListDirResponse(entries=sorted(out, key=lambda e: e.path))

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any]) -> pb.RemoveResponse:
        """Remove a file or a directory with its contents; a path that does not exist is no error (envd)."""
        sandbox_id, ch, user = self._ctx(ctx)
        path = resolve_path(request.path, user)
        try:
            await ch.remove(path, recursive=True)
        except NotFound:
            pass
        except PodbayError as exc:
            raise connect_error(exc) from exc
        finally:
            self.note_change(sandbox_id, path)
        return pb.RemoveResponse()

    async def _open_watch(self, ch: GuestChannel, path: str, recursive: bool) -> DirWatch:
        watch = ch.watch(path, recursive=recursive)
        try:
            await watch.started()
        except BaseException:
            await watch.close()
            raise
        return watch

    async def watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any]
                        ) -> AsyncIterator[pb.WatchDirResponse]:
        """A start event once the watch is armed, then one event per change, keepalives in between; ends with
        DEADLINE_EXCEEDED when the request's ``Connect-Timeout-Ms`` passes."""
        _, ch, user = self._ctx(ctx)
        try:
            watch = await self._open_watch(ch, resolve_path(request.path, user), request.recursive)
        except PodbayError as exc:
            raise connect_error(exc) from exc
        it = watch.__aiter__()
        pending: asyncio.Future[Any] | None = None
        try:
            started: Oneof[Literal["start"], pb.WatchDirResponse.StartEvent] = Oneof(
                "start", pb.WatchDirResponse.StartEvent())
            yield pb.WatchDirResponse(event=started)
            while True:
                pending = pending or asyncio.ensure_future(it.__anext__())
                left = ctx.timeout_ms  # Connect-Timeout-Ms: the stream ends when it passes, as envd's does
                if left is not None and left <= 0:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the stream's deadline (Connect-Timeout-Ms) passed")
                wait_s = _KEEPALIVE_S if left is None else min(_KEEPALIVE_S, left / 1000.0)
                done, _ = await asyncio.wait({pending}, timeout=wait_s)
                if not done:
                    if left is None or left / 1000.0 > _KEEPALIVE_S:
                        alive: Oneof[Literal["keepalive"], pb.WatchDirResponse.KeepAlive] = Oneof(
                            "keepalive", pb.WatchDirResponse.KeepAlive())
                        yield pb.WatchDirResponse(event=alive)
                    continue
                try:
                    ev = pending.result()
                except StopAsyncIteration:
                    return
                except PodbayError as exc:
                    raise connect_error(exc) from exc
                finally:
                    pending = None
                changed: Oneof[Literal["filesystem"], pb.FilesystemEvent] = Oneof(
                    "filesystem", filesystem_event(ev, request.include_entry))
                yield pb.WatchDirResponse(event=changed)
        finally:
            if pending is not None:
                pending.cancel()
            await watch.close()

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
                             ) -> pb.CreateWatcherResponse:
        """Start a watch whose events are fetched with GetWatcherEvents."""
        sandbox_id, ch, user = self._ctx(ctx)
        root = resolve_path(request.path, user)
        try:
            watch = await self._open_watch(ch, root, request.recursive)
        except PodbayError as exc:
            raise connect_error(exc) from exc
        wid = "w_" + secrets.token_hex(12)
        w = _Watcher(sandbox_id, root, watch, request.include_entry)
        w.task = asyncio.create_task(self._collect(wid, w), name=f"envd-watcher-{wid}")
        self._watchers[wid] = w
        return pb.CreateWatcherResponse(watcher_id=wid)

    async def _collect(self, wid: str, w: _Watcher) -> None:
        """Buffer the watch's events; stop (and forget the watcher) once nobody fetched them for
        WATCHER_IDLE_S, so a client that went away leaves no scan running in the guest."""
        it = w.watch.__aiter__()
        try:
            while time.monotonic() - w.last_poll < WATCHER_IDLE_S:
                try:
                    ev = await asyncio.wait_for(it.__anext__(), _IDLE_CHECK_S)
                except TimeoutError:
                    continue
                except StopAsyncIteration:
                    w.error = ConnectError(Code.NOT_FOUND, "the watched directory went away")
                    break
                if len(w.events) >= MAX_BUFFERED_EVENTS:
                    w.error = ConnectError(Code.RESOURCE_EXHAUSTED, "too many unread watch events")
                    break
                w.events.append(filesystem_event(ev, w.include_entry))
                w.last_event = time.monotonic()
                w.arrived.set()
        except PodbayError as exc:
            w.error = connect_error(exc)
        finally:
            w.arrived.set()
            await w.watch.close()
        # Keep the outcome for the client's next fetch, but not forever.
        while time.monotonic() - w.last_poll < WATCHER_IDLE_S and wid in self._watchers:
            await asyncio.sleep(_IDLE_CHECK_S)
        if self._watchers.get(wid) is w:
            del self._watchers[wid]

    def _watcher(self, ctx: RequestContext[Any, Any], wid: str) -> _Watcher:
        sandbox_id, _, _ = self._ctx(ctx)
        w = self._watchers.get(wid)
        if w is None or w.sandbox_id != sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {wid} not found")
        return w

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
                                 ) -> pb.GetWatcherEventsResponse:
        """Events since the last call (after those of a change through envd just before: module docstring);
        the watcher's error once it stopped and every event was read."""
        w = self._watcher(ctx, request.watcher_id)
        w.last_poll = time.monotonic()
        await self._settle(w)
        w.last_poll = time.monotonic()
        events, w.events = w.events, []
        if not events and w.error is not None:
            self._watchers.pop(request.watcher_id, None)
            raise w.error
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
                             ) -> pb.RemoveWatcherResponse:
        """Stop a watcher."""
        w = self._watcher(ctx, request.watcher_id)
        self._watchers.pop(request.watcher_id, None)
        if w.task is not None:
            w.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w.task
        return pb.RemoveWatcherResponse()

    def watcher_ids(self) -> list[str]:
        """Ids of the polling watchers this node keeps."""
        return list(self._watchers)

    def close(self) -> None:
        """Stop every watcher (node shutdown)."""
        for w in self._watchers.values():
            if w.task is not None:
                w.task.cancel()
        self._watchers.clear()
