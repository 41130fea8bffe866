"""The ``podbay`` CLI against the fake API (test_sdk_fake.py): output, exit codes and error lines."""

from __future__ import annotations

import json
import socket
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_sdk_fake import API_KEY, FakeApi, _served, clean_env, fake_api  # noqa: F401  (fixtures)
from typer.testing import CliRunner, Result

from podbay.cli import template as template_cmd
from podbay.cli.exec_cmd import exit_status
from podbay.cli.main import app


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
        result = CliRunner().invoke(app, ["--api-url", url, "sandbox", "list"])
    assert_error_line(result, "unavailable", 1)
    assert url in result.stderr


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


def test_usage_errors_exit_2(fake_api: FakeApi) -> None:
    assert run(fake_api, "exec", "sb-x", "--env", "NOEQUALS", "--", "true").exit_code == 2
    assert run(fake_api, "exec", "sb-x").exit_code == 2
    assert run(fake_api, "files", "write", "sb-x", "/r", "x", "--mode", "999").exit_code == 2


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
    assert absent.exit_code == 2 and "Traceback" not in absent.output


def test_templates_and_operations(fake_api: FakeApi) -> None:
    result = run(fake_api, "template", "list")
    assert result.exit_code == 0 and "base" in result.stdout and "sha256:abab" in result.stdout
    op = json.loads(run(fake_api, "operation", "get", "op-1", "--json").stdout)
    assert (op["id"], op["state"]) == ("op-1", "succeeded")


def test_env_prints_exports(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(app, ["--api-url", "http://h:1", "--api-key", "k'ey", "env"])
    assert result.stdout.splitlines() == ["export PODBAY_API_URL=http://h:1", "export PODBAY_API_KEY='k'\"'\"'ey'"]
    monkeypatch.setenv("PODBAY_API_URL", "http://from-env:2")
    assert CliRunner().invoke(app, ["env"]).stdout == "export PODBAY_API_URL=http://from-env:2\n"


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
    mod.down = lambda settings: calls.append(("down", None))  # type: ignore[attr-defined]
    mod.status = lambda settings: parts  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "podbay.devstack.supervisor", mod)
    import podbay.devstack

    monkeypatch.setattr(podbay.devstack, "supervisor", mod, raising=False)
    return types.SimpleNamespace(calls=calls, parts=parts)


def test_up_down_status(supervisor: types.SimpleNamespace) -> None:
    assert CliRunner().invoke(app, ["up", "--detach"]).exit_code == 0
    assert CliRunner().invoke(app, ["down"]).exit_code == 0
    assert supervisor.calls == [("up", True), ("down", None)]
    healthy = CliRunner().invoke(app, ["status"])
    assert healthy.exit_code == 0 and "nats://127.0.0.1:4222" in healthy.stdout
    supervisor.parts.append(_Part("api", "service", "http://127.0.0.1:8080", None, False, "connection refused"))
    sick = CliRunner().invoke(app, ["status", "--json"])
    assert sick.exit_code == 1
    assert [p["answering"] for p in json.loads(sick.stdout)] == [True, False]


def test_template_build_passes_output_and_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "podbay-nodeagent"
    script.write_text("#!/bin/sh\necho \"built $*\"\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setattr(template_cmd, "nodeagent_binary", lambda: str(script))
    result = CliRunner().invoke(app, ["template", "build", "base", "--force"])
    assert result.exit_code == 3
    assert "built template build base --force" in capfd.readouterr().out
    monkeypatch.setattr(template_cmd, "nodeagent_binary", lambda: None)
    assert_error_line(CliRunner().invoke(app, ["template", "build", "base"]), "unavailable", 1)


def test_exit_status() -> None:
    assert [exit_status(c) for c in (0, 3, -9, -15, 256)] == [0, 3, 137, 143, 0]
