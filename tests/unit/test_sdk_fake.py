"""A small fake of the podbay HTTP API, served by uvicorn on a free loopback port, for SDK and CLI tests.

It keeps sandboxes and files in memory, logs every request (method, path, query, headers, body, client
port) and runs a few fake commands:

- ``["echo", *words]`` prints the words; a shell string ``s`` prints ``sh:s``;
- ``["cat"]`` prints its stdin; ``["env"]`` prints ``K=V`` lines; ``["err", msg]`` writes msg to stderr;
- ``["exit", n]`` exits with ``n``; ``["killed"]`` exits with -9; ``["hang"]`` times out (exit -9);
- streaming only: ``["gated"]`` writes ``first``, waits for ``FakeApi.gate`` (set by the test), then
  writes ``second``; ``["fail"]`` sends an ``error`` event; ``["cut"]`` ends without ``exit``; a program
  under ``/no/such/`` sends guestd's ``not_found`` error for a missing program.

Special sandbox ids: ``plain-404`` answers a non-JSON 404; ``sb-paused`` refuses exec with 409;
``sb-slow`` answers a waiting delete with 202 (the server's wait ran out).
The fixtures ``fake_api`` (the running fake) and ``clean_env`` are imported by the other test modules.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime, UTC
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from podbay.contracts.api import ExecRequest, FileInfo, PoolInfo, PoolNode, PoolSet, SandboxCreate, SandboxInfo
from podbay.dockerfile import parse_dockerfile
from podbay.errors import InvalidState, NoCapacity, NotFound, PodbayError, Unauthorized

API_KEY = "pb_test_key"
GATE_WAIT_S = 20.0


@dataclass
class Logged:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    client_port: int

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeApi:
    url: str = ""
    requests: list[Logged] = field(default_factory=list)
    sandboxes: dict[str, SandboxInfo] = field(default_factory=dict)
    files: dict[tuple[str, str], tuple[bytes, int]] = field(default_factory=dict)
    dirs: set[tuple[str, str]] = field(default_factory=set)
    gate: threading.Event = field(default_factory=threading.Event)
    pools: dict[str, PoolInfo] = field(default_factory=dict)
    fork_outcomes: list[tuple[str, str | None]] = field(default_factory=list)
    #: Rows of ``GET /v1/templates/{name}/builds``, each answer taking the next (the last one stays).
    build_rows: list[list[dict[str, Any]]] = field(default_factory=list)

    def last(self, path_suffix: str = "") -> Logged:
        return [r for r in self.requests if r.path.endswith(path_suffix)][-1]

    def reset(self) -> None:
        self.requests.clear()
        self.sandboxes.clear()
        self.files.clear()
        self.dirs.clear()
        self.gate.clear()
        self.pools.clear()
        self.fork_outcomes = []
        self.build_rows = []

    def add_sandbox(self, sandbox_id: str | None = None, state: str = "running") -> SandboxInfo:
        now = datetime.now(UTC)
        sid = sandbox_id or f"sb-{uuid.uuid4().hex[:12]}"
        info = SandboxInfo(
            id=sid, template="base", state=state, desired_state="running", node_id="node-1", generation=1,
            memory_mib=256, vcpus=1, hostname=sid, created_at=now, updated_at=now,
        )
        self.sandboxes[sid] = info
        return info


def _error(exc: PodbayError) -> JSONResponse:
    return JSONResponse(exc.to_wire(), status_code=exc.http_status)


def _run(req: ExecRequest) -> tuple[list[tuple[str, str]], int, bool]:
    """The fake command's output chunks, exit code and whether it timed out."""
    if req.shell is not None:
        return [("stdout", f"sh:{req.shell}\n")], 0, False
    argv = req.argv or []
    name, args = argv[0], argv[1:]
    if name == "echo":
        return [("stdout", " ".join(args) + "\n")], 0, False
    if name == "cat":
        return [("stdout", req.stdin or "")], 0, False
    if name == "env":
        return [("stdout", "".join(f"{k}={v}\n" for k, v in sorted(req.env.items())))], 0, False
    if name == "err":
        return [("stderr", " ".join(args) + "\n")], 1, False
    if name == "exit":
        return [], int(args[0]), False
    if name == "killed":
        return [("stdout", "partial")], -9, False
    if name == "hang":
        return [], -9, True
    return [("stderr", f"{name}: not found\n")], 127, False


def build_app(fake: FakeApi) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def log_and_auth(request: Request, call_next: Any) -> Response:
        body = await request.body()
        fake.requests.append(
            Logged(request.method, request.url.path, dict(request.query_params), dict(request.headers), body,
                   request.client.port if request.client else 0)
        )
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return _error(Unauthorized("missing or unknown API key"))
        return await call_next(request)

    def box(sandbox_id: str) -> SandboxInfo:
        if sandbox_id not in fake.sandboxes:
            raise NotFound(f"sandbox {sandbox_id} not found", details={"sandbox_id": sandbox_id})
        return fake.sandboxes[sandbox_id]

    @app.exception_handler(PodbayError)
    async def podbay_error(request: Request, exc: PodbayError) -> JSONResponse:
        return _error(exc)

    @app.post("/v1/sandboxes")
    async def create(body: SandboxCreate, wait: bool = True) -> Response:
        if body.template == "full":  # what the API answers when no node has room
            return _error(NoCapacity("no node has room for sandbox sb-full: no node has room for 256 MiB",
                                     details={"sandbox_id": "sb-full", "retry_after_s": 7}))
        info = fake.add_sandbox()
        info.metadata = body.metadata
        if body.memory_mib:
            info.memory_mib = body.memory_mib
        if not wait:
            info.operation_id = "op-create-1"
            info.state = "starting"
        return JSONResponse(info.model_dump(mode="json"), status_code=201 if wait else 202)

    @app.get("/v1/sandboxes")
    async def list_() -> dict[str, Any]:
        return {"sandboxes": [s.model_dump(mode="json") for s in fake.sandboxes.values()]}

    @app.get("/v1/sandboxes/plain-404")
    async def plain() -> Response:
        return PlainTextResponse("no such page", status_code=404)

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str) -> dict[str, Any]:
        return box(sandbox_id).model_dump(mode="json")

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def delete(sandbox_id: str, wait: bool = True) -> Response:
        info = box(sandbox_id)
        if wait and sandbox_id != "sb-slow":
            del fake.sandboxes[sandbox_id]
            info = info.model_copy(update={"state": "deleted"})
            return JSONResponse(info.model_dump(mode="json"))
        info = info.model_copy(update={"state": "deleting", "operation_id": "op-delete-1"})
        return JSONResponse(info.model_dump(mode="json"), status_code=202)

    @app.post("/v1/sandboxes/{sandbox_id}/suspend")
    async def suspend(sandbox_id: str, wait: bool = True) -> Response:
        info = box(sandbox_id)
        info.state, info.node_id = "suspended", None
        return JSONResponse(info.model_dump(mode="json"))

    @app.post("/v1/sandboxes/{sandbox_id}/fork")
    async def fork(sandbox_id: str) -> Response:
        """Children in the states the test set in ``fork_outcomes`` (``(state, failure_reason)`` each)."""
        box(sandbox_id)
        children = [{"sandbox_id": f"sb-child{i}", "state": state, "failure_reason": reason}
                    for i, (state, reason) in enumerate(fake.fork_outcomes)]
        return JSONResponse({"snapshot_id": "snap-fork", "operation_id": "op-fork-1", "children": children})

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str, wait: bool = True, fallback: bool = False) -> Response:
        info = box(sandbox_id)
        info.state = "running"
        return JSONResponse(info.model_dump(mode="json"))

    @app.get("/v1/sandboxes/{sandbox_id}/snapshots")
    async def snapshots(sandbox_id: str) -> dict[str, Any]:
        box(sandbox_id)
        now = datetime.now(UTC).isoformat()
        return {"snapshots": [{"id": "snap-1", "sandbox_id": sandbox_id, "kind": "full", "state": "ready",
                               "created_at": now, "promotion": "promoted", "promoted_at": now,
                               "uploaded_bytes": 1 << 20, "stored_bytes": 1 << 19}]}

    @app.get("/v1/operations/{op_id}")
    async def operation(op_id: str) -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        return {"id": op_id, "kind": "create", "sandbox_id": None, "state": "succeeded", "created_at": now,
                "finished_at": now}

    @app.put("/v1/pools/{template}")
    async def set_pool(template: str, body: PoolSet) -> dict[str, Any]:
        if template != "base":
            return _error(NotFound(f"template {template!r} does not exist"))  # type: ignore[return-value]
        size, top = body.size, body.max_size if body.max_size is not None else body.size
        fake.pools[template] = PoolInfo(template=template, size=size, max_size=top, target=size, ready=size,
                                        nodes=[PoolNode(node_id="node-1", target=size, ready=size, preparing=0,
                                                        claimed=1, failing=0)])
        return fake.pools[template].model_dump(mode="json")

    @app.get("/v1/pools")
    async def pools() -> dict[str, Any]:
        return {"pools": [p.model_dump(mode="json") for p in fake.pools.values()]}

    @app.get("/v1/nodes")
    async def nodes() -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        res = {"memory_mib": 2048, "vcpus": 8}
        return {"nodes": [
            {"id": "node-a", "state": "ready", "live": True, "schedulable": True, "accel": "tcg",
             "dataplane_url": "http://10.77.0.2:8090", "capacity": res, "used": {"memory_mib": 512, "vcpus": 1},
             "free": {"memory_mib": 1536, "vcpus": 7}, "running": 1, "paused": 1, "sandboxes": 2, "warm_slots": 0,
             "heartbeat_age_s": 0.4, "started_at": now,
             "memory": {"available_mib": 20000, "sandboxes_mib": 180, "reclaimable_mib": 90,
                        "sandbox_cost_mib": 90, "limit_mib": None, "headroom_mib": 1024, "room_mib": 19066,
                        "measured_at": now}},
            {"id": "node-b", "state": "lost", "live": False, "schedulable": False, "accel": "tcg",
             "dataplane_url": "http://10.77.0.3:8090", "capacity": res, "used": {"memory_mib": 0, "vcpus": 0},
             "free": res, "running": 0, "paused": 0, "sandboxes": 0, "warm_slots": 0, "heartbeat_age_s": None,
             "started_at": now, "lost_at": now}]}

    @app.get("/v1/templates")
    async def templates() -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        return {"templates": [{"name": "base", "digest": "sha256:" + "ab" * 32, "memory_mib": 256, "vcpus": 1,
                               "created_at": now}]}

    @app.post("/v1/templates")
    async def build_template(request: Request) -> Response:
        # A Dockerfile the real parser refuses is answered as the API does (422 before any stream); else a
        # build stream: FROM, one cached step, one run with output, then done (or failed when the multipart
        # body says FAIL); the body is logged as sent.
        form = await request.form()
        try:
            parse_dockerfile(str(form.get("dockerfile", "")), {})
        except PodbayError as exc:
            return JSONResponse(exc.to_wire(), status_code=exc.http_status)
        body = fake.last("/v1/templates").body
        fields = {"name": "web"} if b"FAIL" not in body else {"name": "web", "dockerfile": "FAIL"}
        now = datetime.now(UTC).isoformat()
        events: list[dict[str, Any]] = [
            {"type": "step", "step": 0, "total": 2, "cached": True, "text": "FROM base (abab)"},
            {"type": "step", "step": 1, "total": 2, "cached": True, "text": "RUN apt-get update"},
            {"type": "step", "step": 2, "total": 2, "cached": False, "text": "RUN make"},
            {"type": "log", "step": 2, "text": "compiling\n"},
        ]
        if "FAIL" in fields.get("dockerfile", ""):
            events.append({"type": "failed", "step": 2, "exit_code": 2, "code": "build_step_failed",
                           "message": "step 2 (line 3) 'RUN make' exited 2", "output_tail": "compiling\n"})
        else:
            events.append({"type": "done", "template": {"name": fields.get("name"), "digest": "cd" * 32,
                           "memory_mib": 256, "vcpus": 1, "created_at": now, "parent": "base",
                           "config": {"env": {"A": "1"}}, "size_bytes": 2 << 30}})

        async def lines() -> AsyncIterator[bytes]:
            for ev in events:
                if b"BREAK" in body and ev["type"] != "step":
                    raise RuntimeError("the stream breaks off")  # the server closes the connection mid-body
                yield (json.dumps(ev) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson",
                                 headers={"x-podbay-build-id": "bld_fake"})

    @app.get("/v1/templates/{name}/builds")
    async def builds(name: str) -> dict[str, Any]:
        rows = fake.build_rows[0] if fake.build_rows else []
        if len(fake.build_rows) > 1:
            fake.build_rows.pop(0)
        return {"builds": rows}

    def runnable(sandbox_id: str) -> None:
        if box(sandbox_id).state != "running":
            raise InvalidState("cannot exec a sandbox that is paused", details={"state": "paused"})

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_(sandbox_id: str, req: ExecRequest) -> dict[str, Any]:
        runnable(sandbox_id)
        chunks, code, timed_out = _run(req)
        out = "".join(d for s, d in chunks if s == "stdout")
        err = "".join(d for s, d in chunks if s == "stderr")
        return {"stdout": out, "stderr": err, "exit_code": code, "duration_ms": 1.5, "timed_out": timed_out}

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(sandbox_id: str, req: ExecRequest) -> Response:
        runnable(sandbox_id)

        async def events() -> AsyncIterator[bytes]:
            def line(**kw: Any) -> bytes:
                return (json.dumps(kw) + "\n").encode()

            yield line(type="start", pid=42)
            argv = req.argv or []
            if argv == ["gated"]:
                yield line(type="stdout", data="first\n")
                released = await asyncio.to_thread(fake.gate.wait, GATE_WAIT_S)
                if not released:
                    yield line(type="error", error={"code": "timeout", "message": "gate never released"})
                    return
                yield line(type="stdout", data="second\n")
                yield line(type="exit", exit_code=0, timed_out=False)
                return
            if argv == ["fail"]:
                yield line(type="stdout", data="before\n")
                yield line(type="error", error={"code": "guest_error", "message": "guest went away"})
                return
            if argv and str(argv[0]).startswith("/no/such/"):  # as guestd when the program does not exist
                yield line(type="error", error={"code": "not_found",
                                                "message": f"{argv[0]}: No such file or directory"})
                return
            if argv == ["cut"]:
                yield line(type="stdout", data="half")
                return
            chunks, code, timed_out = _run(req)
            for stream, data in chunks:
                yield line(type=stream, data=data)
                yield b"\n"  # blank lines between events are allowed
            yield line(type="exit", exit_code=code, timed_out=timed_out)

        return StreamingResponse(events(), media_type="application/x-ndjson")

    def finfo(sandbox_id: str, path: str) -> FileInfo:
        name = path.rstrip("/").rsplit("/", 1)[-1] or "/"
        if (sandbox_id, path) in fake.dirs:
            return FileInfo(path=path, name=name, type="dir", size=0, mode=0o755, mtime=1700000000.0)
        if (sandbox_id, path) in fake.files:
            data, mode = fake.files[(sandbox_id, path)]
            return FileInfo(path=path, name=name, type="file", size=len(data), mode=mode, mtime=1700000000.0)
        raise NotFound(f"{path}: no such file or directory")

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def put_file(sandbox_id: str, path: str, request: Request, mode: str = "0644") -> dict[str, Any]:
        box(sandbox_id)
        data = b"".join([chunk async for chunk in request.stream()])
        fake.files[(sandbox_id, path)] = (data, int(mode, 8))
        return finfo(sandbox_id, path).model_dump()

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def get_file(sandbox_id: str, path: str) -> Response:
        box(sandbox_id)
        if (sandbox_id, path) not in fake.files:
            raise NotFound(f"{path}: no such file")
        data = fake.files[(sandbox_id, path)][0]

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 65536):
                yield data[i : i + 65536]

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat")
    async def stat(sandbox_id: str, path: str) -> dict[str, Any]:
        box(sandbox_id)
        return finfo(sandbox_id, path).model_dump()

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str) -> dict[str, Any]:
        prefix = path.rstrip("/") + "/"
        names = [p for (s, p) in list(fake.files) + sorted(fake.dirs) if s == sandbox_id and p.startswith(prefix)]
        direct = [p for p in names if "/" not in p[len(prefix) :]]
        return {"entries": [finfo(sandbox_id, p).model_dump() for p in sorted(direct)]}

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir")
    async def mkdir(sandbox_id: str, path: str, parents: bool = True) -> dict[str, Any]:
        box(sandbox_id)
        fake.dirs.add((sandbox_id, path))
        return finfo(sandbox_id, path).model_dump()

    @app.delete("/v1/sandboxes/{sandbox_id}/files")
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        finfo(sandbox_id, path)
        fake.files.pop((sandbox_id, path), None)
        fake.dirs.discard((sandbox_id, path))
        return Response(status_code=204)

    return app


@pytest.fixture(scope="session")
def _served() -> Iterator[FakeApi]:
    fake = FakeApi()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    fake.url = f"http://127.0.0.1:{port}"
    config = uvicorn.Config(build_app(fake), lifespan="off", log_level="warning", ws="none", loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not _wait_started(server):
        raise RuntimeError("the fake API did not start")
    yield fake
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _wait_started(server: uvicorn.Server) -> bool:
    ready = threading.Event()
    for _ in range(500):
        if server.started:
            return True
        ready.wait(0.01)
    return server.started


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """No PODBAY_API_* from the caller's shell and no config file, so each test says where the API is."""
    monkeypatch.delenv("PODBAY_API_URL", raising=False)
    monkeypatch.delenv("PODBAY_API_KEY", raising=False)
    monkeypatch.setenv("PODBAY_CONFIG", str(tmp_path / "absent-config.json"))


@pytest.fixture
def fake_api(_served: FakeApi, clean_env: None) -> FakeApi:
    """The running fake, emptied."""
    _served.reset()
    return _served


def test_fake_refuses_a_wrong_key(fake_api: FakeApi) -> None:
    import httpx

    resp = httpx.get(fake_api.url + "/v1/sandboxes", headers={"Authorization": "Bearer nope"})
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "unauthorized"

