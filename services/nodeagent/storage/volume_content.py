"""A volume's files without a sandbox: the node side of E2B's volume content API (the API's
services/api/e2b/volumes.py proxies ``/e2b/volumecontent/{volumeID}/...`` here with a ``volume`` grant).

    GET    /internal/v1/volumes/{id}/content/path?path=         200 entry                 404
    PATCH  /internal/v1/volumes/{id}/content/path?path=         200 entry ({uid,gid,mode}) 404, 400
    DELETE /internal/v1/volumes/{id}/content/path?path=         204 (the tree under it)    404, 400 for /
    GET    /internal/v1/volumes/{id}/content/dir?path=&depth=   200 [entry] (depth 1..10)  404, 400
    POST   /internal/v1/volumes/{id}/content/dir?path=&uid=&gid=&mode=&force=   201 entry  404, 409
    GET    /internal/v1/volumes/{id}/content/file?path=         200 the bytes              404, 400
    PUT    /internal/v1/volumes/{id}/content/file?path=&uid=&gid=&mode=&force=  201 entry  404, 409

An entry is E2B's ``VolumeEntryStat`` (spec/openapi-volumecontent.yml in E2B's repository): ``name``,
``type`` (``file``, ``directory``, ``symlink``, ``unknown``; a symlink is not followed), ``path`` (inside the
volume, from ``/``), ``size``, ``mode`` (permission bits), ``uid``, ``gid``, ``atime``, ``mtime``, ``ctime``
(RFC 3339) and ``target`` for a symlink. As E2B's volume service: a new directory is ``0o777`` and a new file
``0o666`` unless ``mode`` says otherwise; ``force`` makes missing parents (and lets a file be overwritten;
without it an existing file is 409); ``uid``/``gid`` default to 1000, the sandbox's ``user`` in podbay's
templates (E2B's default owner is its own sandbox user's id).

The volume's file (an ext4 filesystem, services/nodeagent/storage/volumes.py) is loop-mounted on the node for the
call (``nodev,nosuid,noexec,noatime``; read-write for reads too, so a journal left by a killed guest is
replayed) and unmounted after, under the volume's lock, which
:meth:`VolumeStore.attach` takes too: a VM never gets the file while it is mounted here, and a file that a
VM directory holds (a hard link: ``st_nlink > 1``) is refused with 409 (the API refuses first, from the
attachments in the database). Every path is resolved inside the mounted volume with ``openat2(2)``
``RESOLVE_IN_ROOT`` (services/nodeagent/build/rootfs.py ``Root``): ``..`` stops at the volume's top and a
symlink, whatever it holds (``/etc``, ``../../..``), resolves inside the volume; the last component of a path
that is changed (removed, chowned, replaced) is never followed. Errors are podbay errors (InvalidRequest 400,
NotFound 404, Conflict 409, VolumeError 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import posixpath
import stat
import subprocess
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from podbay.errors import Conflict, InvalidRequest, NotFound

from ..build.rootfs import Root, guest_path
from .volumes import VolumeError, VolumeStore

__all__ = ["add_volume_content_routes", "mounted", "entry", "list_dir", "DEFAULT_OWNER", "MAX_DEPTH"]

log = logging.getLogger("podbay.nodeagent.volume_content")

DEFAULT_OWNER = 1000
DEFAULT_DIR_MODE = 0o777
DEFAULT_FILE_MODE = 0o666
MAX_DEPTH = 10
_CHUNK = 256 * 1024
_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink"}


class PathUpdate(BaseModel):
    """The body of PATCH ``path``: what to change (each optional)."""

    uid: int | None = Field(None, ge=0, le=0xFFFFFFFF)
    gid: int | None = Field(None, ge=0, le=0xFFFFFFFF)
    mode: int | None = Field(None, ge=0, le=0o7777)


def _clean(path: str) -> str:
    """The volume path ``path`` normalised from ``/`` (``..`` cannot climb out); InvalidRequest for an empty
    one or one with a NUL byte."""
    if not path or "\0" in path:
        raise InvalidRequest("path must be a non-empty string without NUL bytes")
    return guest_path(path)


def _time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _entry_of(path: str, st: os.stat_result, target: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": posixpath.basename(path) or "/", "type": _TYPES.get(stat.S_IFMT(st.st_mode), "unknown"),
        "path": path, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
        "atime": _time(st.st_atime), "mtime": _time(st.st_mtime), "ctime": _time(st.st_ctime)}
    if target is not None:
        out["target"] = target
    return out


def entry(root: Root, path: str) -> dict[str, Any]:
    """The entry of volume path ``path`` (its last component not followed); NotFound."""
    st = root.lstat(path)
    if st is None:
        raise NotFound(f"path {path!r} was not found in the volume")
    target = None
    if stat.S_ISLNK(st.st_mode):
        pfd, name = root.parent(path)
        try:
            target = os.readlink(name, dir_fd=pfd)
        finally:
            os.close(pfd)
    return _entry_of(path, st, target)


def list_dir(root: Root, path: str, depth: int) -> list[dict[str, Any]]:
    """The entries under directory ``path``, ``depth`` levels down (directories followed only when they are
    directories themselves, never through a symlink), in name order per directory; NotFound, InvalidRequest
    for a file."""
    st = root.stat(path)
    if st is None:
        raise NotFound(f"path {path!r} was not found in the volume")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidRequest(f"path {path!r} is not a directory")
    out: list[dict[str, Any]] = []

    def walk(d: str, left: int) -> None:
        try:
            fd = root.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return  # removed while listing
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
        for name in names:
            child = posixpath.join(d, name)
            try:
                e = entry(root, child)
            except NotFound:
                continue
            out.append(e)
            if left > 1 and e["type"] == "directory":
                walk(child, left - 1)

    walk(path, depth)
    return out


def _oserror(exc: OSError, path: str) -> Exception:
    if exc.errno in (errno.ENOENT,):
        return NotFound(f"path {path!r} was not found in the volume")
    if exc.errno == errno.EEXIST:
        return Conflict(f"path {path!r} already exists in the volume")
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EXDEV, errno.EINVAL, errno.ENOTEMPTY):
        return InvalidRequest(f"path {path!r}: {os.strerror(exc.errno)}")
    if exc.errno == errno.ENOSPC:
        return Conflict("the volume is full")
    return VolumeError(f"path {path!r}: {exc.strerror or exc}")


def _make_dirs(root: Root, path: str, uid: int, gid: int, mode: int) -> None:
    """Missing directories up to ``path`` made with ``mode`` and owner (existing ones left as they are)."""
    cur = "/"
    for part in [p for p in path.strip("/").split("/") if p]:
        nxt = posixpath.join(cur, part)
        if root.lstat(nxt) is None:
            fd = root.open(cur, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=fd)
                    os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                    os.chmod(part, mode, dir_fd=fd)
            finally:
                os.close(fd)
        cur = nxt
        os.close(root.open(cur, os.O_PATH | os.O_DIRECTORY))  # a directory (or a link to one inside)


def make_dir(root: Root, path: str, uid: int, gid: int, mode: int, force: bool) -> dict[str, Any]:
    """Directory ``path`` made (owner, ``mode`` exactly, not the umask's); with ``force`` its parents too,
    and an existing directory is no error. Conflict when it exists (without ``force``) or is not a
    directory; NotFound for a missing parent without ``force``."""
    if path == "/":
        return entry(root, path)
    if force:
        _make_dirs(root, posixpath.dirname(path), uid, gid, DEFAULT_DIR_MODE)
    pfd, name = root.parent(path)
    try:
        try:
            os.mkdir(name, mode, dir_fd=pfd)
        except FileExistsError:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if not (force and stat.S_ISDIR(st.st_mode)):
                raise
        else:
            os.chown(name, uid, gid, dir_fd=pfd, follow_symlinks=False)
            os.chmod(name, mode, dir_fd=pfd)
    finally:
        os.close(pfd)
    return entry(root, path)


def open_for_write(root: Root, path: str, uid: int, gid: int, mode: int, force: bool) -> int:
    """A descriptor to write file ``path`` (made, owner and ``mode`` set): without ``force`` it must not exist
    (Conflict); with ``force`` missing parents are made and an existing file is truncated, a symlink or
    anything else in its place is refused (never written through)."""
    if path == "/":
        raise InvalidRequest("the volume's root is a directory")
    if force:
        _make_dirs(root, posixpath.dirname(path), uid, gid, DEFAULT_DIR_MODE)
    pfd, name = root.parent(path)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(name, flags | (os.O_TRUNC if force else os.O_EXCL), mode, dir_fd=pfd)
    finally:
        os.close(pfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidRequest(f"path {path!r} is not a regular file")
        os.set_blocking(fd, True)
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def update(root: Root, path: str, change: PathUpdate) -> dict[str, Any]:
    """``chmod`` and/or ``chown`` of ``path`` itself (a symlink's own owner; its mode is left alone)."""
    st = root.lstat(path)
    if st is None:
        raise NotFound(f"path {path!r} was not found in the volume")
    if change.mode is not None:
        root.chmod(path, change.mode)
    if change.uid is not None or change.gid is not None:
        root.chown(path, st.st_uid if change.uid is None else change.uid,
                   st.st_gid if change.gid is None else change.gid)
    return entry(root, path)


def remove(root: Root, path: str) -> None:
    """``path`` removed (a directory with everything in it, a symlink itself); NotFound, InvalidRequest for
    the volume's root."""
    if path == "/":
        raise InvalidRequest("cannot delete the volume's root")
    if not root.remove(path):
        raise NotFound(f"path {path!r} was not found in the volume")


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VolumeError(f"{argv[0]} failed: {(proc.stderr or proc.stdout).strip()[:300]}")


@contextlib.asynccontextmanager
async def mounted(volumes: VolumeStore, volume_id: str, mount_root: Path) -> AsyncIterator[Root]:
    """The volume's filesystem mounted on this node and opened as a :class:`Root`, for the duration, under the
    volume's lock (module docstring). Its file is made or fetched here first when it is not yet
    (:meth:`VolumeStore.prepare_volume`). Conflict while a VM holds it; VolumeError when it cannot be mounted."""
    async with volumes.lock(volume_id):
        await volumes.prepare_volume(volume_id)
        src = volumes.path(volume_id)
        if src.stat().st_nlink > 1:
            raise Conflict(f"volume {volume_id} is attached to a sandbox on this node; use that sandbox's files")
        point = mount_root / volume_id
        point.mkdir(parents=True, exist_ok=True, mode=0o700)
        if os.path.ismount(point):  # left by a node agent that stopped mid-call
            await asyncio.to_thread(_run, ["umount", "-l", str(point)])
        # Read-write even to read: a volume a VM stopped using may have a journal to replay (a killed guest
        # does not unmount), which a read-only mount refuses and ``noload`` would skip (stale files).
        opts = "loop,nodev,nosuid,noexec,noatime"
        await asyncio.to_thread(_run, ["mount", "-t", "ext4", "-o", opts, str(src), str(point)])
        try:
            with Root(point) as root:
                yield root
        finally:
            # umount writes everything back to the volume's file before it returns.
            await asyncio.to_thread(_run, ["umount", str(point)])


def _entry_response(body: dict[str, Any], status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def add_volume_content_routes(app: FastAPI, volumes: VolumeStore, mount_root: Path) -> None:
    """The routes of the module docstring on the node's data-plane ``app`` (behind its grant check)."""
    base = "/internal/v1/volumes/{volume_id}/content"

    async def in_volume(volume_id: str, fn: Any, *args: Any) -> Any:
        async with mounted(volumes, volume_id, mount_root) as root:
            try:
                return await asyncio.to_thread(fn, root, *args)
            except OSError as exc:
                raise _oserror(exc, str(args[0]) if args else "/") from exc

    @app.get(base + "/path")
    async def get_path(volume_id: str, path: str = Query(...)) -> JSONResponse:
        return _entry_response(await in_volume(volume_id, entry, _clean(path)))

    @app.patch(base + "/path")
    async def patch_path(volume_id: str, body: PathUpdate, path: str = Query(...)) -> JSONResponse:
        return _entry_response(await in_volume(volume_id, update, _clean(path), body))

    @app.delete(base + "/path", status_code=204)
    async def delete_path(volume_id: str, path: str = Query(...)) -> Response:
        await in_volume(volume_id, remove, _clean(path))
        return Response(status_code=204)

    @app.get(base + "/dir")
    async def get_dir(volume_id: str, path: str = Query(...), depth: int = Query(1)) -> JSONResponse:
        if not 0 <= depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth must be between 1 and {MAX_DEPTH}")
        return JSONResponse(await in_volume(volume_id, list_dir, _clean(path), max(depth, 1)))

    @app.post(base + "/dir", status_code=201)
    async def post_dir(volume_id: str, path: str = Query(...), uid: int = Query(DEFAULT_OWNER, ge=0),
                       gid: int = Query(DEFAULT_OWNER, ge=0), mode: int = Query(DEFAULT_DIR_MODE, ge=0, le=0o7777),
                       force: bool = Query(False)) -> JSONResponse:
        return _entry_response(await in_volume(volume_id, make_dir, _clean(path), uid, gid, mode, force), 201)

    @app.get(base + "/file")
    async def get_file(volume_id: str, path: str = Query(...)) -> Response:
        clean = _clean(path)
        ctx = mounted(volumes, volume_id, mount_root)
        root = await ctx.__aenter__()
        try:
            try:
                fd = await asyncio.to_thread(root.open, clean, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                raise _oserror(exc, clean) from exc
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise InvalidRequest(f"path {clean!r} is not a regular file")
            os.set_blocking(fd, True)
        except BaseException as exc:
            await ctx.__aexit__(type(exc), exc, exc.__traceback__)
            raise

        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                os.close(fd)
                await ctx.__aexit__(None, None, None)

        async def body() -> AsyncIterator[bytes]:
            # The mount (and the volume's lock) lasts until the last byte is sent or the caller goes away.
            try:
                while chunk := await asyncio.to_thread(os.read, fd, _CHUNK):
                    yield chunk
            finally:
                await release()

        # The background task also releases it when the body was never started (the caller left first).
        return StreamingResponse(body(), media_type="application/octet-stream", background=BackgroundTask(release),
                                 headers={"content-length": str(st.st_size)})

    @app.put(base + "/file", status_code=201)
    async def put_file(volume_id: str, request: Request, path: str = Query(...),
                       uid: int = Query(DEFAULT_OWNER, ge=0), gid: int = Query(DEFAULT_OWNER, ge=0),
                       mode: int = Query(DEFAULT_FILE_MODE, ge=0, le=0o7777), force: bool = Query(False)) -> JSONResponse:
        clean = _clean(path)
        async with mounted(volumes, volume_id, mount_root) as root:
            try:
                fd = await asyncio.to_thread(open_for_write, root, clean, uid, gid, mode, force)
            except OSError as exc:
                raise _oserror(exc, clean) from exc
            try:
                async for chunk in request.stream():
                    view = memoryview(chunk)
                    while view:
                        view = view[await asyncio.to_thread(os.write, fd, view):]
            except OSError as exc:
                raise _oserror(exc, clean) from exc
            finally:
                os.close(fd)
            return _entry_response(await asyncio.to_thread(entry, root, clean), 201)
