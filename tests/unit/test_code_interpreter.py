"""The code interpreter's pure parts: the server's MIME shaping and env snippets (templates/code-interpreter/
server.py), the SDK's request and NDJSON folding (podbay.sdk._code, through ``Client.run_code`` on a fake
transport), and the CLI's terminal rendering (podbay.cli.run_code)."""

from __future__ import annotations

import base64
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from podbay.cli.run_code import render_error, render_result
from podbay.errors import InvalidRequest, PodbayError
from podbay.sdk import AsyncClient, Client
from podbay.sdk._code import CodeError, CodeExecution, CodeResult, apply_line, run_code_call

SERVER = Path(__file__).resolve().parents[2] / "templates" / "code-interpreter" / "server.py"
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 8


@pytest.fixture(scope="module")
def server() -> ModuleType:
    pytest.importorskip("jupyter_client")
    spec = importlib.util.spec_from_file_location("ci_server", SERVER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ci_server"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_shape_result_names_known_mime_types_and_keeps_the_rest(server: ModuleType) -> None:
    out = server.shape_result({"text/plain": "'abc'", "text/html": "<b>x</b>", "image/png": "iVBO",
                               "application/json": {"a": 1}, "application/vnd.custom+json": {"k": 2}}, True)
    assert out == {"type": "result", "is_main_result": True, "text": "abc", "html": "<b>x</b>", "png": "iVBO",
                   "json": {"a": 1}, "extra": {"application/vnd.custom+json": {"k": 2}}}
    # Only a quoted repr loses its quotes; a display has is_main_result false; nothing empty is added.
    assert server.shape_result({"text/plain": "'a"}, False) == {"type": "result", "is_main_result": False,
                                                                "text": "'a"}


def test_env_code_sets_and_restores(server: ModuleType) -> None:
    env = {"A": "it's \"q\"\n", "B": "2"}
    set_py, undo_py = server.env_code("python", env)
    ns: dict[str, Any] = {}
    import os
    os.environ.pop("A", None)
    os.environ["B"] = "before"
    try:
        exec(set_py, ns)  # noqa: S102 - the snippet is what the kernel runs
        assert os.environ["A"] == env["A"] and os.environ["B"] == "2"
        exec(undo_py, ns)  # noqa: S102
        assert "A" not in os.environ and os.environ["B"] == "before"
    finally:
        os.environ.pop("A", None)
        os.environ.pop("B", None)
    set_sh, undo_sh = server.env_code("bash", {"A": "x'y"})
    assert set_sh == "export A='x'\"'\"'y'" and undo_sh == "unset A"
    assert server.normalize_language(None) == "python" and server.normalize_language(" Sh ") == "bash"


def test_apply_line_folds_outputs_and_calls_handlers() -> None:
    ex = CodeExecution()
    seen: list[Any] = []
    lines = [{"type": "number_of_executions", "execution_count": 3},
             {"type": "stdout", "text": "hi\n", "timestamp": "t"}, {"type": "keepalive"},
             {"type": "stderr", "text": "warn\n"},
             {"type": "result", "is_main_result": True, "text": "2", "json": {"a": 1}, "newfield": 1},
             {"type": "error", "name": "ValueError", "value": "v", "traceback": "tb"},
             {"type": "something_new"}]
    for item in lines:
        ended, _ = apply_line(ex, json.dumps(item), on_stdout=seen.append, on_stderr=seen.append,
                              on_result=seen.append, on_error=seen.append)
        assert not ended
    assert apply_line(ex, "") == (False, None)
    assert apply_line(ex, '{"type": "end_of_execution"}')[0] is True
    assert ex.execution_count == 3 and ex.stdout == ["hi\n"] and ex.stderr == ["warn\n"]
    assert ex.text == "2" and ex.results[0].json_value == {"a": 1} and ex.results[0].formats() == ["text", "json"]
    assert ex.error == CodeError(name="ValueError", value="v", traceback="tb")
    assert seen[:2] == ["hi\n", "warn\n"] and isinstance(seen[2], CodeResult) and seen[3] == ex.error
    with pytest.raises(PodbayError):
        apply_line(ex, "not json")


def test_run_code_call_checks_its_arguments() -> None:
    call = run_code_call("sbx_ab-1", "1", env={"A": "1"}, timeout=2)
    assert call.method == "POST" and call.path == "/ports/49999-sbx-ab-1/execute"
    assert call.json == {"code": "1", "env_vars": {"A": "1"}, "timeout": 2.0}
    assert call.read_timeout_s == 32.0

    class Ctx:
        id = "c1"
    assert run_code_call("s1", "x", context=Ctx()).json == {"code": "x", "context_id": "c1"}
    for bad in ({"language": "python", "context": "c1"}, {"timeout": 0}, {"context": 5}):
        with pytest.raises(InvalidRequest):
            run_code_call("s1", "x", **bad)
    for sid in ("../v1/sandboxes", "a/b", ""):
        with pytest.raises(InvalidRequest):
            run_code_call(sid, "x")


def _transport(seen: list[httpx.Request], body: str, status: int = 200) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, content=body.encode(),
                              headers={"content-type": "application/x-ndjson" if status == 200 else "text/plain"})
    return httpx.MockTransport(handle)


_BODY = "\n".join(json.dumps(x) for x in [
    {"type": "number_of_executions", "execution_count": 1}, {"type": "stdout", "text": "a\n"},
    {"type": "result", "is_main_result": True, "text": "2"}, {"type": "end_of_execution"}]) + "\n"


def test_sync_client_run_code_through_the_port_edge_path() -> None:
    seen: list[httpx.Request] = []
    out: list[str] = []
    with Client("http://api.test", "pb_k", transport=_transport(seen, _BODY)) as c:
        ex = c.run_code("sbx_1", "print('a')\n1+1", language="python", on_stdout=out.append)
    assert ex.text == "2" and ex.stdout == ["a\n"] and out == ["a\n"] and ex.execution_count == 1
    assert seen[0].url.path == "/ports/49999-sbx-1/execute"
    assert seen[0].headers["authorization"] == "Bearer pb_k"
    assert json.loads(seen[0].content) == {"code": "print('a')\n1+1", "language": "python"}
    with Client("http://api.test", "pb_k", transport=_transport([], _BODY.replace('{"type": "end_of_execution"}\n',
                                                                                 ""))) as c:
        with pytest.raises(PodbayError, match="ended its answer early"):
            c.run_code("sbx_1", "1")


async def test_async_client_awaits_coroutine_handlers() -> None:
    got: list[str] = []

    async def on_stdout(text: str) -> None:
        got.append(text)

    async with AsyncClient("http://api.test", "pb_k", transport=_transport([], _BODY)) as c:
        ex = await c.run_code("sbx_1", "x", on_stdout=on_stdout)
    assert got == ["a\n"] and ex.text == "2"


def test_render_result_saves_binary_and_html_and_prints_text(tmp_path: Path) -> None:
    png = CodeResult(png=base64.b64encode(PNG).decode(), text="<Figure size 640x480 with 1 Axes>")
    lines = render_result(png, tmp_path, "result-1-1")
    assert lines[0] == "<Figure size 640x480 with 1 Axes>"
    assert lines[1] == f"[png saved to {tmp_path / 'result-1-1.png'} ({len(PNG)} bytes)]"
    assert (tmp_path / "result-1-1.png").read_bytes() == PNG
    page = CodeResult(html="<table><tr><td>a &amp; b</td></tr></table>" + "<p>x</p>" * 50)
    [note] = render_result(page, tmp_path, "r")
    assert note.startswith(f"[html saved to {tmp_path / 'r.html'} (") and ": a & b x x" in note
    assert note.endswith("…]") and len(note.split(": ", 1)[1]) <= 81
    assert render_result(CodeResult(json={"a": [1, 2]}), tmp_path, "j") == ['{"a":[1,2]}']
    assert render_result(CodeResult(text="t", extra={"application/x-thing": 1}), tmp_path, "e") == [
        "t", "[application/x-thing]"]


def test_render_error_strips_colours_off_a_terminal() -> None:
    err = CodeError(name="NameError", value="x", traceback="\x1b[31mNameError\x1b[39m: x")
    assert render_error(err, colour=False) == "NameError: x"
    assert render_error(err, colour=True) == err.traceback
    assert render_error(CodeError(name="E", value="v"), colour=False) == "E: v"


def test_cli_run_code_reads_stdin_saves_png_and_exits_1_on_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from podbay.cli import _common
    from podbay.cli.main import app
    body = "\n".join(json.dumps(x) for x in [
        {"type": "number_of_executions", "execution_count": 4}, {"type": "stdout", "text": "printed\n"},
        {"type": "result", "is_main_result": False, "png": base64.b64encode(PNG).decode()},
        {"type": "error", "name": "ZeroDivisionError", "value": "division by zero",
         "traceback": "\x1b[31mZeroDivisionError\x1b[39m: division by zero"},
        {"type": "end_of_execution"}]) + "\n"
    seen: list[httpx.Request] = []
    monkeypatch.setattr(_common, "client", lambda ctx: Client("http://api.test", "pb_k",
                                                              transport=_transport(seen, body)))
    monkeypatch.setattr("podbay.cli.run_code.client", _common.client)
    r = CliRunner().invoke(app, ["run-code", "sbx_9", "-", "--out-dir", str(tmp_path), "-e", "K=V"],
                           input="1/0\n")
    assert r.exit_code == 1, r.output
    assert json.loads(seen[0].content) == {"code": "1/0\n", "env_vars": {"K": "V"}}
    assert "printed\n" in r.stdout
    assert f"[png saved to {tmp_path / 'result-4-1.png'} ({len(PNG)} bytes)]" in r.stdout
    assert (tmp_path / "result-4-1.png").read_bytes() == PNG
    assert "ZeroDivisionError: division by zero" in r.stderr
