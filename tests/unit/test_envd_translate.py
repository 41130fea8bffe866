"""Pure translation rules of the envd API (services/nodeagent/envd/translate.py, filesystem.resolve_path) and
the E2B routing helpers of the API (host names, access tokens)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from connectrpc.code import Code
from podbay.contracts.channel import FileStat, WatchEvent
from podbay.errors import Conflict, GuestError, InvalidRequest, NotFound, StaleGeneration, Timeout, Unavailable
from podbay_api.e2b.sandboxes import envd_access_token
from podbay_api.edge.envd import parse_host
from podbay_nodeagent.envd.filesystem import home_of, resolve_path
from podbay_nodeagent.envd.proto.filesystem import filesystem_pb as fs_pb
from podbay_nodeagent.envd.translate import (
    connect_error,
    end_status,
    entry_info,
    filesystem_event,
    http_error_status,
    permissions,
    user_from_authorization,
)


def test_entry_info_maps_type_mode_owner_and_mtime() -> None:
    st = FileStat(path="/home/user/a.txt", name="a.txt", type="file", size=5, mode=0o640, mtime=1700000000.25,
                  uid=1000, gid=1000)
    e = entry_info(st)
    assert (e.name, e.path, e.size, e.mode, e.owner, e.group) == ("a.txt", "/home/user/a.txt", 5, 0o640, "user", "user")
    assert e.type == fs_pb.FileType.FILE and e.permissions == "-rw-r-----" and not e.is_symlink
    assert (e.modified_time.seconds, e.modified_time.nanos) == (1700000000, 250000000)
    d = entry_info(FileStat(path="/x", name="x", type="dir", size=0, mode=0o755, mtime=0, uid=42))
    assert d.type == fs_pb.FileType.DIRECTORY and d.permissions == "drwxr-xr-x" and d.owner == "42"
    link = entry_info(FileStat(path="/l", name="l", type="symlink", size=1, mode=0o777, mtime=0))
    assert link.is_symlink and link.type == fs_pb.FileType.SYMLINK and link.owner == "root"


def test_permissions_string() -> None:
    assert permissions("file", 0o4755) == "-rwsr-xr-x"
    assert permissions("other", 0o600) == "-rw-------"


@pytest.mark.parametrize(("exc", "code", "status"), [
    (NotFound("x"), Code.NOT_FOUND, 404),
    (Conflict("x"), Code.ALREADY_EXISTS, 409),
    (InvalidRequest("x"), Code.INVALID_ARGUMENT, 400),
    (Timeout("x"), Code.DEADLINE_EXCEEDED, 504),
    (Unavailable("x"), Code.UNAVAILABLE, 502),
    (StaleGeneration("x"), Code.UNAVAILABLE, 502),
    (GuestError("x"), Code.INTERNAL, 500),
    (GuestError("x", details={"guest_code": "permission_denied"}), Code.PERMISSION_DENIED, 403),
])
def test_errors_map_to_connect_codes_and_http_statuses(exc: Exception, code: Code, status: int) -> None:
    assert connect_error(exc).code == code  # type: ignore[arg-type]
    assert http_error_status(exc) == status  # type: ignore[arg-type]


def test_user_from_basic_authorization() -> None:
    assert user_from_authorization("Basic " + base64.b64encode(b"root:").decode()) == "root"
    assert user_from_authorization(None) is None
    assert user_from_authorization("Basic " + base64.b64encode(b":").decode()) is None
    with pytest.raises(InvalidRequest):
        user_from_authorization("Bearer abc")
    with pytest.raises(InvalidRequest):
        user_from_authorization("Basic !!!")


def test_end_status_texts() -> None:
    assert end_status(0) == "exit status 0"
    assert end_status(3) == "exit status 3"
    assert end_status(-9) == "signal: killed"
    assert end_status(-15) == "signal: terminated"


def test_filesystem_event_with_and_without_entry() -> None:
    st = FileStat(path="/w/a", name="a", type="file", size=1, mode=0o644, mtime=0)
    ev = filesystem_event(WatchEvent(name="a", type="create", stat=st), include_entry=True)
    assert ev.type == fs_pb.EventType.CREATE and ev.entry is not None and ev.entry.path == "/w/a"
    bare = filesystem_event(WatchEvent(name="a", type="remove", stat=None), include_entry=True)
    assert bare.type == fs_pb.EventType.REMOVE and bare.entry is None
    assert filesystem_event(WatchEvent(name="a", type="write", stat=st), include_entry=False).entry is None


def test_resolve_path_relative_to_home() -> None:
    assert home_of("user") == "/home/user" and home_of("root") == "/root"
    assert resolve_path("notes/a.txt", "user") == "/home/user/notes/a.txt"
    assert resolve_path("~/x", "root") == "/root/x"
    assert resolve_path("~", "user") == "/home/user"
    assert resolve_path("/a/../b/./c", "user") == "/b/c"
    assert resolve_path("/", "user") == "/"
    for bad in ("", "a\0b"):
        with pytest.raises(InvalidRequest):
            resolve_path(bad, "user")


def test_parse_host_needs_the_configured_domain() -> None:
    assert parse_host("49983-sbx_abc123.sandbox.example.com", "sandbox.example.com") == (49983, "sbx_abc123")
    assert parse_host("8080-sbx_abc.sandbox.example.com:443", "sandbox.example.com") == (8080, "sbx_abc")
    assert parse_host("49983-sbx_abc.other.com", "sandbox.example.com") is None
    assert parse_host("api.sandbox.example.com", "sandbox.example.com") is None
    assert parse_host("49983-sbx_abc.sandbox.example.com", None) is None
    # The dev stack's domain carries its TLS edge's port: compared by its name, with or without the port.
    assert parse_host("49983-sbx_abc.e2b.localhost:8443", "e2b.localhost:8443") == (49983, "sbx_abc")
    assert parse_host("49983-sbx_abc.e2b.localhost", "e2b.localhost:8443") == (49983, "sbx_abc")
    assert parse_host("49983-sbx_abc.other.localhost:8443", "e2b.localhost:8443") is None


def test_envd_access_token_is_per_sandbox_and_per_secret() -> None:
    a = envd_access_token("secret", "sbx_1")
    assert a == envd_access_token("secret", "sbx_1") and len(a) == 64
    assert a != envd_access_token("secret", "sbx_2") and a != envd_access_token("other", "sbx_1")


def test_parse_metrics_line() -> None:
    from datetime import UTC, datetime

    from podbay_api.e2b.sandboxes import parse_metrics

    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    m = parse_metrics("1 25 100 262144 131072 1024 1000 4000\n", now)
    assert m == {"timestamp": "2026-01-02T03:04:05Z", "timestampUnix": int(now.timestamp()), "cpuCount": 1,
                 "cpuUsedPct": 25.0, "memUsed": 131072 * 1024, "memTotal": 262144 * 1024, "memCache": 1024 * 1024,
                 "diskUsed": 1000, "diskTotal": 4000}
    with pytest.raises(ValueError):
        parse_metrics("garbage", now)


async def _route(headers: dict[str, str], path: str = "/process.Process/Start",
                 domain: str | None = "sbx.example") -> tuple[str | None, int | None]:
    """(path the app saw, or None) and the status answered by the middleware itself (or None)."""
    from podbay_api.edge.envd import EnvdRouting

    seen: list[str] = []
    sent: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    await EnvdRouting(app, domain)(scope, receive, send)
    return (seen[0] if seen else None), (sent[0] if sent else None)


async def test_envd_routing_by_header_and_by_host() -> None:
    assert await _route({"E2b-Sandbox-Id": "sbx_a", "host": "127.0.0.1:8080"}) == (
        "/e2b/envd/sbx_a/process.Process/Start", None)
    assert await _route({"host": "49983-sbx_b.sbx.example"}, "/files") == ("/e2b/envd/sbx_b/files", None)
    # The header wins over the host; other hosts and the API's own paths pass through unchanged.
    assert (await _route({"E2b-Sandbox-Id": "sbx_a", "host": "49983-sbx_b.sbx.example"}))[0] == (
        "/e2b/envd/sbx_a/process.Process/Start")
    assert await _route({"host": "api.sbx.example"}, "/e2b/sandboxes") == ("/e2b/sandboxes", None)
    assert await _route({"host": "49983-sbx_b.other"}, "/v1/sandboxes") == ("/v1/sandboxes", None)
    assert await _route({"host": "49983-sbx_b.sbx.example"}, "/files", domain=None) == ("/files", None)
    # Only envd's port is served: another one is 502 "port is not open".
    assert await _route({"host": "8080-sbx_b.sbx.example"}, "/") == (None, 502)


def test_default_env_header() -> None:
    from podbay_nodeagent.envd.translate import default_env

    assert default_env(None) == {}
    assert default_env(base64.b64encode(b'{"A": "1"}').decode()) == {"A": "1"}
    for bad in ("!!", base64.b64encode(b"[1]").decode(), base64.b64encode(b'{"A": 1}').decode()):
        with pytest.raises(InvalidRequest):
            default_env(bad)
