"""Pure request building and response parsing of the SDK, through ``httpx.MockTransport``."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from test_sdk_fake import clean_env  # noqa: F401  (fixture)

from podbay.sdk import (
    AsyncClient,
    Client,
    Conflict,
    InvalidRequest,
    PodbayError,
    Timeout,
    Unavailable,
    Unprocessable,
)
from podbay.sdk._calls import exec_request, format_mode
from podbay.sdk._http import EventReader

pytestmark = pytest.mark.usefixtures("clean_env")


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    return Client("http://api.test", "k", transport=httpx.MockTransport(handler))


def test_ids_are_checked_and_sent_as_one_path_segment() -> None:
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})

    with _client(handler) as client:
        with pytest.raises(InvalidRequest, match="invalid sandbox id"):
            client.get_sandbox("../operations/x?y")
        assert seen == []
        with pytest.raises(PodbayError):
            client.get_sandbox("sbx_A-9")
    assert seen == [b"/v1/sandboxes/sbx_A-9"]


_BAD_IDS = ["", "a/b", "x" * 65, "sp ace", "é"]


def _every_sandbox_call(client: Client, sid: str) -> list[Callable[[], object]]:
    return [
        lambda: client.get_sandbox(sid),
        lambda: client.delete_sandbox(sid),
        lambda: client.pause_sandbox(sid),
        lambda: client.resume_sandbox(sid),
        lambda: client.exec(sid, ["true"]),
        lambda: client.exec_stream(sid, ["true"]),
        lambda: client.read_file(sid, "/x"),
        lambda: client.write_file(sid, "/x", b"data"),
        lambda: client.stat_file(sid, "/x"),
        lambda: client.list_files(sid, "/x"),
        lambda: client.mkdir(sid, "/x"),
        lambda: client.remove_file(sid, "/x"),
    ]


@pytest.mark.parametrize("bad", _BAD_IDS)
def test_malformed_sandbox_ids_are_refused_before_sending(bad: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500)

    with _client(handler) as client:
        for call in _every_sandbox_call(client, bad):
            with pytest.raises(InvalidRequest, match="invalid sandbox id"):
                call()
        with pytest.raises(InvalidRequest, match="invalid operation id"):
            client.get_operation(bad)
    assert seen == []


@pytest.mark.parametrize("bad", _BAD_IDS)
def test_malformed_snapshot_ids_are_named_as_snapshot_ids(bad: str) -> None:
    # The sandbox id is fine; the message must blame the snapshot argument, not the sandbox.
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500)

    with _client(handler) as client:
        for call in (
            lambda: client.restore_sandbox("sb-1", bad),
            lambda: client.fork_sandbox("sb-1", 1, bad),
            lambda: client.diff_snapshots("sb-1", bad, "snap-2"),
            lambda: client.diff_snapshots("sb-1", "snap-1", bad),
        ):
            with pytest.raises(InvalidRequest, match="invalid snapshot id"):
                call()
    assert seen == []


async def test_async_client_refuses_an_empty_sandbox_id() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500)

    async with AsyncClient("http://api.test", "k", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(InvalidRequest, match="invalid sandbox id"):
            await client.get_sandbox("")
        with pytest.raises(InvalidRequest, match="invalid sandbox id"):
            client.exec_stream("", ["true"])
    assert seen == []


@pytest.mark.parametrize("bad", ["", "relative/path", "/nul\0byte", "/" + "x" * 4096])
def test_malformed_paths_are_refused_before_sending(bad: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500)

    with _client(handler) as client:
        for call in (
            lambda: client.read_file("sb", bad),
            lambda: client.write_file("sb", bad, b""),
            lambda: client.stat_file("sb", bad),
            lambda: client.list_files("sb", bad),
            lambda: client.mkdir("sb", bad),
            lambda: client.remove_file("sb", bad),
        ):
            with pytest.raises(InvalidRequest, match="invalid path"):
                call()
    assert seen == []


def test_fastapi_detail_bodies_map_by_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        detail = [{"loc": ["query", "path"], "msg": "Field required", "type": "missing"}]
        return httpx.Response(422, json={"detail": detail})

    with _client(handler) as client, pytest.raises(Unprocessable, match="query.path: Field required"):
        client.stat_file("sb", "/x")


@pytest.mark.parametrize(
    ("status", "cls"), [(409, Conflict), (502, Unavailable), (503, Unavailable), (504, Timeout), (500, PodbayError)]
)
def test_non_wire_errors_map_by_status(status: int, cls: type[PodbayError]) -> None:
    with _client(lambda r: httpx.Response(status, text="<html>proxy</html>")) as client:
        with pytest.raises(cls) as exc:
            client.list_sandboxes()
    assert type(exc.value) is cls
    assert f"HTTP {status}" in exc.value.message and "proxy" in exc.value.message


def test_unknown_wire_code_keeps_the_message() -> None:
    body = {"error": {"code": "brand_new", "message": "a newer server says no"}}
    with _client(lambda r: httpx.Response(418, json=body)) as client, pytest.raises(PodbayError) as exc:
        client.list_sandboxes()
    assert exc.value.message == "a newer server says no"


def test_malformed_success_body_is_a_podbay_error() -> None:
    with _client(lambda r: httpx.Response(200, json={"id": 1})) as client:
        with pytest.raises(PodbayError, match="unexpected SandboxInfo response"):
            client.get_sandbox("sb")


def test_read_timeout_becomes_timeout_naming_the_url() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with _client(handler) as client, pytest.raises(Timeout, match="http://api.test/v1/templates"):
        client.list_templates()


async def test_async_connect_error_becomes_unavailable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with AsyncClient("http://api.test", "k", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(Unavailable, match="cannot reach the podbay API at http://api.test/v1/sandboxes"):
            await client.list_sandboxes()


def test_a_connection_that_breaks_mid_answer_is_not_called_unreachable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body",
                                        request=request)

    with _client(handler) as client, pytest.raises(Unavailable) as err:
        client.list_templates()
    assert "broke off mid-request" in str(err.value) and "cannot reach" not in str(err.value)
    assert "http://api.test/v1/templates" in str(err.value)


def test_exec_read_timeout_follows_the_command_timeout() -> None:
    timeouts: list[dict[str, float | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return httpx.Response(200, json={"stdout": "", "stderr": "", "exit_code": 0, "duration_ms": 1})

    with _client(handler) as client:
        client.exec("sb", ["true"], timeout_s=100)
        client.exec("sb", ["true"])
    assert timeouts[0]["read"] == 130.0
    assert timeouts[1]["read"] is None
    assert timeouts[0]["connect"] == 90.0


def test_bearer_header_only_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    headers: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers)
        return httpx.Response(200, json={"templates": []})

    with Client("http://api.test", transport=httpx.MockTransport(handler)) as client:
        client.list_templates()
    monkeypatch.setenv("PODBAY_API_KEY", "from-env")
    with Client("http://api.test/", transport=httpx.MockTransport(handler)) as client:
        assert client.api_url == "http://api.test"
        client.list_templates()
    assert "authorization" not in headers[0]
    assert headers[1]["authorization"] == "Bearer from-env"


def test_event_reader() -> None:
    reader = EventReader("u")
    assert reader.feed("") is None
    ev = reader.feed(json.dumps({"type": "stdout", "data": "x"}))
    assert ev is not None and ev.data == "x"
    with pytest.raises(Unavailable):
        reader.finish()
    with pytest.raises(PodbayError, match="malformed exec event"):
        reader.feed("{not json")
    with pytest.raises(PodbayError, match="malformed exec event"):
        reader.feed(json.dumps({"type": "weird"}))
    with pytest.raises(Timeout, match="too slow"):
        reader.feed(json.dumps({"type": "error", "error": {"code": "timeout", "message": "too slow"}}))
    reader.feed(json.dumps({"type": "exit", "exit_code": 0}))
    reader.finish()


def test_exec_request_validation() -> None:
    assert exec_request("echo hi").shell == "echo hi"
    assert exec_request(("a", "b")).argv == ["a", "b"]
    with pytest.raises(InvalidRequest, match="argv"):
        exec_request([])
    with pytest.raises(InvalidRequest, match="timeout_s"):
        exec_request(["x"], timeout_s=0)
    with pytest.raises(InvalidRequest, match="larger than"):
        exec_request(["x"], stdin=b"a" * ((16 << 20) + 1))
    for wrong in (None, 5, b"ls"):
        with pytest.raises(InvalidRequest, match="must be a string or a sequence"):
            exec_request(wrong)  # type: ignore[arg-type]


def test_format_mode() -> None:
    assert format_mode(0o644) == "0644"
    assert format_mode(0o4755) == "4755"
    with pytest.raises(InvalidRequest):
        format_mode(0o10000)


def test_lifecycle_requests_have_the_documented_shapes() -> None:
    import json as _json

    seen: list[tuple[str, str, dict[str, object] | None]] = []
    info = {"id": "sbx_1", "template": "base", "state": "running", "desired_state": "running", "generation": 2,
            "memory_mib": 256, "vcpus": 1, "hostname": "h", "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z", "lease_s": 60, "lease_expires_at": "2026-01-01T00:01:00Z"}
    snap = {"id": "snap_1", "sandbox_id": "sbx_1", "kind": "disk", "state": "ready", "created_at": "2026-01-01T00:00:00Z"}

    def handler(req: httpx.Request) -> httpx.Response:
        body = _json.loads(req.content) if req.content else None
        seen.append((req.method, req.url.path, body))
        if req.url.path.endswith("/snapshots") and req.method == "POST":
            return httpx.Response(201, json=snap)
        if req.url.path.endswith("/fork"):
            return httpx.Response(200, json={"snapshot_id": "snap_1", "operation_id": "op_1",
                                             "children": [{"sandbox_id": "sbx_2", "state": "running"}]})
        return httpx.Response(200, json=info)

    with _client(handler) as c:
        assert c.set_timeout("sbx_1", 60, "delete").lease_s == 60
        assert c.snapshot_sandbox("sbx_1", "disk").kind == "disk"
        assert c.restore_sandbox("sbx_1", "snap_1").generation == 2
        assert c.fork_sandbox("sbx_1", 1, "snap_1").children[0].sandbox_id == "sbx_2"
        with pytest.raises(InvalidRequest):
            c.set_timeout("sbx_1", 1)  # below the 10 s minimum: refused before sending
        with pytest.raises(InvalidRequest):
            c.snapshot_sandbox("sbx_1", "bogus")
    assert seen == [
        ("POST", "/v1/sandboxes/sbx_1/timeout", {"lease_s": 60, "on_lease_expiry": "delete"}),
        ("POST", "/v1/sandboxes/sbx_1/snapshots", {"kind": "disk"}),
        ("POST", "/v1/sandboxes/sbx_1/restore", {"snapshot_id": "snap_1"}),
        ("POST", "/v1/sandboxes/sbx_1/fork", {"count": 1, "snapshot_id": "snap_1"}),
    ]
