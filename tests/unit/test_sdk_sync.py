"""The blocking SDK against the fake API (test_sdk_fake.py): request shapes, results, streaming, errors."""

from __future__ import annotations

import io
import socket

import pytest
from test_sdk_fake import API_KEY, FakeApi, _served, clean_env, fake_api  # noqa: F401  (fixtures)

from podbay.sdk import (
    Client,
    ExecEvent,
    ExecResult,
    GuestError,
    InvalidRequest,
    InvalidState,
    NotFound,
    Sandbox,
    SandboxInfo,
    Unauthorized,
    Unavailable,
)


def _create(fake: FakeApi, **kw: object) -> Sandbox:
    return Sandbox.create(api_url=fake.url, api_key=API_KEY, **kw)  # type: ignore[arg-type]


def test_create_sends_the_contract_body_and_returns_a_running_sandbox(fake_api: FakeApi) -> None:
    sb = _create(fake_api, memory_mib=512, metadata={"team": "a"})
    try:
        req = fake_api.last("/v1/sandboxes")
        assert req.method == "POST"
        assert req.query == {"wait": "true"}
        assert req.headers["authorization"] == f"Bearer {API_KEY}"
        assert req.json() == {"template": "base", "memory_mib": 512, "metadata": {"team": "a"}}
        assert isinstance(sb.info, SandboxInfo)
        assert sb.id in fake_api.sandboxes
        assert sb.info.memory_mib == 512
        assert sb.info.metadata == {"team": "a"}
    finally:
        sb.close()


def test_create_without_waiting_reports_the_operation(fake_api: FakeApi) -> None:
    with Client(fake_api.url, API_KEY) as client:
        info = client.create_sandbox("base", wait=False)
        assert fake_api.last("/v1/sandboxes").query == {"wait": "false"}
        assert info.operation_id == "op-create-1"
        op = client.get_operation(info.operation_id)
        assert op.state == "succeeded"
        assert fake_api.last().path == "/v1/operations/op-create-1"


def test_bad_create_values_fail_before_any_request(fake_api: FakeApi) -> None:
    with pytest.raises(InvalidRequest, match="memory_mib"):
        _create(fake_api, memory_mib=1)
    with pytest.raises(InvalidRequest, match="template"):
        _create(fake_api, template="Not A Name")
    assert fake_api.requests == []


def test_connect_refresh_list_and_templates(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-one")
    fake_api.add_sandbox("sb-two")
    sb = Sandbox.connect("sb-one", api_url=fake_api.url, api_key=API_KEY)
    try:
        assert sb.id == "sb-one"
        fake_api.sandboxes["sb-one"].state = "paused"
        assert sb.refresh().state == "paused"
        assert sb.info.state == "paused"
    finally:
        sb.close()
    ids = {b.id for b in Sandbox.list(api_url=fake_api.url, api_key=API_KEY)}
    assert ids == {"sb-one", "sb-two"}
    with Client(fake_api.url, API_KEY) as client:
        assert [t.name for t in client.list_templates()] == ["base"]


def test_exec_argv_and_shell_request_shapes(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        res = sb.exec(["echo", "hi", "there"], env={"A": "1"}, cwd="/tmp", user="agent", timeout_s=5)
        assert isinstance(res, ExecResult)
        assert (res.stdout, res.exit_code) == ("hi there\n", 0)
        body = fake_api.last("/exec").json()
        assert body == {"argv": ["echo", "hi", "there"], "env": {"A": "1"}, "cwd": "/tmp", "user": "agent",
                        "timeout_s": 5}
        res = sb.exec("ls | wc -l")
        assert res.stdout == "sh:ls | wc -l\n"
        assert fake_api.last("/exec").json() == {"shell": "ls | wc -l", "env": {}}


def test_exec_results_carry_failures_and_stdin(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        assert sb.exec(["exit", "3"]).exit_code == 3
        hung = sb.exec(["hang"], timeout_s=1)
        assert hung.timed_out and hung.exit_code == -9
        assert sb.exec(["cat"], stdin=b"from bytes").stdout == "from bytes"
        assert sb.exec(["cat"], stdin="from text").stdout == "from text"
        with pytest.raises(InvalidRequest, match="UTF-8"):
            sb.exec(["cat"], stdin=b"\xff\xfe")
        with pytest.raises(InvalidRequest):
            sb.exec([])


def test_exec_stream_yields_events_as_the_process_writes(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        seen: list[ExecEvent] = []
        for event in sb.exec_stream(["gated"]):
            seen.append(event)
            if event.data == "first\n":
                # The server holds "second" until this gate opens; a client that buffered the
                # whole response would never get here and would end with the server's error event.
                fake_api.gate.set()
        assert [e.type for e in seen] == ["start", "stdout", "stdout", "exit"]
        assert [e.data for e in seen if e.type == "stdout"] == ["first\n", "second\n"]
        assert seen[0].pid == 42
        assert seen[-1].exit_code == 0


def test_exec_stream_routes_stderr_and_exit_code(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        events = list(sb.exec_stream(["err", "oops"]))
        assert [(e.type, e.data) for e in events if e.type == "stderr"] == [("stderr", "oops\n")]
        assert events[-1].type == "exit" and events[-1].exit_code == 1
        assert fake_api.last("/exec/stream").json() == {"argv": ["err", "oops"], "env": {}}


def test_exec_stream_error_event_raises_the_typed_error(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        got: list[str | None] = []
        with pytest.raises(GuestError, match="guest went away") as info:
            for event in sb.exec_stream(["fail"]):
                got.append(event.data)
        assert info.value.code == "guest_error"
        assert got == [None, "before\n"]


def test_exec_stream_cut_short_raises_unavailable(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        with pytest.raises(Unavailable, match="ended before"):
            list(sb.exec_stream(["cut"]))


def test_files_round_trip_in_every_form(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        info = sb.files.write("/tmp/a.bin", b"\x00\x01binary", mode=0o600)
        assert info.size == 8 and info.mode == 0o600
        put = fake_api.last("/files")
        assert put.method == "PUT" and put.query == {"path": "/tmp/a.bin", "mode": "0600"}
        assert sb.files.read("/tmp/a.bin") == b"\x00\x01binary"

        sb.files.write("/tmp/t.txt", "héllo")
        assert fake_api.last("/files").query["mode"] == "0644"
        assert sb.files.read_text("/tmp/t.txt") == "héllo"

        big = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4: several upload chunks
        sb.files.write("/tmp/big", io.BytesIO(big))
        assert fake_api.files[(sb.id, "/tmp/big")][0] == big
        assert sb.files.read("/tmp/big") == big
        sink = io.BytesIO()
        assert sb.files.read_into("/tmp/big", sink) == len(big)
        assert sink.getvalue() == big

        sb.files.write("/tmp/from-text-io", io.StringIO("text io"))
        assert sb.files.read("/tmp/from-text-io") == b"text io"


def test_files_metadata_operations(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        assert sb.files.mkdir("/w").type == "dir"
        assert fake_api.last("/files/mkdir").query == {"path": "/w", "parents": "true"}
        sb.files.write("/w/x", b"1")
        assert sb.files.stat("/w/x").size == 1
        assert [e.name for e in sb.files.list("/w")] == ["x"]
        assert sb.files.exists("/w/x")
        assert not sb.files.exists("/w/missing")
        sb.files.remove("/w", recursive=True)
        assert fake_api.last("/files").query == {"path": "/w", "recursive": "true"}
        sb.files.remove("/w/x")
        assert not sb.files.exists("/w/x")
        with pytest.raises(NotFound, match="no such file"):
            sb.files.read("/w/x")
        with pytest.raises(InvalidRequest):
            sb.files.write("/w/y", 12345)  # type: ignore[arg-type]


def test_server_errors_become_typed_errors(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-paused", state="paused")
    with Client(fake_api.url, API_KEY) as client:
        with pytest.raises(NotFound) as nf:
            client.get_sandbox("sb-nope")
        assert nf.value.code == "not_found"
        assert nf.value.message == "sandbox sb-nope not found"
        assert nf.value.details == {"sandbox_id": "sb-nope"}
        with pytest.raises(InvalidState) as st:
            client.exec("sb-paused", ["true"])
        assert st.value.details == {"state": "paused"}
        with pytest.raises(NotFound, match="HTTP 404 .*no such page"):
            client.get_sandbox("plain-404")
    with Client(fake_api.url, "wrong") as client, pytest.raises(Unauthorized):
        client.list_sandboxes()


def test_network_failure_is_unavailable_naming_the_url(clean_env: None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        with Client(f"http://127.0.0.1:{port}", "k") as client, pytest.raises(Unavailable) as exc:
            client.list_sandboxes()
    assert f"http://127.0.0.1:{port}/v1/sandboxes" in exc.value.message
    assert exc.value.retryable


def test_context_manager_deletes_and_tolerates_already_gone(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        sid = sb.id
    assert sid not in fake_api.sandboxes
    assert fake_api.last().method == "DELETE" and fake_api.last().query == {"wait": "true"}
    with _create(fake_api) as sb:
        del fake_api.sandboxes[sb.id]  # someone else deleted it first
    assert sb._client._http.is_closed


def test_one_sandbox_reuses_one_connection(fake_api: FakeApi) -> None:
    with _create(fake_api) as sb:
        sb.exec(["echo", "1"])
        sb.files.write("/f", b"x")
        sb.refresh()
    ports = {r.client_port for r in fake_api.requests}
    assert len(fake_api.requests) == 5
    assert len(ports) == 1


def test_many_sandboxes_can_share_a_client(fake_api: FakeApi) -> None:
    with Client(fake_api.url, API_KEY) as client:
        a = Sandbox.create(client=client)
        b = Sandbox.create(client=client)
        a.delete()
        assert not client._http.is_closed  # not owned: deleting a sandbox leaves the shared client open
        b.delete()
    assert len({r.client_port for r in fake_api.requests}) == 1
