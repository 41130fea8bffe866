"""envd's plain HTTP API on a sandbox: ``GET /health``, ``GET /files`` (download) and ``POST /files``
(upload: ``multipart/form-data`` with one or more ``file`` parts, or the raw body as
``application/octet-stream``, optionally ``Content-Encoding: gzip``).

Query parameters: ``path`` (absolute, or relative to the user's home; for multipart, each part's file
name is the path when ``path`` is absent) and ``username`` (default ``user``); ``X-Metadata-<key>`` headers
become ``user.e2b.<key>`` extended attributes of each file written (E2B's file metadata, checked as envd checks
it: 400 ``invalid metadata: ...``), returned as each entry's ``metadata``. Uploads create missing parent
directories owned by the user and make the file the user's. Errors are ``{"code": <HTTP status>,
"message"}``: 404 missing, 400 bad request (a directory to download, no path), 409 exists, 502 sandbox
unreachable.

A file is written as envd writes it, as far as a watcher sees: the file is first opened in place (made when
missing) and given to the user (create, then chmod), then its content lands (write). The content itself still
goes to a temporary file renamed over the target (guestd's atomic write), so a reader never sees half of it.
"""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from podbay.channel.client import GuestChannel
from podbay.errors import InvalidRequest, PodbayError

from .filesystem import resolve_path
from .translate import DEFAULT_USER, file_metadata, http_error_status, metadata_xattrs, validate_metadata

__all__ = ["health", "download", "upload", "error_response", "UPLOAD_CHUNK_BYTES"]

UPLOAD_CHUNK_BYTES = 256 * 1024

ChannelFor = Callable[[Request], GuestChannel]
# Told the path of each file an upload wrote (or tried to), so polling watchers wait for its events.
Changed = Callable[[Request, str], None]


def error_response(status: int, message: str) -> JSONResponse:
    """envd's error body ``{"code", "message"}``."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _podbay_error(exc: PodbayError) -> JSONResponse:
    return error_response(http_error_status(exc), exc.message)


async def health(request: Request) -> Response:
    """204 while the node serves this sandbox's envd API."""
    return Response(status_code=204)


async def download(request: Request, channel_for: ChannelFor) -> Response:
    """The file's bytes (``application/octet-stream``), streamed from the guest."""
    try:
        ch = channel_for(request)
        user = request.query_params.get("username") or DEFAULT_USER
        path = resolve_path(request.query_params.get("path", ""), user)
        st = await ch.stat(path)
        if st.type == "dir":
            raise InvalidRequest(f"path '{path}' is a directory")
        chunks = ch.read_file(path).__aiter__()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
    except PodbayError as exc:
        return _podbay_error(exc)

    async def body() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for c in chunks:
            yield c

    headers = {"content-disposition": f'attachment; filename="{posixpath.basename(path)}"'}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


async def _gunzip(source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    dec = zlib.decompressobj(wbits=31)
    async for chunk in source:
        out = dec.decompress(chunk)
        if out:
            yield out
    tail = dec.flush()
    if tail:
        yield tail


async def _upload_chunks(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(UPLOAD_CHUNK_BYTES):
        yield chunk


async def _write(ch: GuestChannel, path: str, data: AsyncIterator[bytes], user: str,
                 xattrs: dict[str, str]) -> dict[str, Any]:
    """Write one file as ``user`` (its parent exists), with E2B's metadata as ``user.e2b.*`` extended
    attributes -> the upload answer's entry ``{"name", "type": "file", "path"[, "metadata"]}`` (metadata as
    the file holds it after the write; an overwrite without metadata drops the old file's)."""
    # Opened in place and given to the user first (an empty append: create when missing, then chown),
    # as envd's O_CREAT + chown, so a watcher sees create, chmod, write as it does with envd.
    await ch.write_file(path, b"", append=True, user=user)
    st = await ch.write_file(path, data, user=user, xattrs=xattrs or None)
    entry: dict[str, Any] = {"name": posixpath.basename(path), "type": "file", "path": path}
    metadata = file_metadata(st.get("xattrs"))
    if metadata:
        entry["metadata"] = metadata
    return entry


async def upload(request: Request, channel_for: ChannelFor, changed: Changed | None = None) -> Response:
    """Write the uploaded file(s); answers ``[{"name", "type": "file", "path"[, "metadata"]}]``."""
    touched: list[str] = []
    try:
        ch = channel_for(request)
        user = request.query_params.get("username") or DEFAULT_USER
        ctype = request.headers.get("content-type", "")
        xattrs = metadata_xattrs(request.headers)  # X-Metadata-<key>: the same for every file of the upload
        validate_metadata(xattrs)
        written: list[dict[str, Any]] = []
        if ctype.startswith("multipart/form-data"):
            form = await request.form(max_part_size=64 << 20)
            parts = [p for p in form.getlist("file") if isinstance(p, UploadFile)]
            if not parts:
                raise InvalidRequest("no 'file' part in the upload")
            for part in parts:
                name = request.query_params.get("path") if len(parts) == 1 else None
                path = resolve_path(name or part.filename or "", user)
                touched.append(path)
                await ch.mkdir(posixpath.dirname(path), parents=True, exist_ok=True, user=user)
                written.append(await _write(ch, path, _upload_chunks(part), user, xattrs))
            await form.close()
        else:
            path = resolve_path(request.query_params.get("path", ""), user)
            source: AsyncIterator[bytes] = request.stream()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                source = _gunzip(source)
            touched.append(path)
            await ch.mkdir(posixpath.dirname(path), parents=True, exist_ok=True, user=user)
            written.append(await _write(ch, path, source, user, xattrs))
    except PodbayError as exc:
        return _podbay_error(exc)
    except zlib.error as exc:
        return error_response(400, f"bad gzip body: {exc}")
    finally:
        if changed is not None and touched:
            for p in touched:
                changed(request, p)
    return JSONResponse(written)
