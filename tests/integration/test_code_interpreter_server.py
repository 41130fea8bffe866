"""podbay's code-interpreter server (templates/code-interpreter/server.py) on the host, with real Jupyter kernels
(ipykernel, bash_kernel), driven by the unmodified ``e2b-code-interpreter`` SDK (its ``Sandbox`` pointed at the
server with ``sandbox_url``, as ``E2B_SANDBOX_URL`` does through podbay's port edge) and by raw HTTP where the SDK
has no call (the server-side ``timeout``, keepalives, 4xx answers).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from podbay.devstack.procs import free_port

pytest.importorskip("ipykernel")
pytest.importorskip("jupyter_client")
eci = pytest.importorskip("e2b_code_interpreter")

SERVER = Path(__file__).resolve().parents[2] / "templates" / "code-interpreter" / "server.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, default cwd) of a server started as the template starts it, on a free loopback port."""
    cwd = tmp_path_factory.mktemp("ci-home")
    port = free_port()
    log = (cwd.parent / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(port),
                             "--cwd", str(cwd)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (cwd.parent / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).json() == "OK":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health"
            time.sleep(0.2)
        yield url, cwd
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def sbx(server: tuple[str, Path]) -> Any:
    """The SDK's own ``Sandbox``, unmodified, whose code-interpreter URL is the server (``sandbox_url``)."""
    from e2b import ConnectionConfig
    from packaging.version import Version
    cfg = ConnectionConfig(api_key="e2b_unused", sandbox_url=server[0], request_timeout=60)
    return eci.Sandbox(sandbox_id="local", sandbox_domain=None, envd_version=Version("0.5.0"),
                       envd_access_token=None, traffic_access_token=None, connection_config=cfg)


def _lines(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/execute", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def test_plain_code_result_stdout_and_count(sbx: Any) -> None:
    ex = sbx.run_code("print('hello')\n21 * 2")
    assert ex.text == "42"
    assert ex.logs.stdout == ["hello\n"]
    assert ex.error is None
    assert isinstance(ex.execution_count, int) and ex.execution_count >= 1
    after = sbx.run_code("'text'")
    assert after.text == "text"  # a str's repr loses its quotes, as E2B's server does
    assert after.execution_count == ex.execution_count + 1


def test_state_persists_between_runs(sbx: Any) -> None:
    sbx.run_code("x = 41")
    assert sbx.run_code("x + 1").text == "42"


def test_error_has_name_value_and_traceback(sbx: Any) -> None:
    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error is not None
    assert ex.error.name == "ValueError"
    assert ex.error.value == "bad value"
    assert "bad value" in ex.error.traceback and "f()" in ex.error.traceback
    assert ex.results == []


def test_matplotlib_png_and_rich_mime(sbx: Any) -> None:
    ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.show()")
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert pngs, [r.formats() for r in ex.results]
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)
    html = sbx.run_code("from IPython.display import HTML, JSON, display\n"
                        "display(HTML('<b>bold</b>'))\ndisplay(JSON({'a': 1}))")
    assert [r.html for r in html.results if r.html] == ["<b>bold</b>"]
    assert [r.json for r in html.results if r.json] == [{"a": 1}]
    assert all(not r.is_main_result for r in html.results)


def test_a_dataframe_result_has_data(sbx: Any) -> None:
    """E2B's ``Result.data`` of a pandas DataFrame: ``{column: [values]}``, timestamps in ISO 8601 (as E2B's
    own ``test_data``, indented code included); other results have none, and no name is left in the kernel."""
    ex = sbx.run_code("\n        import pandas as pd\n        pd.DataFrame({'a': [1, 2, 3], "
                      "'t': pd.to_datetime(['2026-01-02'] * 3)})\n        ")
    assert ex.error is None, ex.error
    data = ex.results[0].data
    assert data == {"a": [1, 2, 3], "t": ["2026-01-02T00:00:00"] * 3}
    assert sbx.run_code("1 + 1").results[0].data is None
    assert sbx.run_code("'_pb_setup' in dir()").text == "False"


def test_streaming_callbacks_arrive_in_order(sbx: Any) -> None:
    out: list[str] = []
    err: list[str] = []
    results: list[Any] = []
    sbx.run_code("import sys, time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.1)\n"
                 "print('e', file=sys.stderr)\n7", on_stdout=lambda m: out.append(m.line),
                 on_stderr=lambda m: err.append(m.line), on_result=results.append)
    assert "".join(out) == "0\n1\n2\n"
    assert "".join(err) == "e\n"
    assert [r.text for r in results] == ["7"]


def test_env_vars_hold_for_one_execution(sbx: Any) -> None:
    sbx.run_code("import os; os.environ['KEEP'] = 'k'")
    ex = sbx.run_code("import os; print(os.environ.get('ONLY_NOW'), os.environ['KEEP'])",
                      envs={"ONLY_NOW": "it's \"quoted\"", "KEEP": "over"})
    assert ex.logs.stdout == ["it's \"quoted\" over\n"]
    again = sbx.run_code("import os; print(os.environ.get('ONLY_NOW'), os.environ['KEEP'])")
    assert again.logs.stdout == ["None k\n"]  # removed, and the overridden one restored


def test_create_time_env_is_the_contexts_lasting_environment(server: tuple[str, Path]) -> None:
    """The port edge's ``x-podbay-sandbox-env`` (E2B's ``Sandbox.create(envs=...)``) is set in a kernel before
    its first execution and stays; a per-execution value of the same name overrides it once, then it is back
    (Python and Bash); a restarted kernel gets it again; names that are not variable names are ignored."""
    url = server[0]
    hdr = {"x-podbay-sandbox-env": json.dumps({"CREATED": "at create é", "SHARED": "global", "A;B": "x"})}
    for language, show, show_shared in (
            ("python", "import os; print(os.environ.get('CREATED'))",
             "import os; print(os.environ.get('SHARED'))"),
            ("bash", 'echo "$CREATED"', 'echo "$SHARED"')):
        cid = httpx.post(f"{url}/contexts", json={"language": language}, timeout=120).json()["id"]

        def out(code: str, env: dict[str, str] | None = None, *, cid: str = cid) -> str:
            lines = _lines(url, {"code": code, "context_id": cid, "env_vars": env}, hdr)
            assert not [x for x in lines if x["type"] == "error"], lines
            return "".join(x["text"] for x in lines if x["type"] == "stdout")

        assert out(show) == "at create é\n", language
        assert out(show_shared, {"SHARED": "per run"}) == "per run\n", language
        assert out(show_shared) == "global\n", language
        # Later requests without the header keep what the kernel has.
        assert "".join(x.get("text", "") for x in _lines(url, {"code": show, "context_id": cid})
                       if x["type"] == "stdout") == "at create é\n"
        assert httpx.post(f"{url}/contexts/{cid}/restart", timeout=120).status_code == 200
        assert out(show) == "at create é\n", language
        httpx.delete(f"{url}/contexts/{cid}", timeout=60)


def test_contexts_cwd_language_restart_delete(sbx: Any, server: tuple[str, Path], tmp_path: Path) -> None:
    ctx = sbx.create_code_context(cwd=str(tmp_path))
    assert ctx.language == "python" and ctx.cwd == str(tmp_path)
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == str(tmp_path)
    sbx.run_code("y = 5", context=ctx)
    assert sbx.run_code("'y' in globals()").text == "False"  # the default context is another kernel
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("'y' in globals()", context=ctx).text == "False"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == str(tmp_path)
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(eci.NotFoundException if hasattr(eci, "NotFoundException") else Exception):
        sbx.run_code("1", context=ctx)
    bash = sbx.run_code("echo $((6 * 7)); pwd", language="bash")
    assert bash.logs.stdout and "".join(bash.logs.stdout).split() == ["42", str(server[1])]


def test_sdk_timeout_interrupts_a_busy_loop(sbx: Any) -> None:
    ctx = sbx.create_code_context()
    with pytest.raises(eci.TimeoutException if hasattr(eci, "TimeoutException") else Exception):
        sbx.run_code("n = 0\nwhile True:\n    n += 1", context=ctx, timeout=3)
    # The client went away: the server interrupted the kernel, so the context answers again.
    ex = sbx.run_code("n > 0", context=ctx, timeout=120)
    assert ex.text == "True"


def test_server_side_timeout_and_http_errors(server: tuple[str, Path]) -> None:
    url = server[0]
    lines = _lines(url, {"code": "import time\nwhile True: time.sleep(0.05)", "timeout": 2})
    errors = [x for x in lines if x["type"] == "error"]
    assert len(errors) == 1 and errors[0]["name"] == "TimeoutError", lines
    assert lines[-1] == {"type": "end_of_execution"}
    assert _lines(url, {"code": "1 + 1"})[-2:] == [
        {"type": "result", "is_main_result": True, "text": "2"}, {"type": "end_of_execution"}]
    r = httpx.post(f"{url}/execute", json={"code": "1", "context_id": "x", "language": "python"})
    assert r.status_code == 400
    assert httpx.post(f"{url}/execute", json={"code": "1", "context_id": "nope"}).status_code == 404
    assert httpx.post(f"{url}/execute", json={"code": "1", "env_vars": {"A;B": "1"}}).status_code == 400
    assert httpx.post(f"{url}/execute", json={"code": "1", "language": "cobol"}).status_code == 400
    assert httpx.delete(f"{url}/contexts/nope").status_code == 404
    assert httpx.post(f"{url}/contexts/nope/restart").status_code == 404


def test_a_restore_is_told_by_the_wall_clock_running_ahead() -> None:
    """The server warms its default kernel after a restore from a snapshot (``warm_after_restore``), which it
    tells by the wall clock (set by guestd after the restore) moving ahead of the monotonic one."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ci_server", SERVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.restored((1000.0, 50.0), (1001.0, 51.0))  # both moved one second: running on
    assert not mod.restored((1000.0, 50.0), (1003.0, 51.0), jump_s=5.0)  # NTP-sized steps are not restores
    assert mod.restored((1000.0, 50.0), (87400.0, 51.0))  # the wall clock jumped a day: restored
