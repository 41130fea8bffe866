"""The ``podbay`` CLI against the fake API (test_sdk_fake.py): output, exit codes and error lines."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import sys
import threading
import types
from dataclasses import dataclass
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import pytest
from test_sdk_fake import API_KEY, FakeApi, _served, clean_env, fake_api  # noqa: F401  (fixtures)
from typer.testing import CliRunner, Result

from podbay import servercli
from podbay.cli.exec_cmd import _write as exec_write
from podbay.cli.exec_cmd import exit_status
from podbay.cli.main import app
from podbay.clientconfig import load_client_config


def run(fake: FakeApi | None, *args: str, input: str | bytes | None = None) -> Result:
    opts = ["--api-url", fake.url, "--api-key", API_KEY] if fake else []
    return CliRunner().invoke(app, [*opts, *args], input=input)


def assert_error_line(result: Result, code: str, exit_code: int) -> None:
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(f"({code})"), result.stderr
    assert "Traceback" not in result.output


def test_create_prints_only_the_id(fake_api: FakeApi) -> None:
    result = run(fake_api, "sandbox", "create", "--template", "base", "--memory-mib", "512", "-m", "a=b")
    assert result.exit_code == 0, result.output
    sid = result.stdout.strip()
    assert result.stdout == sid + "\n"
    assert sid in fake_api.sandboxes
    assert fake_api.last("/v1/sandboxes").json() == {"template": "base", "memory_mib": 512, "metadata": {"a": "b"}}


def test_create_no_wait_puts_the_operation_on_stderr(fake_api: FakeApi) -> None:
    result = run(fake_api, "sandbox", "create", "--no-wait")
    assert result.exit_code == 0
    assert result.stdout.strip() in fake_api.sandboxes
    assert result.stderr.strip() == "operation op-create-1"


def test_list_get_and_rm(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-listed")
    table = run(fake_api, "sandbox", "list")
    assert table.exit_code == 0 and "sb-listed" in table.stdout and "STATE" in table.stdout
    listed = json.loads(run(fake_api, "sandbox", "list", "--json").stdout)
    assert [b["id"] for b in listed] == ["sb-listed"]
    got = run(fake_api, "sandbox", "get", "sb-listed")
    assert got.exit_code == 0 and "hostname" in got.stdout and "sb-listed" in got.stdout
    assert json.loads(run(fake_api, "sandbox", "get", "sb-listed", "--json").stdout)["state"] == "running"
    removed = run(fake_api, "sandbox", "rm", "sb-listed")
    assert removed.exit_code == 0 and removed.stdout == "sb-listed\n"
    assert "sb-listed" not in fake_api.sandboxes


def test_api_errors_are_one_line_and_exit_2(fake_api: FakeApi) -> None:
    result = run(fake_api, "sandbox", "get", "sb-missing")
    assert_error_line(result, "not_found", 2)
    assert "sandbox sb-missing not found" in result.stderr


def test_wrong_key_exits_2(fake_api: FakeApi) -> None:
    result = CliRunner().invoke(app, ["--api-url", fake_api.url, "--api-key", "bad", "sandbox", "list"])
    assert_error_line(result, "unauthorized", 2)


def test_unreachable_api_exits_1(clean_env: None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        result = CliRunner().invoke(app, ["--api-url", url, "--api-key", "k", "sandbox", "list"])
    assert_error_line(result, "unavailable", 1)
    assert url in result.stderr


def test_no_api_key_anywhere_names_where_it_was_looked_for(clean_env: None, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nonexistent.json"
    monkeypatch.setenv("PODBAY_CONFIG", str(missing))
    result = CliRunner().invoke(app, ["--api-url", "http://127.0.0.1:9", "sandbox", "list"])
    assert_error_line(result, "unauthorized", 2)
    assert f"{missing} does not exist" in result.stderr and "PODBAY_API_KEY" in result.stderr


def test_exec_streams_and_passes_the_exit_code(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-x")
    ok = run(fake_api, "exec", "sb-x", "--env", "A=1", "--cwd", "/w", "--", "echo", "-n", "hi")
    assert ok.exit_code == 0 and ok.stdout == "-n hi\n"
    assert fake_api.last("/exec/stream").json() == {"argv": ["echo", "-n", "hi"], "env": {"A": "1"}, "cwd": "/w"}
    err = run(fake_api, "exec", "sb-x", "--", "err", "bad", "thing")
    assert (err.exit_code, err.stdout, err.stderr) == (1, "", "bad thing\n")
    assert run(fake_api, "exec", "sb-x", "--", "exit", "7").exit_code == 7
    killed = run(fake_api, "exec", "sb-x", "--", "killed")
    assert (killed.exit_code, killed.stdout) == (137, "partial")
    shell = run(fake_api, "exec", "sb-x", "--shell", "--", "ls", "|", "wc")
    assert shell.stdout == "sh:ls | wc\n"


def test_exec_forwards_stdin_unless_told_not_to(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-x")
    piped = run(fake_api, "exec", "sb-x", "--", "cat", input="piped in\n")
    assert piped.exit_code == 0 and piped.stdout == "piped in\n"
    assert fake_api.last("/exec/stream").json()["stdin"] == "piped in\n"
    ignored = run(fake_api, "exec", "sb-x", "-n", "--", "cat", input="ignored")
    assert ignored.stdout == "" and "stdin" not in fake_api.last("/exec/stream").json()
    binary = run(fake_api, "exec", "sb-x", "--", "cat", input=b"\xff\x00")
    assert_error_line(binary, "invalid_request", 2)


def test_restore_with_an_empty_snapshot_id_names_the_snapshot(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-x")
    result = run(fake_api, "sandbox", "restore", "sb-x", "")
    assert_error_line(result, "invalid_request", 2)
    assert "invalid snapshot id ''" in result.stderr and "sandbox id" not in result.stderr


def test_exec_timeout_exits_124(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-x")
    result = run(fake_api, "exec", "sb-x", "--timeout", "2", "--", "hang")
    assert_error_line(result, "timeout", 124)
    assert "timed out after 2 s" in result.stderr
    assert fake_api.last("/exec/stream").json()["timeout_s"] == 2


def test_exec_on_a_paused_sandbox_and_stream_errors(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-p", state="paused")
    assert_error_line(run(fake_api, "exec", "sb-p", "--", "true"), "invalid_state", 2)
    fake_api.add_sandbox("sb-x")
    failed = run(fake_api, "exec", "sb-x", "--", "fail")
    assert_error_line(failed, "guest_error", 1)
    assert failed.stdout == "before\n"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["sandbox", "create", "--vcpus", "abc"], "error: invalid value for '--vcpus': 'abc' is not a valid integer"),
        (["exec", "sb-x", "--timeout", "x", "--", "true"], "error: invalid value for '--timeout': 'x' is not a valid number"),
        (["exec", "sb-x", "--env", "NOEQUALS", "--", "true"], "error: invalid value for --env: expected KEY=VALUE, got 'NOEQUALS'"),
        (["exec", "sb-x"], "error: missing argument 'CMD [ARGS]...'"),
        (["files", "write", "sb-x", "/r", "./nonexistent_local"], "error: invalid value for LOCAL: './nonexistent_local' is not a readable file"),
        (["files", "write", "sb-x", "/r", "x", "--mode", "999"], "error: invalid value for --mode: expected an octal mode such as 0644, got '999'"),
        (["sandbox", "get"], "error: missing argument 'ID'"),
        (["nosuch"], "error: no such command 'nosuch'"),
        (["sandbox", "list", "--bogus"], "error: no such option: --bogus"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_and_exit_2(fake_api: FakeApi, args: list[str], line: str) -> None:
    result = run(fake_api, *args)
    assert_error_line(result, "usage", 2)
    assert result.stderr == f"{line} (usage)\n"
    assert result.stdout == "" and "Usage" not in result.output
    assert [r.path for r in fake_api.requests] == []


def test_help_is_still_typers(fake_api: FakeApi) -> None:
    helped = run(fake_api, "sandbox", "create", "--help")
    assert helped.exit_code == 0 and "Usage: podbay sandbox create" in helped.stdout and "--vcpus" in helped.stdout
    bare = run(fake_api, "sandbox")
    assert bare.exit_code == 2 and "Usage: podbay sandbox" in bare.output and "error:" not in bare.output


def test_empty_or_malformed_ids_and_paths_are_refused_before_sending(fake_api: FakeApi) -> None:
    for args in (["sandbox", "get", ""], ["sandbox", "rm", "a/b"], ["exec", "", "--", "true"],
                 ["files", "stat", "", "/x"], ["operation", "get", ""]):  # fmt: skip
        result = run(fake_api, *args)
        assert_error_line(result, "invalid_request", 2)
        assert "invalid" in result.stderr and " id " in result.stderr
    assert_error_line(run(fake_api, "files", "stat", "sb-x", "relative"), "invalid_request", 2)
    assert fake_api.requests == []


def test_exec_of_a_missing_program_exits_127_as_a_shell_would(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-x")
    result = run(fake_api, "exec", "sb-x", "--", "/no/such/binary")
    assert_error_line(result, "not_found", 127)
    assert "/no/such/binary: No such file or directory" in result.stderr
    assert_error_line(run(fake_api, "exec", "sb-nope", "--", "/no/such/binary"), "not_found", 2)  # no sandbox


def test_an_unreachable_api_is_one_error_line_that_points_at_status(clean_env: None) -> None:
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(app, ["--api-url", f"http://127.0.0.1:{port}", "--api-key", "k", "sandbox", "get",
                                      "sb-x"])
    assert_error_line(result, "unavailable", 1)
    assert "cannot reach the podbay API" in result.stderr and "`podbay status` tells" in result.stderr


def test_a_malformed_config_file_is_one_error_line(clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{broken")
    monkeypatch.setenv("PODBAY_CONFIG", str(broken))
    for args in (["sandbox", "list"], ["env"]):
        result = CliRunner().invoke(app, args)
        assert_error_line(result, "invalid_request", 2)
        assert f"the podbay config file {broken} is not valid JSON" in result.stderr


def test_exec_output_reaches_the_byte_layer_as_utf8_in_order(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-x")
    text = "héllo ✓ 日本 \U0001f600\n"
    result = run(fake_api, "exec", "sb-x", "--", "cat", input=text.encode())
    assert result.exit_code == 0 and result.stdout_bytes == text.encode("utf-8")
    # Text printed earlier through the text layer must stay in front of the chunk written to the bytes.
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    stream.write("before ")
    exec_write(stream, "ü\n")
    assert raw.getvalue() == "before ü\n".encode()


def test_files_commands_round_trip(fake_api: FakeApi, tmp_path: Path) -> None:
    fake_api.add_sandbox("sb-f")
    local = tmp_path / "in.bin"
    payload = bytes(range(256)) * 1000
    local.write_bytes(payload)
    assert run(fake_api, "files", "write", "sb-f", "/data/in.bin", str(local), "--mode", "0600").exit_code == 0
    assert fake_api.files[("sb-f", "/data/in.bin")] == (payload, 0o600)
    assert run(fake_api, "files", "write", "sb-f", "/data/stdin.txt", "-", input=b"from stdin").exit_code == 0
    assert fake_api.files[("sb-f", "/data/stdin.txt")][0] == b"from stdin"

    raw = run(fake_api, "files", "read", "sb-f", "/data/in.bin")
    assert raw.exit_code == 0 and raw.stdout_bytes == payload
    out = tmp_path / "out.bin"
    assert run(fake_api, "files", "read", "sb-f", "/data/in.bin", "-o", str(out)).exit_code == 0
    assert out.read_bytes() == payload
    missing = run(fake_api, "files", "read", "sb-f", "/nope", "-o", str(tmp_path / "never"))
    assert_error_line(missing, "not_found", 2)
    for bad in ("", str(tmp_path)):
        assert_error_line(run(fake_api, "files", "read", "sb-f", "/data/in.bin", "-o", bad), "invalid_request", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.bin", "out.bin"]

    ls = run(fake_api, "files", "ls", "sb-f", "/data")
    assert ls.exit_code == 0 and "in.bin" in ls.stdout and "0600" in ls.stdout and "NAME" in ls.stdout
    assert {e["name"] for e in json.loads(run(fake_api, "files", "ls", "sb-f", "/data", "--json").stdout)} == {
        "in.bin", "stdin.txt"}
    assert json.loads(run(fake_api, "files", "stat", "sb-f", "/data/in.bin", "--json").stdout)["size"] == len(payload)
    assert run(fake_api, "files", "mkdir", "sb-f", "/d", "--no-parents").exit_code == 0
    assert fake_api.last("/mkdir").query == {"path": "/d", "parents": "false"}
    assert run(fake_api, "files", "rm", "sb-f", "/d", "-r").exit_code == 0
    assert fake_api.last("/files").query == {"path": "/d", "recursive": "true"}
    absent = run(fake_api, "files", "write", "sb-f", "/x", str(tmp_path / "absent"))
    assert_error_line(absent, "usage", 2)


def test_files_read_to_a_link_a_fifo_or_stdout_never_replaces_them(fake_api: FakeApi, tmp_path: Path) -> None:
    fake_api.add_sandbox("sb-o")
    fake_api.files[("sb-o", "/f")] = (b"remote bytes", 0o644)
    target = tmp_path / "target"
    target.write_bytes(b"old")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert run(fake_api, "files", "read", "sb-o", "/f", "-o", str(link)).exit_code == 0
    assert link.is_symlink() and target.read_bytes() == b"remote bytes"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert run(fake_api, "files", "read", "sb-o", "/f", "-o", str(fifo)).exit_code == 0
    reader.join(10)
    assert got == [b"remote bytes"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link", "target"]  # no .part left
    dash = run(fake_api, "files", "read", "sb-o", "/f", "-o", "-")
    assert dash.exit_code == 0 and dash.stdout_bytes == b"remote bytes"
    assert not Path("-").exists()


def test_files_stat_shows_octal_mode_and_iso_mtime(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-f")
    assert run(fake_api, "files", "write", "sb-f", "/data/f", "-", "--mode", "0640", input=b"x").exit_code == 0
    info = json.loads(run(fake_api, "files", "stat", "sb-f", "/data/f", "--json").stdout)
    shown = run(fake_api, "files", "stat", "sb-f", "/data/f")
    assert shown.exit_code == 0
    fields = dict(line.strip().split(None, 1) for line in shown.stdout.splitlines())
    assert fields["mode"] == "0640" and info["mode"] & 0o7777 == 0o640
    stamp = datetime.fromtimestamp(info["mtime"], tz=UTC).isoformat(timespec="seconds")
    assert fields["mtime"] == stamp and stamp.endswith("+00:00")
    assert fields["size"] == "1" and fields["path"] == "/data/f"


def test_templates_and_operations(fake_api: FakeApi) -> None:
    result = run(fake_api, "template", "list")
    assert result.exit_code == 0 and "base" in result.stdout and "sha256:abab" in result.stdout
    op = json.loads(run(fake_api, "operation", "get", "op-1", "--json").stdout)
    assert (op["id"], op["state"]) == ("op-1", "succeeded")


def test_template_build_streams_steps_and_prints_the_template(fake_api: FakeApi, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "app.txt").write_text("x")
    (tmp_path / "Dockerfile").write_text("FROM podbay/base\nCOPY app.txt /app.txt\n")
    result = run(fake_api, "template", "build", "web", "-f", str(tmp_path / "Dockerfile"), str(ctx),
                 "--build-arg", "A=1", "--ready-port", "8000", "--memory-mib", "1024", "--vcpus", "2",
                 "--disk-mib", "4096")
    assert result.exit_code == 0, result.output
    assert "[1/2] CACHED RUN apt-get update" in result.stderr and "[2/2] RUN make" in result.stderr
    assert "compiling" in result.stderr and "cdcdcd" in result.stdout
    body = fake_api.last("/v1/templates").body
    for field_, value in (("name", b"web"), ("build_args", b'{"A": "1"}'), ("ready_port", b"8000"),
                          ("memory_mib", b"1024"), ("vcpus", b"2"), ("disk_mib", b"4096")):
        assert f'name="{field_}"'.encode() + b"\r\n\r\n" + value in body
    assert b"COPY app.txt /app.txt" in body and b'name="context"' in body


def _build_row(state: str, error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": "bld_fake", "name": "base", "state": state, "error": error,
            "created_at": datetime.now(UTC).isoformat()}


def test_a_build_whose_stream_broke_off_is_followed_to_its_end(fake_api: FakeApi, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``podbay down`` or an API restart cuts the stream while the node finishes the build: the client follows
    the build's row and answers as the stream would have."""
    monkeypatch.setattr("podbay.sdk._templates.FOLLOW_POLL_S", 0.01)
    (tmp_path / "Dockerfile").write_text("FROM base\nRUN echo BREAK\n")
    fake_api.build_rows = [[_build_row("running")], [_build_row("running")], [_build_row("succeeded")]]
    result = run(fake_api, "template", "build", "base", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    assert "base" in result.stdout and not fake_api.build_rows[1:]  # polled until it ended
    assert "following build bld_fake" in result.stderr
    fake_api.build_rows = [[_build_row("failed", {"code": "interrupted", "message": "the node agent restarted"})]]
    result = run(fake_api, "template", "build", "base", str(tmp_path))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "error: the node agent restarted (interrupted)"
    monkeypatch.setattr("podbay.sdk._templates.FOLLOW_S", 0.2)
    fake_api.build_rows = [[_build_row("running")]]
    result = run(fake_api, "template", "build", "base", str(tmp_path))
    assert result.exit_code == 1
    last = result.stderr.splitlines()[-1]
    assert last.endswith("(unavailable)") and "bld_fake" in last and "had not ended" in last


def test_template_build_failure_exits_nonzero_with_the_step(fake_api: FakeApi, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM podbay/base\nRUN FAIL\n")
    result = run(fake_api, "template", "build", "web", str(tmp_path))
    assert result.exit_code == 1  # the build ran and failed (docs/cli.md); 2 is for refused input
    assert "RUN make' exited 2" in result.stderr and "build_step_failed" in result.stderr


@pytest.mark.parametrize(("dockerfile", "says"), [
    ("FROM podbay/base\nHEALTHCHECK CMD true\n", "line 2 (HEALTHCHECK): HEALTHCHECK is not supported"),
    ("FROM podbay/base\nCOPY ../etc/passwd /x\n", "line 2 (COPY): '../etc/passwd' points outside the build context"),
])
def test_template_build_refused_dockerfile_exits_2_with_its_code(fake_api: FakeApi, tmp_path: Path, dockerfile: str,
                                                                 says: str) -> None:
    (tmp_path / "Dockerfile").write_text(dockerfile)
    result = run(fake_api, "template", "build", "web", str(tmp_path))
    assert_error_line(result, "invalid_dockerfile", 2)
    assert says in result.stderr


def test_env_prints_exports(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(app, ["--api-url", "http://h:1", "--api-key", "k'ey", "env"])
    assert result.stdout.splitlines() == ["export PODBAY_API_URL=http://h:1", "export PODBAY_API_KEY='k'\"'\"'ey'"]
    assert result.exit_code == 0
    monkeypatch.setenv("PODBAY_API_URL", "http://from-env:2")
    result = CliRunner().invoke(app, ["env"])  # no key anywhere: the URL alone, a warning, exit 1
    assert result.stdout == "export PODBAY_API_URL=http://from-env:2\n"
    assert result.exit_code == 1 and "no API key is configured" in result.stderr
    result = CliRunner().invoke(app, ["env", "--e2b"])
    assert "E2B_API_KEY" not in result.stdout and result.exit_code == 1 and "podbay up" in result.stderr


@dataclass
class _Part:
    name: str
    kind: str
    url: str
    pid: int | None
    answering: bool
    detail: str


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    calls: list[tuple[str, Any]] = []
    parts = [_Part("nats", "server", "nats://127.0.0.1:4222", 10, True, "")]
    mod = types.ModuleType("podbay.devstack.supervisor")
    mod.up = lambda settings, detach: calls.append(("up", detach))  # type: ignore[attr-defined]
    mod.down = lambda settings, purge=False: calls.append(("down", purge))  # type: ignore[attr-defined]
    mod.status = lambda settings: parts  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "podbay.devstack.supervisor", mod)
    import podbay.devstack

    monkeypatch.setattr(podbay.devstack, "supervisor", mod, raising=False)
    return types.SimpleNamespace(calls=calls, parts=parts)


def test_up_down_status(supervisor: types.SimpleNamespace) -> None:
    assert CliRunner().invoke(app, ["up", "--detach"]).exit_code == 0
    assert CliRunner().invoke(app, ["down"]).exit_code == 0
    assert CliRunner().invoke(app, ["down", "--purge"]).exit_code == 0
    assert supervisor.calls == [("up", True), ("down", False), ("down", True)]


def test_up_nodes_reaches_the_supervisor_settings(
        supervisor: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    import podbay.devstack

    seen: list[int] = []
    monkeypatch.setenv("PODBAY_NODES", "1")  # restored after the test, whatever the command sets
    monkeypatch.setattr(podbay.devstack.supervisor, "up", lambda settings, detach: seen.append(settings.nodes))
    assert CliRunner().invoke(app, ["up", "--detach", "--nodes", "2"]).exit_code == 0
    assert seen == [2]
    assert CliRunner().invoke(app, ["up", "--nodes", "65"]).exit_code != 0  # at most 64
    assert CliRunner().invoke(app, ["up", "--nodes", "0"]).exit_code != 0  # at least 1


def test_up_hosts_is_the_node_count(supervisor: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """``podbay up --hosts N`` (issue 42's wording) starts N nodes, each a host of its own namespace."""
    import podbay.devstack

    seen: list[int] = []
    monkeypatch.setenv("PODBAY_NODES", "1")
    monkeypatch.setattr(podbay.devstack.supervisor, "up", lambda settings, detach: seen.append(settings.nodes))
    assert CliRunner().invoke(app, ["up", "--detach", "--hosts", "3"]).exit_code == 0
    assert seen == [3]
    assert CliRunner().invoke(app, ["up", "--hosts", "65"]).exit_code != 0
    helped = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"})
    assert "--hosts" in helped.stdout


def test_up_without_nodes_keeps_the_configured_count_and_says_so(
        supervisor: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    import podbay.devstack

    seen: list[int] = []
    import podbay.config

    monkeypatch.setenv("PODBAY_NODES", "3")
    monkeypatch.setattr(podbay.config, "_settings", None)  # read again, with PODBAY_NODES=3
    monkeypatch.setattr(podbay.devstack.supervisor, "up", lambda settings, detach: seen.append(settings.nodes))
    assert CliRunner().invoke(app, ["up", "--detach"]).exit_code == 0
    assert seen == [3]
    helped = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0
    assert "default: 0" not in helped.stdout and "(default: PODBAY_NODES, else 1)" in helped.stdout


def test_failed_up_exits_non_zero_and_does_not_claim_success(
        supervisor: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    import podbay.devstack

    monkeypatch.setattr(podbay.devstack.supervisor, "up", lambda settings, detach: 1)
    result = CliRunner().invoke(app, ["up", "--detach"])
    assert result.exit_code == 1
    assert "podbay is up" not in result.output
    healthy = CliRunner().invoke(app, ["status"])
    assert healthy.exit_code == 0 and "nats://127.0.0.1:4222" in healthy.stdout
    supervisor.parts.append(_Part("api", "service", "http://127.0.0.1:8080", None, False, "connection refused"))
    sick = CliRunner().invoke(app, ["status", "--json"])
    assert sick.exit_code == 1
    assert [p["answering"] for p in json.loads(sick.stdout)] == [True, False]


def test_status_without_a_stack_says_so(supervisor: types.SimpleNamespace) -> None:
    supervisor.parts.clear()
    result = CliRunner().invoke(app, ["status"])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == "no podbay stack is running (start one with: podbay up)\n"
    as_json = CliRunner().invoke(app, ["status", "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout) == []


def test_status_with_a_dead_supervisor_fails(supervisor: types.SimpleNamespace) -> None:
    supervisor.parts[0] = _Part("nats", "server", "nats://127.0.0.1:4222", 10, True, "running, no supervisor")
    supervisor.parts.append(_Part("api", "service", "http://127.0.0.1:8080", 11, True, "running, no supervisor"))
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 1 and "running, no supervisor" in result.stdout
    assert result.stderr == (
        "the podbay supervisor is not running but nats, api still run without it (stop them with: podbay down)\n"
    )


def test_template_build_checks_the_name_and_shortens_the_builders_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "podbay-nodeagent"
    script.write_text(
        "#!/bin/sh\n"
        "echo 'usage: podbay-nodeagent template build [-h] [--force] {base}' >&2\n"
        "echo \"podbay-nodeagent template build: error: argument name: invalid choice: '$3' (choose from base)\" >&2\n"
        "exit 2\n"
    )
    script.chmod(0o755)
    monkeypatch.setattr(servercli, "nodeagent_binary", lambda: str(script))
    bad = CliRunner().invoke(app, ["template", "build", "Not_A_Name"])
    assert_error_line(bad, "usage", 2)
    assert "'Not_A_Name' is not a template name" in bad.stderr
    unknown = CliRunner().invoke(app, ["template", "build", "nosuch"])
    assert_error_line(unknown, "usage", 2)
    assert unknown.stderr == "error: argument name: invalid choice: 'nosuch' (choose from base) (usage)\n"


def test_template_build_passes_other_stderr_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "podbay-nodeagent"
    script.write_text("#!/bin/sh\necho 'us' >&2\necho 'kernel 100%' >&2\necho 'usage: not argparse' >&2\nexit 2\n")
    script.chmod(0o755)
    monkeypatch.setattr(servercli, "nodeagent_binary", lambda: str(script))
    result = CliRunner().invoke(app, ["template", "build", "base"])
    assert result.exit_code == 2
    assert result.stderr == "us\nkernel 100%\nusage: not argparse\n"


def test_template_build_passes_output_and_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "podbay-nodeagent"
    script.write_text("#!/bin/sh\necho \"built $*\"\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setattr(servercli, "nodeagent_binary", lambda: str(script))
    result = CliRunner().invoke(app, ["template", "build", "base", "--force"])
    assert result.exit_code == 3
    assert "built template build base --force" in capfd.readouterr().out
    monkeypatch.setattr(servercli, "nodeagent_binary", lambda: None)
    assert_error_line(CliRunner().invoke(app, ["template", "build", "base"]), "unavailable", 1)


def test_exit_status() -> None:
    assert [exit_status(c) for c in (0, 3, -9, -15, 256)] == [0, 3, 137, 143, 0]


def test_fork_prints_children_still_starting_and_fails_only_on_failed_ones(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-parent")
    fake_api.fork_outcomes = [("running", None), ("starting", None)]
    result = run(fake_api, "sandbox", "fork", "sb-parent", "--count", "2")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == ["sb-child0", "sb-child1"]
    assert "sb-child1 is still starting" in result.stderr and "None" not in result.stderr
    fake_api.fork_outcomes = [("running", None), ("failed", "no node has room"), ("failed", None)]
    result = run(fake_api, "sandbox", "fork", "sb-parent", "--count", "3")
    assert result.exit_code == 1 and result.stdout.splitlines() == ["sb-child0"]
    assert result.stderr.splitlines() == ["error: child sb-child1 is failed: no node has room",
                                          "error: child sb-child2 is failed"]


def test_env_exports_the_config_file_over_a_stale_environment(clean_env: None, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """After a restart replaced the dev key, ``eval "$(podbay env)"`` in a shell that exported the old one must
    export the new one (docs/cli.md); flags still win over both."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"api_url": "http://127.0.0.1:8080", "api_key": "pb_new"}))
    monkeypatch.setenv("PODBAY_CONFIG", str(cfg))
    monkeypatch.setenv("PODBAY_API_URL", "http://127.0.0.1:8080")
    monkeypatch.setenv("PODBAY_API_KEY", "pb_revoked")
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0
    assert result.stdout.splitlines() == ["export PODBAY_API_URL=http://127.0.0.1:8080", "export PODBAY_API_KEY=pb_new"]
    assert "PODBAY_API_KEY in the environment differs" in result.stderr and "PODBAY_API_URL" not in result.stderr
    result = CliRunner().invoke(app, ["--api-key", "pb_flag", "env"])
    assert result.stdout.splitlines()[1] == "export PODBAY_API_KEY=pb_flag" and "differs" not in result.stderr
    # Other commands keep the environment first.
    assert load_client_config().api_key == "pb_revoked"


def test_env_e2b_prints_the_e2b_variables(clean_env: None) -> None:
    result = CliRunner().invoke(app, ["--api-url", "http://h:1/", "--api-key", "pb_k", "env", "--e2b"])
    assert result.exit_code == 0
    assert result.stdout.splitlines() == ["export E2B_API_URL=http://h:1/e2b", "export E2B_SANDBOX_URL=http://h:1",
                                          "export E2B_VOLUME_API_URL=http://h:1/e2b", "export E2B_API_KEY=pb_k"]


def test_env_e2b_exports_the_stacks_domain_and_trust_for_its_tls_edge(clean_env: None) -> None:
    from podbay.clientconfig import ClientConfig, StackEdge, save_client_config

    save_client_config(ClientConfig(api_url="http://h:1", api_key="pb_k"), StackEdge(
        e2b_domain="e2b.localhost:8443", ca_cert="/d/edge-ca.pem", ca_bundle="/d/edge trust.pem"))
    result = CliRunner().invoke(app, ["env", "--e2b"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[4:] == ["export E2B_DOMAIN=e2b.localhost:8443",
                                              "export SSL_CERT_FILE='/d/edge trust.pem'",
                                              "export REQUESTS_CA_BUNDLE='/d/edge trust.pem'",
                                              "export NODE_EXTRA_CA_CERTS=/d/edge-ca.pem"]
    # Another API (by flag) gets none of this stack's domain or trust.
    result = CliRunner().invoke(app, ["--api-url", "http://other:2", "--api-key", "pb_k", "env", "--e2b"])
    assert result.exit_code == 0 and "E2B_DOMAIN" not in result.stdout and "SSL_CERT_FILE" not in result.stdout
def test_suspend_resume_and_snapshot_promotion_are_shown(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-s")
    result = run(fake_api, "sandbox", "suspend", "sb-s")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "sb-s" and fake_api.sandboxes["sb-s"].state == "suspended"
    assert fake_api.last("/v1/sandboxes/sb-s/suspend").query == {"wait": "true"}
    result = run(fake_api, "sandbox", "resume", "sb-s", "--fallback")
    assert result.exit_code == 0, result.output
    assert fake_api.last("/v1/sandboxes/sb-s/resume").query == {"wait": "true", "fallback": "true"}
    assert fake_api.sandboxes["sb-s"].state == "running"
    table = run(fake_api, "snapshot", "list", "sb-s")
    assert "PROMOTION" in table.stdout and "promoted" in table.stdout
    shown = run(fake_api, "snapshot", "show", "sb-s", "snap-1")
    assert shown.exit_code == 0 and "uploaded_bytes" in shown.stdout and "1048576" in shown.stdout
    missing = run(fake_api, "snapshot", "show", "sb-s", "snap-2")
    assert missing.exit_code != 0 and "snap-2" in missing.output
def test_pool_set_and_list(fake_api: FakeApi) -> None:
    done = run(fake_api, "pool", "set", "base", "--size", "3", "--max", "5")
    assert done.exit_code == 0, done.output
    assert done.stdout == ("base: size 3, max 5 (target now 3, ready 3; targets follow the new bounds within "
                           "seconds)\n")
    assert fake_api.last("/v1/pools/base").json() == {"size": 3, "max_size": 5}
    table = run(fake_api, "pool", "list")
    assert table.exit_code == 0
    assert table.stdout.split("\n")[0].split() == ["TEMPLATE", "SIZE", "NODE", "TARGET", "READY", "PREPARING",
                                                   "CLAIMED", "FAILING"]
    assert table.stdout.split("\n")[1].split() == ["base", "3-5", "node-1", "3", "3", "0", "1", "0"]
    listed = json.loads(run(fake_api, "pool", "list", "--json").stdout)
    assert [(p["template"], p["max_size"]) for p in listed] == [("base", 5)]


def test_node_list_table_and_json(fake_api: FakeApi) -> None:
    table = run(fake_api, "node", "list")
    assert table.exit_code == 0, table.output
    lines = table.stdout.split("\n")
    assert lines[0].split() == ["NODE", "STATE", "SCHEDULABLE", "HEARTBEAT", "ACCEL", "VCPUS", "MEMORY", "MIB", "FREE",
                                "MIB", "ROOM", "MIB", "RUNNING", "PAUSED", "WARM"]
    assert lines[1].split() == ["node-a", "ready", "yes", "0.4s", "tcg", "1/8", "512/2048", "1536", "19066", "1", "1",
                                "0"]
    # A node that is not live has no measured room.
    assert lines[2].split()[:4] == ["node-b", "lost", "no", "expired"] and lines[2].split()[8] == "-"
    listed = json.loads(run(fake_api, "node", "list", "--json").stdout)
    assert [(n["id"], n["state"], n["heartbeat_age_s"]) for n in listed] == [("node-a", "ready", 0.4),
                                                                             ("node-b", "lost", None)]


def test_pool_set_refuses_bad_bounds_before_sending(fake_api: FakeApi) -> None:
    assert_error_line(run(fake_api, "pool", "set", "base", "--size", "3", "--max", "2"), "invalid_request", 2)
    assert not [r for r in fake_api.requests if "/pools" in r.path]
    assert_error_line(run(fake_api, "pool", "set", "nosuch", "--size", "1"), "not_found", 2)


def test_a_waiting_call_the_server_could_not_finish_is_an_error_not_success(fake_api: FakeApi) -> None:
    fake_api.add_sandbox("sb-slow")
    result = run(fake_api, "sandbox", "rm", "sb-slow")
    assert_error_line(result, "timeout", 1)
    assert "op-delete-1" in result.stderr and result.stdout == ""
    # asked not to wait, the 202 is the expected answer
    result = run(fake_api, "sandbox", "rm", "sb-slow", "--no-wait")
    assert result.exit_code == 0 and "op-delete-1" in result.stderr


def test_schedule_add_needs_exactly_one_of_cron_and_at_before_sending(fake_api: FakeApi) -> None:
    for args in ((), ("--cron", "* * * * *", "--at", "2030-01-01T00:00:00Z")):
        result = run(fake_api, "schedule", "add", "sbx_x", *args, "--", "echo", "x")
        assert_error_line(result, "invalid_request", 2)
        assert "--cron" in result.stderr and "--at" in result.stderr, result.stderr
    assert not [r for r in fake_api.requests if "/schedules" in r.path]
