"""The node's data plane: exec and files for the sandboxes on this node, over their guest channels.

Served on ``node_host:node_port`` under ``/internal/v1/sandboxes/{id}/...`` with the same bodies as the
public API (``podbay.contracts.api``), which proxies to it. Every call must carry the API's grant for its
sandbox and kind of operation (``x-podbay-grant``, checked by :mod:`.grant_check`, 403 ``grant_refused``
otherwise); the grant's generation is the one the call acts on: a call for another generation is refused with
409 ``stale_generation`` (docs/DESIGN.md §4, generation fencing).
"""

from __future__ import annotations

import codecs
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from podbay.contracts.api import ExecEvent, ExecRequest, ExecResult, FileInfo, FileList, SnapshotDiff
from podbay.contracts.channel import ExecSpec
from podbay.errors import PodbayError
from podbay.health import consumer_check, mount_check, nats_check, pg_check
from podbay.grants import GrantVerifier
from podbay.httpmetrics import RequestMetrics
from podbay.service import readyz_route
from podbay.telemetry import HOP_SECONDS

from ..build.defaults import ExecDefaults, apply as apply_defaults
from ..build.http import add_build_routes
from ..computer.computer import add_computer_routes
from ..computer.computer_fill import add_fill_route
from ..storage.diff import diff_snapshots
from ..envd import PREFIX as ENVD_PREFIX
from ..envd import EnvdApp
from .grant_check import GrantCheck
from ..ops.apiwork import ApiWork
from ..net.ports import PortsProxy, listening_ports
from ..storage.volume_content import add_volume_content_routes

if TYPE_CHECKING:
    from ..ops.sandboxes import SandboxManager

__all__ = ["create_dataplane_app"]

log = logging.getLogger("podbay.nodeagent.dataplane")

MAX_CAPTURE_BYTES = 16 << 20


def _file_info(path: str, st: Any) -> FileInfo:
    d = st if isinstance(st, dict) else st.model_dump()
    return FileInfo(path=d.get("path", path), name=d.get("name") or path.rstrip("/").rsplit("/", 1)[-1] or "/",
                    type=d.get("type", "other"), size=int(d.get("size", 0)), mode=int(d.get("mode", 0)),
                    mtime=float(d.get("mtime", 0.0)))


def _spec(body: ExecRequest, default_timeout_s: float) -> ExecSpec:
    return ExecSpec(argv=body.argv, shell=body.shell, env=body.env, cwd=body.cwd, user=body.user,
                    timeout_s=body.timeout_s or default_timeout_s, stdin=body.stdin is not None)


def create_dataplane_app(manager: SandboxManager) -> FastAPI:
    """The data-plane app for ``manager``'s sandboxes, plus ``/healthz`` and ``/metrics``."""
    app = FastAPI(title="podbay node data plane", docs_url=None, redoc_url=None, openapi_url=None)
    settings = manager.settings

    @app.exception_handler(PodbayError)
    async def _err(_: Request, exc: PodbayError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.http_status)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        # The API (its client) hung up mid-upload: an ordinary event, not a fault of the node. The guest's
        # write is atomic (a temp file renamed at the end), so nothing half-written is left.
        log.info("a caller hung up during its request")
        return JSONResponse({"error": {"code": "client_disconnected", "message": "client disconnected"}},
                            status_code=400)

    # Plain ASGI (podbay.httpmetrics), not ``@app.middleware("http")``: every exec and file call passes here
    # after the API, and Starlette's per-request task and stream hand-off cost about a millisecond each.
    app.add_middleware(RequestMetrics, service="nodeagent")

    def _gen(request: Request) -> int | None:
        g = request.headers.get("x-podbay-generation")
        return int(g) if g and g.isdigit() else None

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"service": "nodeagent", "ok": manager.ready, "node_id": settings.node_id,
                "sandboxes": len(manager.vms), "accel": manager.accel}

    async def agent_ready() -> str | None:
        return None if manager.ready else "starting or stopping"

    readyz_route(app, "nodeagent", {
        "agent": agent_ready, "store": mount_check(manager.store.root), "nats": nats_check(manager.bus),
        "postgres": pg_check(manager.pool), "consumer": consumer_check(lambda: manager.command_sub)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    add_build_routes(app, manager)
    # E2B's volume content API: a volume's files without a sandbox (mounted under the store, 0700).
    add_volume_content_routes(app, manager.volumes, manager.store.root / "volume-mounts")
    defaults = ExecDefaults(manager)
    filler = add_fill_route(app, manager, add_computer_routes(app, manager, defaults))
    base = "/internal/v1/sandboxes/{sandbox_id}"

    @app.post(base + "/exec")
    async def exec_(sandbox_id: str, body: ExecRequest, request: Request) -> ExecResult:
        ch = manager.channel(sandbox_id, _gen(request))
        body = apply_defaults(body, await defaults.get(sandbox_id))
        t = time.perf_counter()
        stdin = body.stdin.encode() if body.stdin is not None else None
        out, err, ex = await ch.run(_spec(body, settings.exec_timeout_s), stdin=stdin,
                                    max_output_bytes=MAX_CAPTURE_BYTES)
        dt = time.perf_counter() - t
        HOP_SECONDS.labels("nodeagent", "guest_exec").observe(dt)
        return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                          exit_code=ex.exit_code, duration_ms=dt * 1000, timed_out=ex.timed_out,
                          output_truncated=ex.output_truncated)

    @app.post(base + "/exec/stream")
    async def exec_stream(sandbox_id: str, body: ExecRequest, request: Request) -> StreamingResponse:
        ch = manager.channel(sandbox_id, _gen(request))
        body = apply_defaults(body, await defaults.get(sandbox_id))
        proc = ch.exec(_spec(body, settings.exec_timeout_s))
        # Wait for the guest's start report before answering, so a bad cwd or user is an HTTP error.
        try:
            pid = await proc.started()
        except BaseException:
            await proc.__aexit__(None, None, None)
            raise

        async def lines() -> AsyncIterator[bytes]:
            async with proc:
                yield (ExecEvent(type="start", pid=pid).model_dump_json(exclude_none=True) + "\n").encode()
                # Chunks split multi-byte characters; an incremental decoder per stream keeps valid UTF-8 intact.
                decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in ("stdout", "stderr")}
                try:
                    if body.stdin is not None:
                        await proc.write_stdin(body.stdin.encode())
                        await proc.close_stdin()
                    async for kind, data in proc:
                        text = decoders[kind].decode(data)
                        if text:
                            yield (ExecEvent(type=kind, data=text).model_dump_json(exclude_none=True) + "\n").encode()
                    for kind, dec in decoders.items():
                        tail = dec.decode(b"", final=True)
                        if tail:
                            yield (ExecEvent(type=kind, data=tail).model_dump_json(exclude_none=True) + "\n").encode()
                    ex = await proc.wait()
                    yield (ExecEvent(type="exit", exit_code=ex.exit_code, timed_out=ex.timed_out)
                           .model_dump_json(exclude_none=True) + "\n").encode()
                except PodbayError as exc:
                    yield (json.dumps({"type": "error", "error": {"code": exc.code, "message": exc.message}})
                           + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get(base + "/files")
    async def read_file(sandbox_id: str, request: Request, path: str = Query(...)) -> Response:
        ch = manager.channel(sandbox_id, _gen(request))
        st = _file_info(path, await ch.stat(path))
        if st.type == "dir":
            from podbay.errors import InvalidRequest

            raise InvalidRequest(f"{path} is a directory", details={"path": path})
        if st.type == "other":
            # A device, FIFO or socket has no end (/dev/zero, /dev/urandom): its read would stream until the
            # client ran out of memory. A symlink is read as its target, which the guest opens.
            from podbay.errors import InvalidRequest

            raise InvalidRequest(f"{path} is not a regular file (a device, FIFO or socket): only files are read",
                                 details={"path": path})
        chunks = ch.read_file(path).__aiter__()
        # Read the first chunk before answering so that a missing file is a 404, not a broken 200.
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""

        async def rest() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for c in chunks:
                yield c

        return StreamingResponse(rest(), media_type="application/octet-stream",
                                 headers={"x-podbay-file-size": str(st.size)})

    @app.put(base + "/files")
    async def write_file(sandbox_id: str, request: Request, path: str = Query(...),
                         mode: str = Query("0644")) -> FileInfo:
        ch = manager.channel(sandbox_id, _gen(request))
        # Missing parent directories are made, as E2B's files API does.
        res = await ch.write_file(path, request.stream(), mode=int(mode, 8), parents=True)
        return _file_info(path, res)

    @app.delete(base + "/files", status_code=204)
    async def remove(sandbox_id: str, request: Request, path: str = Query(...), recursive: bool = False) -> Response:
        ch = manager.channel(sandbox_id, _gen(request))
        await ch.remove(path, recursive=recursive)
        return Response(status_code=204)

    @app.get(base + "/files/stat")
    async def stat(sandbox_id: str, request: Request, path: str = Query(...)) -> FileInfo:
        ch = manager.channel(sandbox_id, _gen(request))
        return _file_info(path, await ch.stat(path))

    @app.get(base + "/files/list")
    async def list_dir(sandbox_id: str, request: Request, path: str = Query(...)) -> FileList:
        ch = manager.channel(sandbox_id, _gen(request))
        entries = await ch.list_dir(path)
        return FileList(entries=[_file_info(getattr(e, "path", None) or path, e) for e in entries])

    @app.post(base + "/files/mkdir")
    async def mkdir(sandbox_id: str, request: Request, path: str = Query(...), parents: bool = True) -> FileInfo:
        ch = manager.channel(sandbox_id, _gen(request))
        res = await ch.mkdir(path, parents=parents)
        return _file_info(path, res if res else await ch.stat(path))

    # E2B's in-sandbox API (envd), behind the same token check and generation fencing.
    app.state.envd = EnvdApp(manager, defaults)
    app.mount(ENVD_PREFIX, app.state.envd)

    @app.get(base + "/ports")
    async def ports(sandbox_id: str, request: Request) -> dict[str, object]:
        """``{"ports": [{port, address, family}]}``: the guest's listening TCP sockets (services/nodeagent/net/ports.py)."""
        return {"ports": await listening_ports(manager.channel(sandbox_id, _gen(request)))}

    @app.get(base + "/snapshots/{snapshot_a}/diff/{snapshot_b}")
    async def snapshot_diff(sandbox_id: str, snapshot_a: str, snapshot_b: str) -> SnapshotDiff:
        # Snapshots are immutable files on the node and need no VM: no generation fencing here (the API
        # has checked that both are ready snapshots of this sandbox).
        return await diff_snapshots(manager.store, sandbox_id, snapshot_a, snapshot_b)

    # Guest ports (the API edge's last hop): ahead of the app's middleware, so nothing buffers or wraps its streams.
    app.add_middleware(PortsProxy, manager=manager, relay_filter=filler.relay_filter)
    # Calls in flight, which the snapshot cadence yields to (services/nodeagent/ops/apiwork.py).
    app.add_middleware(ApiWork)
    # Outermost: no request reaches a route, the envd app or the ports proxy without the API's grant for it.
    app.add_middleware(GrantCheck, verifier=GrantVerifier(settings.grant_verify_key),
                       internal_token=settings.internal_token, metrics_token=settings.metrics_token)
    return app
