"""Files on the guest channel (docs/channel.md): read and write in chunks, stat, list, mkdir, move, remove.

    async for chunk in ch.read_file("/etc/hostname"): ...
    await ch.write_file("/tmp/x", b"data", mode=0o600)            # FileStat as a dict
    [e.name for e in await ch.list_dir("/tmp")]

Errors as for every request (``podbay.channel.transport``): NotFound, InvalidRequest (is_a_directory,
not_a_directory), Conflict (exists), GuestError, Timeout, ChannelClosed; a write the guest refuses is
NotWritable (403 ``not_writable``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from pydantic import ValidationError

from podbay.channel import frames
from podbay.channel.frames import FrameType
from podbay.channel.transport import ChannelClosed, Transport, validate
from podbay.contracts.channel import (
    FileStat,
    ListResult,
    MkdirRequest,
    MoveRequest,
    Op,
    ReadResult,
    RemoveRequest,
    RemoveResult,
)
from podbay.errors import GuestError, NotFound, NotWritable, PermissionDenied, PodbayError

__all__ = ["FileOps"]

_LIST_LIMIT_BYTES = 64 * 1024 * 1024


class FileOps(Transport):
    """File operations."""

    async def read_file(self, path: str, *, offset: int = 0, length: int | None = None) -> AsyncIterator[bytes]:
        """Stream a file's bytes in chunks (at most 64 KiB each). Raises NotFound, InvalidRequest
        (is_a_directory), PermissionDenied, GuestError (io_error, ...) or Timeout when the guest stalls for
        ``request_timeout_s``."""
        stream = self.open_stream(Op.READ, {"path": path, "offset": offset, "length": length})
        try:
            while True:
                frame = await self.next_frame(stream, self.request_timeout_s)
                if frame.type is FrameType.RESULT:
                    validate(ReadResult, frame.payload, "read result")
                    return
                if frame.type is FrameType.DATA:
                    self.consumed(stream, len(frame.payload) - 1)
                    yield frame.payload[1:]
        finally:
            if not stream.ended:
                self.cancel_stream(stream)
                self.end_stream(stream, ChannelClosed("read abandoned"))

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        mode: int = 0o644,
        *,
        append: bool = False,
        user: str | int | None = None,
        parents: bool = False,
        xattrs: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Write a file atomically (temp file + rename; ``append`` writes in place) -> FileStat dict.
        With ``parents`` the guest first makes missing parent directories (a guest older than that option
        ignores it). Raises NotFound (missing parent), InvalidRequest (is_a_directory, not_a_directory, an
        existing path that is not a regular file), NotWritable (permission denied, read-only file system, or
        an existing file whose directory takes no new files: ``/proc``, ``/sys``), GuestError, Timeout."""
        try:
            return await self._write_file(path, data, mode, append=append, user=user, parents=parents,
                                          xattrs=xattrs)
        except NotFound as exc:
            # guestd writes a temp file beside the target, then renames it. On /proc and /sys the temp file
            # cannot be made (ENOENT: those directories take no new names), so "not found" comes back for a
            # file that is there. Only a stat tells the two apart; it runs on this error path alone.
            try:
                await self.stat(path)
            except PodbayError:
                raise exc from None
            raise NotWritable(f"{path} is not writable: its file system takes no new files there (a pseudo "
                              "file system such as /proc or /sys)",
                              details={"path": path, "guest_code": "permission_denied"}) from exc
        except PermissionDenied as exc:
            raise NotWritable(f"{path} is not writable: {exc.message}",
                              details={"path": path, "guest_code": "permission_denied"}) from exc

    async def _write_file(self, path: str, data: bytes | AsyncIterable[bytes], mode: int, *, append: bool,
                          user: str | int | None, parents: bool, xattrs: dict[str, str] | None) -> dict[str, Any]:
        args: dict[str, Any] = {"path": path, "mode": mode, "append": append}
        if parents:
            args["parents"] = True
        if xattrs:
            args["xattrs"] = xattrs  # user.* names; the answer then carries the file's user.* attributes
        if user is not None:
            args["user"] = user
        stream = self.open_stream(Op.WRITE, args)
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                await self.send_data(stream, frames.FD_FILE, bytes(data), self.request_timeout_s)
            else:
                source = aiter(data)
                while (chunk := await self.next_chunk(stream, source)) is not None:
                    await self.send_data(stream, frames.FD_FILE, bytes(chunk), self.request_timeout_s)
            if not stream.ended:
                self.send(frames.encode_eof(stream.id, frames.FD_FILE))
            frame = await self.finish(stream, self.request_timeout_s)
        except BaseException:
            if not stream.ended:
                self.cancel_stream(stream)
                self.end_stream(stream, ChannelClosed("write abandoned"))
            raise
        return validate(FileStat, frame.payload, "write result").model_dump()

    async def stat(self, path: str, xattrs: str | None = None) -> FileStat:
        """Metadata of ``path`` (symlinks not followed; with ``xattrs``, the extended attributes whose names
        start with that prefix). Raises NotFound."""
        return await self.unary(Op.STAT, {"path": path, **({"xattrs": xattrs} if xattrs is not None else {})},
                                FileStat)

    async def list_dir(self, path: str, xattrs: str | None = None) -> list[FileStat]:
        """The entries of a directory, one level, sorted by name (``xattrs`` as for ``stat``). Raises
        NotFound, InvalidRequest (not_a_directory), GuestError."""
        stream = self.open_stream(Op.LIST, {"path": path, **({"xattrs": xattrs} if xattrs is not None else {})})
        lines: list[bytes] = []
        total = 0
        tail = b""
        while True:
            frame = await self.next_frame(stream, self.request_timeout_s)
            if frame.type is FrameType.DATA:
                total += len(frame.payload)
                if total > _LIST_LIMIT_BYTES:
                    self.violation(stream, "directory listing too large")
                    raise GuestError("directory listing too large")
                self.consumed(stream, len(frame.payload) - 1)
                parts = (tail + frame.payload[1:]).split(b"\n")
                tail = parts.pop()
                lines.extend(parts)
            elif frame.type is FrameType.RESULT:
                result = validate(ListResult, frame.payload, "list result")
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
        return await self.unary(Op.MKDIR, req.model_dump(exclude_none=True), FileStat)

    async def move(self, source: str, destination: str) -> FileStat:
        """Rename ``source`` to ``destination`` (rename(2)) -> FileStat of the destination. Raises
        NotFound (source or destination parent), InvalidRequest (non-empty directory in the way, ...)."""
        req = MoveRequest(source=source, destination=destination)
        return await self.unary(Op.MOVE, req.model_dump(), FileStat)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, link or directory (``recursive`` for a non-empty one). Raises NotFound."""
        await self.unary(Op.REMOVE, RemoveRequest(path=path, recursive=recursive).model_dump(), RemoveResult)
