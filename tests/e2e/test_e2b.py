"""The unmodified ``e2b`` SDK (pinned in pyproject's test extra) against the real stack and microVMs.

The SDK is pointed at podbay the way docs/e2b.md says: ``E2B_API_URL=<api>/e2b``, ``E2B_SANDBOX_URL=<api>``
(envd traffic routed by the ``E2b-Sandbox-Id`` header) and a podbay API key as ``E2B_API_KEY``.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

e2b = pytest.importorskip("e2b")


@pytest.fixture(scope="module")
def e2b_env(stack: Any) -> Iterator[dict[str, str]]:
    """The E2B_* variables that point the SDK at the stack (what ``podbay env --e2b`` prints)."""
    env = {"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_SANDBOX_URL": stack.api_url, "E2B_API_KEY": stack.api_key}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    yield env
    mp.undo()


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str]) -> Iterator[Any]:
    sb = e2b.Sandbox.create(template="base", timeout=600)
    try:
        yield sb
    finally:
        try:
            sb.kill()
        except Exception:  # noqa: BLE001 - a test may have killed it already
            pass


def test_commands_run_stdout_stderr_and_exit_codes(sbx: Any) -> None:
    r = sbx.commands.run("echo hello; echo oops >&2; whoami; pwd; echo $0")
    assert r.exit_code == 0
    assert r.stdout.splitlines() == ["hello", "user", "/home/user", "/bin/bash"]
    assert r.stderr == "oops\n"
    with pytest.raises(e2b.CommandExitException) as err:
        sbx.commands.run("echo partial; exit 3")
    assert err.value.exit_code == 3 and err.value.stdout == "partial\n"
    root = sbx.commands.run("id -u", user="root")
    assert root.stdout.strip() == "0"
    seen: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo line$i; done", on_stdout=seen.append)
    assert "".join(seen) == "line1\nline2\nline3\n"
    env = sbx.commands.run("echo $FOO", envs={"FOO": "bar"}, cwd="/tmp")
    assert env.stdout == "bar\n"
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("echo started; sleep 120", timeout=3)


def test_background_command_stdin_list_and_kill(sbx: Any) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, "from stdin\n")
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.exit_code == 0 and result.stdout == "from stdin\n"

    sleeper = sbx.commands.run("sleep 300", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert listed[sleeper.pid].cmd == "/bin/bash" and listed[sleeper.pid].args == ["-l", "-c", "sleep 300"]
    # A second client attaches to the running process.
    other = sbx.commands.connect(sleeper.pid)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(e2b.CommandExitException):
        other.wait()
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is False  # NOT_FOUND


def test_pty_create_input_resize_and_exit(sbx: Any) -> None:
    handle = sbx.pty.create(e2b.PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(handle.pid, b"stty size; tty; whoami; echo mark-$((40+2))\n")
    out = bytearray()
    for _, _, pty in handle:  # the first command's answer before the resize
        out.extend(pty or b"")
        if b"mark-42" in out:
            break
    sbx.pty.resize(handle.pid, e2b.PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(handle.pid, b"stty size; exit 5\n")
    with pytest.raises(e2b.CommandExitException) as err:
        handle.wait(on_pty=out.extend)
    assert err.value.exit_code == 5
    text = out.decode(errors="replace")
    assert "30 100" in text and "40 120" in text and "/dev/pts/" in text and "\nuser\r" in text


def test_files(sbx: Any) -> None:
    info = sbx.files.write("notes/a.txt", "hello files")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("/home/user/notes/a.txt") == "hello files"
    assert sbx.files.read("notes/a.txt", format="bytes") == b"hello files"
    owner = sbx.commands.run("stat -c %U /home/user/notes /home/user/notes/a.txt")
    assert owner.stdout.split() == ["user", "user"]
    assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("notes/missing.txt")
    assert sbx.files.make_dir("/home/user/dir/sub") is True
    assert sbx.files.make_dir("/home/user/dir/sub") is False  # ALREADY_EXISTS
    sbx.files.write_files([{"path": "/home/user/dir/x.bin", "data": bytes(range(256))},
                           {"path": "/home/user/dir/sub/y.txt", "data": "y"}])
    names = sorted(e.name for e in sbx.files.list("/home/user/dir"))
    assert names == ["sub", "x.bin"]
    deep = sorted(e.path for e in sbx.files.list("/home/user/dir", depth=2))
    assert deep == ["/home/user/dir/sub", "/home/user/dir/sub/y.txt", "/home/user/dir/x.bin"]
    x = sbx.files.get_info("/home/user/dir/x.bin")
    assert x.size == 256 and x.type == e2b.FileType.FILE and x.owner == "user"
    moved = sbx.files.rename("/home/user/dir/x.bin", "/home/user/dir/z.bin")
    assert moved.path == "/home/user/dir/z.bin"
    assert sbx.files.read("/home/user/dir/z.bin", format="bytes") == bytes(range(256))
    # A file-like body goes up as application/octet-stream (streamed), and gzip-compressed when asked.
    sbx.files.write("/home/user/dir/stream.bin", io.BytesIO(b"\x00" * 100_000 + b"end"))
    sbx.files.write("/home/user/dir/zipped.txt", "compressed " * 1000, gzip=True)
    assert sbx.files.read("/home/user/dir/stream.bin", format="bytes") == b"\x00" * 100_000 + b"end"
    assert sbx.files.read("/home/user/dir/zipped.txt") == "compressed " * 1000
    sbx.files.remove("/home/user/dir")
    assert not sbx.files.exists("/home/user/dir")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("/home/user/dir/z.bin")
    with pytest.raises(e2b.NotFoundException):
        sbx.files.get_info("/nope")


def test_watch_dir_sync_and_async(sbx: Any) -> None:
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    sbx.files.write("/home/user/watched/new.txt", "x")
    events: list[Any] = []
    for _ in range(100):
        events += handle.get_new_events()
        if any(e.name == "new.txt" and e.type == e2b.FilesystemEventType.CREATE for e in events):
            break
        time.sleep(0.1)
    handle.stop()
    assert any(e.name == "new.txt" and e.type == e2b.FilesystemEventType.CREATE for e in events)

    async def go() -> list[Any]:
        sb = await e2b.AsyncSandbox.connect(sbx.sandbox_id)
        got: list[Any] = []
        done = asyncio.Event()

        def on_event(ev: Any) -> None:
            got.append(ev)
            if ev.name == "async.txt":
                done.set()

        w = await sb.files.watch_dir("/home/user/watched", on_event=on_event)
        await sb.files.write("/home/user/watched/async.txt", "y")
        await asyncio.wait_for(done.wait(), 30)
        await w.stop()
        return got

    got = asyncio.run(go())
    assert any(e.name == "async.txt" for e in got)


def _podbay_id(sb: Any) -> str:
    """The podbay id (``sbx_...``, as podbay's own API takes it) of an E2B sandbox, whose ``sandbox_id`` is E2B's
    spelling (``sbx-...``, a host label: podbay.naming.e2b_sandbox_id)."""
    return str(sb.sandbox_id).replace("-", "_", 1)


def _envd_token(stack: Any, sandbox_id: str) -> str:
    """The sandbox's envd access token, as E2B's REST API hands it out."""
    import httpx

    r = httpx.get(f"{stack.api_url}/e2b/sandboxes/{sandbox_id}", headers={"X-API-KEY": stack.api_key})
    return str(r.json()["envdAccessToken"])


def test_envd_access_needs_the_sandbox_token(sbx: Any, e2b_env: dict[str, str], stack: Any) -> None:
    import httpx

    url = f"{e2b_env['E2B_SANDBOX_URL']}/filesystem.Filesystem/Stat"
    body = {"path": "/home/user"}
    ok = httpx.post(url, json=body, headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                             "X-Access-Token": _envd_token(stack, sbx.sandbox_id)})
    assert ok.status_code == 200 and ok.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    bad = httpx.post(url, json=body, headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "x"})
    assert bad.status_code == 401


def test_pause_then_connect_resumes_with_files_and_processes(e2b_env: dict[str, str]) -> None:
    sb = e2b.Sandbox.create(template="base", timeout=600)
    try:
        sb.files.write("/home/user/keep.txt", "still here")
        bg = sb.commands.run("sleep 600", background=True)
        sb.pause()
        info = e2b.Sandbox.get_info(sb.sandbox_id)
        assert info.state == e2b.SandboxState.PAUSED
        # Long enough for the node to release the paused VM's RAM (PODBAY_PAUSED_RELEASE_S=6 in tests):
        # the guest channel is new after the resume, and the node finds the process again in guestd.
        time.sleep(8)
        again = e2b.Sandbox.connect(sb.sandbox_id)
        assert e2b.Sandbox.get_info(sb.sandbox_id).state == e2b.SandboxState.RUNNING
        assert again.files.read("/home/user/keep.txt") == "still here"
        assert bg.pid in [p.pid for p in again.commands.list()]
        assert again.commands.run("echo alive").stdout == "alive\n"
        assert again.commands.kill(bg.pid) is True
    finally:
        sb.kill()


def test_list_get_info_envs_timeout_metrics_and_kill(e2b_env: dict[str, str]) -> None:
    a = e2b.Sandbox.create(template="base", metadata={"suite": "e2b-list"}, envs={"GREETING": "hello"})
    b = e2b.Sandbox.create(template="base", metadata={"suite": "e2b-list"})
    try:
        page = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "e2b-list"}), limit=1)
        first = page.next_items()
        assert len(first) == 1 and page.has_next
        second = page.next_items()
        assert {s.sandbox_id for s in first + second} == {a.sandbox_id, b.sandbox_id}
        q = e2b.SandboxQuery(metadata={"suite": "e2b-list"})
        asc = [s.sandbox_id for s in e2b.Sandbox.list(query=q, order="asc").next_items()]
        desc = [s.sandbox_id for s in e2b.Sandbox.list(query=q, order="desc").next_items()]
        assert asc == [a.sandbox_id, b.sandbox_id] and desc == [b.sandbox_id, a.sandbox_id]
        info = a.get_info()
        assert info.template_id == "base" and info.metadata == {"suite": "e2b-list"}
        before = info.end_at
        a.set_timeout(7200)
        assert a.get_info().end_at > before  # the lease now runs out later
        assert a.is_running()
        # envVars of the create are every command's default environment; a command's own envs win.
        assert a.commands.run("echo $GREETING").stdout == "hello\n"
        assert a.commands.run("echo $GREETING", envs={"GREETING": "own"}).stdout == "own\n"
        assert b.commands.run("echo ${GREETING:-unset}").stdout == "unset\n"
        sample = a.get_metrics()
        assert len(sample) == 1 and sample[0].cpu_count >= 1
        assert 0 < sample[0].mem_used < sample[0].mem_total and 0 < sample[0].disk_used < sample[0].disk_total
        a.kill()
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.get_info(a.sandbox_id)
        assert e2b.Sandbox.kill(a.sandbox_id) is False
    finally:
        for s in (a, b):
            try:
                s.kill()
            except Exception:  # noqa: BLE001
                pass


def test_bad_key_and_unknown_template(e2b_env: dict[str, str]) -> None:
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create(template="base", api_key="pb_00000000_" + "0" * 40)
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.create(template="no-such-template")


def test_rest_error_shape_and_status_codes(stack: Any) -> None:
    import httpx

    api = httpx.Client(base_url=f"{stack.api_url}/e2b", headers={"X-API-KEY": stack.api_key}, timeout=60)
    r = httpx.get(f"{stack.api_url}/e2b/v2/sandboxes", headers={"X-API-KEY": "pb_00000000_" + "0" * 40})
    assert r.status_code == 401 and r.json()["code"] == 401 and r.json()["message"]
    r = api.get("/sandboxes/sbx_missing")
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "sandbox sbx_missing was not found"}
    r = api.post("/v2/sandboxes", json={"timeout": 60})
    assert r.status_code == 400 and r.json()["code"] == 400 and "templateID" in r.json()["message"]
    r = api.post("/sandboxes", json={"templateID": "base", "metadata": {"k": "v" * 1025}})
    assert r.status_code == 400 and r.json()["code"] == 400 and "metadata" in r.json()["message"], r.text
    r = api.post("/sandboxes", json={"templateID": "no/such template"})
    assert r.status_code == 400 and r.json()["code"] == 400, r.text
    r = api.get("/v2/sandboxes", params={"state": "deleted"})
    assert r.status_code == 400
    r = api.get("/v2/sandboxes", params={"nextToken": "garbage"})
    assert r.status_code == 400
    r = api.post("/sandboxes/sbx_missing/pause")
    assert r.status_code == 404
    for method, url in (("GET", "/sandboxes/%00"), ("DELETE", "/sandboxes/%00")):
        r = api.request(method, url)
        assert r.status_code == 400 and r.json()["code"] == 400 and "NUL" in r.json()["message"], (url, r.text)
    envd = httpx.post(f"{stack.api_url}/filesystem.Filesystem/Stat", json={"path": "/"},
                      headers={"E2b-Sandbox-Id": "sbx_missing", "X-Access-Token": "x"})
    assert envd.status_code == 401


def test_envd_routing_by_host_name(sbx: Any, stack: Any) -> None:
    import httpx

    host = f"49983-{sbx.sandbox_id}.{stack.env['PODBAY_E2B_DOMAIN']}"
    token = {"X-Access-Token": _envd_token(stack, sbx.sandbox_id)}
    r = httpx.post(f"{stack.api_url}/filesystem.Filesystem/Stat", json={"path": "/home/user"},
                   headers={"Host": host, **token})
    assert r.status_code == 200 and r.json()["entry"]["path"] == "/home/user"
    r = httpx.get(f"{stack.api_url}/health", headers={"Host": host, **token})
    assert r.status_code == 204
    # Hosts for other ports belong to the ports edge (tests/e2e/test_ports.py); a port nothing listens on
    # gets E2B's own answer: JSON for a program, the "Closed Port Error" page for a browser.
    closed = {"Host": f"3999-{sbx.sandbox_id}.{stack.env['PODBAY_E2B_DOMAIN']}"}
    r = httpx.get(f"{stack.api_url}/", headers=closed, timeout=60)
    assert r.status_code == 502 and r.headers["content-type"] == "application/json; charset=utf-8", r.text
    assert r.json() == {"message": "The sandbox is running but port is not open", "sandboxId": sbx.sandbox_id,
                        "port": 3999, "code": 502}
    browser = "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0 Safari/537.36"
    r = httpx.get(f"{stack.api_url}/", headers={**closed, "User-Agent": browser}, timeout=60)
    assert r.status_code == 502 and "<title>Closed Port Error</title>" in r.text, r.text
    # The API itself still answers on its own host names.
    assert httpx.get(f"{stack.api_url}/healthz").status_code == 200


def test_v1_paths(stack: Any) -> None:
    import httpx

    api = httpx.Client(base_url=f"{stack.api_url}/e2b", headers={"X-API-KEY": stack.api_key}, timeout=120)
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 300, "metadata": {"suite": "v1"}})
    assert r.status_code == 201
    created = r.json()
    sid = created["sandboxID"]
    assert created["templateID"] == "base" and created["envdVersion"] and created["envdAccessToken"]
    try:
        listed = api.get("/sandboxes", params={"metadata": "suite=v1"}).json()
        assert [s["sandboxID"] for s in listed] == [sid] and listed[0]["state"] == "running"
        assert api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300}).status_code == 200  # running
        assert api.post(f"/sandboxes/{sid}/resume", json={}).status_code == 409  # not paused
        assert api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 60}).status_code == 204
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 409  # already paused
        assert api.get(f"/sandboxes/{sid}/metrics").json() == []  # no sample while paused
        r = api.post(f"/sandboxes/{sid}/resume", json={})
        assert r.status_code == 201 and r.json()["sandboxID"] == sid
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.delete(f"/sandboxes/{sid}").status_code == 404


def test_unknown_route_and_key_alias(sbx: Any, stack: Any) -> None:
    import httpx

    from podbay.contracts.e2b import to_e2b_key

    r = httpx.get(f"{stack.api_url}/e2b/no/such/route", headers={"X-API-KEY": stack.api_key})
    assert r.status_code == 404 and r.json()["code"] == 404 and r.json()["message"]
    alias = to_e2b_key(stack.api_key)
    assert alias.startswith("e2b_") and alias != stack.api_key
    assert e2b.Sandbox.get_info(sbx.sandbox_id, api_key=alias).sandbox_id == sbx.sandbox_id


def test_health_probes_renew_nothing_and_connect_only_extends(sbx: Any) -> None:
    end = sbx.get_info().end_at
    for _ in range(3):
        assert sbx.is_running()
    assert sbx.get_info().end_at == end
    # sbx's lease (600 s) ends later than 60 s from now: connect keeps it.
    e2b.Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert sbx.get_info().end_at == end
    e2b.Sandbox.connect(sbx.sandbox_id, timeout=1200)
    assert sbx.get_info().end_at > end


def test_commands_cwd_pty_kill_files_remove_and_parents(sbx: Any, stack: Any) -> None:
    import httpx

    sbx.files.make_dir("rel/dir")
    assert sbx.commands.run("pwd", cwd="rel/dir").stdout == "/home/user/rel/dir\n"
    handle = sbx.pty.create(e2b.PtySize(rows=24, cols=80))
    assert sbx.pty.kill(handle.pid) is True
    with pytest.raises(e2b.CommandExitException):
        handle.wait()
    assert handle.pid not in [p.pid for p in sbx.commands.list()]
    sbx.files.remove("/home/user/never/was")  # no error, as in envd
    # podbay's own files API makes missing parents too.
    r = httpx.put(f"{stack.api_url}/v1/sandboxes/{_podbay_id(sbx)}/files", params={"path": "/tmp/p/q/r.txt"},
                  content=b"deep", headers={"Authorization": f"Bearer {stack.api_key}"})
    assert r.status_code == 200, r.text
    assert sbx.commands.run("cat /tmp/p/q/r.txt").stdout == "deep"


def test_short_timeout_listing_filters_metrics_history_and_network(e2b_env: dict[str, str], stack: Any) -> None:
    from datetime import UTC, datetime, timedelta

    import httpx

    before = datetime.now(UTC) - timedelta(seconds=5)
    a = e2b.Sandbox.create(template="base", timeout=600, metadata={"suite": "e2b-filters"},
                           allow_internet_access=False)
    try:
        # E2B's network options are the sandbox's podbay egress policy, which the gateway enforces.
        podbay = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {stack.api_key}"})
        policy = podbay.get(f"/v1/sandboxes/{_podbay_id(a)}/network").json()
        assert policy["source"] == "sandbox" and policy["policy"] == {"allow": [], "deny": []}, policy
        a.update_network({"allow_out": ["example.com"], "deny_out": ["0.0.0.0/0"],
                          "rules": {"example.com": [{"transform": {"headers": {"X-Team": "blue"}}}]}})
        policy = podbay.get(f"/v1/sandboxes/{_podbay_id(a)}/network").json()
        # A domain in allow_out opens E2B's default DNS server too; rules are the gateway's header transforms.
        assert [(r["domain"], r["cidr"]) for r in policy["policy"]["allow"]] == [
            ("example.com", None), (None, "8.8.8.8/32")], policy
        assert policy["policy"]["transforms"] == [{"domain": "example.com", "headers": {"X-Team": "blue"}}]
        with pytest.raises(e2b.SandboxException, match="egressProxy"):
            a.update_network({"egress_proxy": {"address": "proxy.example.com:1080"}})
        a.set_timeout(3)  # E2B honours timeouts under 10 s
        assert a.get_info().end_at < datetime.now(UTC) + timedelta(seconds=9)
        a.set_timeout(600)
        q = e2b.SandboxQuery(metadata={"suite": "e2b-filters"}, template="base", started_after=before)
        assert [s.sandbox_id for s in e2b.Sandbox.list(query=q).next_items()] == [a.sandbox_id]
        none = e2b.SandboxQuery(metadata={"suite": "e2b-filters"}, template="other")
        assert e2b.Sandbox.list(query=none).next_items() == []
        later = e2b.SandboxQuery(metadata={"suite": "e2b-filters"}, started_after=datetime.now(UTC) + timedelta(hours=1))
        assert e2b.Sandbox.list(query=later).next_items() == []
        first = a.get_metrics()
        time.sleep(1.1)  # samples are at most one a second
        both = a.get_metrics()
        assert len(first) == 1 and len(both) == 2 and both[0].timestamp == first[0].timestamp
        since = [m.timestamp for m in a.get_metrics(start=both[1].timestamp)]
        assert both[1].timestamp in since and first[0].timestamp not in since
        assert a.get_metrics(end=first[0].timestamp - timedelta(seconds=5)) == []
    finally:
        a.kill()


def test_killed_mid_command_raises_sandbox_not_running(e2b_env: dict[str, str]) -> None:
    sb = e2b.Sandbox.create(template="base", timeout=300)
    try:
        handle = sb.commands.run("sleep 120", background=True)
        e2b.Sandbox.kill(sb.sandbox_id)
        with pytest.raises(e2b.SandboxNotRunningException):
            handle.wait()
    finally:
        e2b.Sandbox.kill(sb.sandbox_id)


def test_killed_while_a_command_streams_ends_it_with_end_of_life(e2b_env: dict[str, str]) -> None:
    """A foreground command whose sandbox is killed meanwhile: the SDK's "killed or reached its end of life"
    error (an UNAVAILABLE stream end, then a health probe answering 502), not a channel error."""
    import threading

    sb = e2b.Sandbox.create(template="base", timeout=300)
    try:
        started = time.monotonic()
        killer = threading.Timer(3.0, lambda: e2b.Sandbox.kill(sb.sandbox_id))
        killer.start()
        with pytest.raises(e2b.SandboxNotRunningException, match="killed or reached its end of life"):
            sb.commands.run("echo started; sleep 120")
        killer.join()
        assert time.monotonic() - started < 60
    finally:
        e2b.Sandbox.kill(sb.sandbox_id)


def test_set_timeout_runs_out_on_time(e2b_env: dict[str, str]) -> None:
    """``set_timeout(5)``, then 6 s later ``is_running()`` is False (the node's lease loop wakes at the
    deadline, not at its next periodic pass)."""
    sb = e2b.Sandbox.create(template="base", timeout=300)
    try:
        sb.set_timeout(5)
        time.sleep(6)
        assert sb.is_running() is False
    finally:
        e2b.Sandbox.kill(sb.sandbox_id)


def test_a_command_past_its_timeout_is_killed_with_its_group(sbx: Any, stack: Any) -> None:
    """E2B #500: a command whose ``timeout`` passes is killed, children included; podbay's exec
    ``timeout_s`` likewise (guestd kills the group)."""
    started = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 301 & sleep 302; echo never", timeout=3)
    assert time.monotonic() - started < 30
    left = "pgrep -f 'sleep 30[12]' || echo none"
    assert sbx.commands.run(left).stdout.strip() == "none"
    import httpx

    r = httpx.post(f"{stack.api_url}/v1/sandboxes/{_podbay_id(sbx)}/exec", timeout=60,
                   headers={"authorization": f"Bearer {stack.api_key}"},
                   json={"shell": "sleep 303 & sleep 304", "timeout_s": 2})
    assert r.status_code == 200, r.text
    assert sbx.commands.run("pgrep -f 'sleep 30[34]' || echo none").stdout.strip() == "none"


def test_snapshots_and_fork(sbx: Any, e2b_env: dict[str, str]) -> None:
    sbx.files.write("/home/user/snap.txt", "before")
    snap = sbx.create_snapshot()
    sbx.files.write("/home/user/snap.txt", "after")
    assert snap.snapshot_id in [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    made: list[Any] = []
    try:
        child = e2b.Sandbox.create(snap.snapshot_id, timeout=300)
        made.append(child)
        assert child.sandbox_id != sbx.sandbox_id and child.files.read("/home/user/snap.txt") == "before"
        forks = sbx.fork(count=2, timeout=300)
        made += [f for f in forks if not isinstance(f, Exception)]
        assert len(forks) == 2 and all(not isinstance(f, Exception) for f in forks), forks
        assert [f.files.read("/home/user/snap.txt") for f in forks] == ["after", "after"]
        assert forks[0].commands.run("echo fork").stdout == "fork\n"
        named = sbx.create_snapshot(name="e2b-named")  # "after" is in it
        assert named.snapshot_id == "e2b-named" and named.names == ["e2b-named"]
        # The SDK's ``name`` filter (``?name=``, with or without E2B's ``:tag``) keeps only that snapshot.
        for query in ("e2b-named", "e2b-named:default"):
            assert [s.snapshot_id for s in e2b.Sandbox.list_snapshots(name=query).next_items()] == ["e2b-named"]
        assert e2b.Sandbox.list_snapshots(name="no-such-name").next_items() == []
        assert [s.snapshot_id for s in e2b.Sandbox.list_snapshots(name=snap.snapshot_id).next_items()] == [
            snap.snapshot_id]
        by_name = e2b.Sandbox.create("e2b-named", timeout=300)
        made.append(by_name)
        assert by_name.files.read("/home/user/snap.txt") == "after"
        assert e2b.Sandbox.delete_snapshot("e2b-named") is True
        assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is False
        with pytest.raises(e2b.SandboxException, match="404"):
            e2b.Sandbox.create(snap.snapshot_id)
        # A paused sandbox forks; a killed one gives the SDK's not-found error.
        paused = forks[1]
        paused.pause()
        [again] = e2b.Sandbox.fork(paused.sandbox_id, timeout=300)
        assert not isinstance(again, Exception), again
        made.append(again)
        assert again.files.read("/home/user/snap.txt") == "after"
        kept = paused.create_snapshot()
        paused.kill()
        with pytest.raises(e2b.SandboxNotFoundException):
            paused.fork()
        # E2B's snapshots outlive their sandbox: listed, and a sandbox starts from it (out of object storage).
        assert kept.snapshot_id in [s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()]
        revived = e2b.Sandbox.create(kept.snapshot_id, timeout=300)
        made.append(revived)
        assert revived.sandbox_id != paused.sandbox_id
        assert revived.files.read("/home/user/snap.txt") == "after"
        assert revived.commands.run("echo revived").stdout == "revived\n"
        assert e2b.Sandbox.delete_snapshot(kept.snapshot_id) is True
        with pytest.raises(e2b.SandboxException, match="404"):
            e2b.Sandbox.create(kept.snapshot_id)
    finally:
        for s in made:
            e2b.Sandbox.kill(s.sandbox_id)


def test_signed_file_urls(sbx: Any, stack: Any) -> None:
    import httpx

    # The URLs carry no sandbox id: they are used with the sandbox's host name (PODBAY_E2B_DOMAIN).
    host = {"Host": f"49983-{sbx.sandbox_id}.{stack.env['PODBAY_E2B_DOMAIN']}"}
    sbx.files.write("/home/user/signed.txt", "signed")
    url = sbx.download_url("/home/user/signed.txt", use_signature_expiration=120)
    r = httpx.get(url, headers=host)
    assert r.status_code == 200 and r.content == b"signed", r.text
    assert httpx.get(url.replace("signature=v1_", "signature=v1_x"), headers=host).status_code == 401
    assert httpx.get(f"{stack.api_url}/files?path=/home/user/signed.txt", headers=host).status_code == 401
    up = sbx.upload_url("/home/user/uploaded.txt")
    r = httpx.post(up, files={"file": ("uploaded.txt", b"via url")}, headers=host)
    assert r.status_code == 200, r.text
    assert sbx.files.read("/home/user/uploaded.txt") == "via url"
    assert httpx.post(up.replace("signature=v1_", "signature=v1_x"), files={"file": ("x", b"x")},
                      headers=host).status_code == 401


def test_file_metadata(sbx: Any) -> None:
    info = sbx.files.write("/home/user/meta.txt", "m", metadata={"Team": "blue", "k": "v"})
    assert info.path == "/home/user/meta.txt"
    assert sbx.files.get_info("/home/user/meta.txt").metadata == {"team": "blue", "k": "v"}
    listed = {e.name: e.metadata for e in sbx.files.list("/home/user")}
    assert listed["meta.txt"] == {"team": "blue", "k": "v"}


def test_filesystem_only_pause_and_reboot_on_connect_boot_afresh(e2b_env: dict[str, str], stack: Any) -> None:
    # Created with a filesystem-only auto-pause (autoPauseMemory: false), used at the end.
    sb = e2b.Sandbox.create(template="base", timeout=600,
                            lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        sb.files.write("/home/user/disk.txt", "on disk")
        bg = sb.commands.run("sleep 600", background=True)
        sb.pause(mode="filesystem")
        assert e2b.Sandbox.get_info(sb.sandbox_id).state == e2b.SandboxState.PAUSED
        again = e2b.Sandbox.connect(sb.sandbox_id)
        assert again.files.read("/home/user/disk.txt") == "on disk"
        assert bg.pid not in [p.pid for p in again.commands.list()]  # memory and processes were dropped
        assert again.commands.run("echo booted").stdout == "booted\n"
        # A pause that kept memory, then connect(on_resume="reboot"): booted afresh from its disk all the same.
        again.commands.run("sleep 601", background=True)
        again.files.write("/home/user/disk.txt", "written before the reboot")
        again.pause()
        rebooted = e2b.Sandbox.connect(sb.sandbox_id, on_resume="reboot")
        assert rebooted.files.read("/home/user/disk.txt") == "written before the reboot"
        assert not [p for p in rebooted.commands.list() if "sleep 601" in p.args]
        # The timeout fires: the node takes a disk snapshot of the running guest and pauses it, and records
        # that snapshot as the one the next connect boots afresh from, as pause(mode="filesystem") above did
        # (whose connect showed the files kept and the processes gone). No connect here: one boot fewer.
        rebooted.files.write("/home/user/disk.txt", "written before the timeout")
        rebooted.set_timeout(2)
        deadline = time.monotonic() + 120
        while e2b.Sandbox.get_info(sb.sandbox_id).state != e2b.SandboxState.PAUSED:
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(1)
        marker = asyncio.run(_cold_resume_snapshot(stack, _podbay_id(sb)))
        assert marker is not None and marker["kind"] == "disk" and marker["state"] == "ready", marker
    finally:
        sb.kill()


def test_writes_acknowledged_around_a_filesystem_auto_pause_are_all_there_after_connect(
        e2b_env: dict[str, str]) -> None:
    """E2B #1104: writes come in a burst from just after the timeout through the filesystem-only auto-pause;
    every write the SDK saw acknowledged is in the files the connect boots from (the freeze is held until
    the pause). The burst starts after the deadline because podbay renews a lease on envd traffic: a write
    before it would move it; one that lands before the node acted does too, and the writer then waits,
    quiet, for the next deadline."""
    import threading
    from datetime import UTC, datetime

    sb = e2b.Sandbox.create(template="base", timeout=600,
                            lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    acked: list[int] = []
    stop = threading.Event()

    def write(i: int) -> None:
        try:
            sb.files.write(f"/home/user/w/{i}", str(i), request_timeout=5)
            acked.append(i)
        except Exception:  # noqa: BLE001 - refused or cut by the pause: not acknowledged
            pass

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                end = e2b.Sandbox.get_info(sb.sandbox_id).end_at.timestamp()
            except Exception:  # noqa: BLE001 - paused meanwhile
                return
            stop.wait(max(0.0, end + 0.1 - datetime.now(UTC).timestamp()))
            while not stop.is_set() and datetime.now(UTC).timestamp() < end + 1.5:
                write(i)
                i += 1
                time.sleep(0.02)

    try:
        sb.files.make_dir("/home/user/w")
        for i in range(-5, 0):
            write(i)
        sb.set_timeout(3)
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while e2b.Sandbox.get_info(sb.sandbox_id).state != e2b.SandboxState.PAUSED:
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(0.5)
        stop.set()
        thread.join(30)
        # The burst's writes may all block on the held freeze (none acknowledged): what matters is that none
        # acknowledged is missing. With a thaw before the pause, those in the gap were acknowledged and lost.
        assert [i for i in acked if i < 0] == list(range(-5, 0))
        again = e2b.Sandbox.connect(sb.sandbox_id)
        present = {int(e.name) for e in again.files.list("/home/user/w")}
        assert set(acked) <= present, sorted(set(acked) - present)
        print(f"acknowledged {len(acked)} writes ({len([i for i in acked if i >= 0])} of the burst), all present")
    finally:
        stop.set()
        sb.kill()


async def _cold_resume_snapshot(stack: Any, sandbox_id: str) -> dict[str, Any] | None:
    import asyncpg

    conn = await asyncpg.connect(stack.pg_dsn)
    try:
        row = await conn.fetchrow("SELECT s.kind, s.state FROM e2b_sandboxes e JOIN snapshots s"
                                  " ON s.id = e.cold_resume_snapshot WHERE e.sandbox_id=$1", sandbox_id)
        return dict(row) if row is not None else None
    finally:
        await conn.close()


def test_sandbox_from_a_filesystem_only_snapshot_boots_afresh_with_its_files(sbx: Any) -> None:
    sbx.files.write("/home/user/fs-snap.txt", "in the snapshot")
    bg = sbx.commands.run("sleep 600", background=True)
    snap = sbx.create_snapshot(mode="filesystem")
    sbx.files.write("/home/user/fs-snap.txt", "after the snapshot")
    assert snap.snapshot_id in [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    child = e2b.Sandbox.create(snap.snapshot_id, timeout=300)
    try:
        assert child.sandbox_id != sbx.sandbox_id
        assert child.files.read("/home/user/fs-snap.txt") == "in the snapshot"
        assert not [p for p in child.commands.list() if "sleep 600" in p.args]  # no memory, no processes
        assert child.commands.run("echo cold").stdout == "cold\n"
        assert sbx.files.read("/home/user/fs-snap.txt") == "after the snapshot"  # the source ran on
        assert bg.pid in [p.pid for p in sbx.commands.list()]
    finally:
        child.kill()
        sbx.commands.kill(bg.pid)
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is True


def test_volumes_create_mount_write_remount_read_list_and_delete(e2b_env: dict[str, str]) -> None:
    name = f"e2b-vol-{int(time.time())}"
    vol = e2b.Volume.create(name)
    assert vol.volume_id.startswith("vol_") and vol.name == name
    assert e2b.Volume.get_info(vol.volume_id).name == name
    first = e2b.Sandbox.create(template="base", timeout=300, volume_mounts={"/mnt/data": vol})
    try:
        # A new volume's root directory is root's (mkfs.ext4), so the file is written as root.
        first.files.write("/mnt/data/note.txt", "kept on the volume", user="root")
        # The volume is held read-write by a live sandbox: E2B's delete is refused with 409.
        with pytest.raises(e2b.VolumeException, match="409: .*attached"):
            e2b.Volume.destroy(vol.volume_id)
    finally:
        first.kill()
    second = e2b.Sandbox.create(template="base", timeout=300, volume_mounts={"/home/user/vol": name})
    try:
        assert second.files.read("/home/user/vol/note.txt") == "kept on the volume"
    finally:
        second.kill()
    assert [v.volume_id for v in e2b.Volume.list() if v.name == name] == [vol.volume_id]
    # E2B's volume content API: the volume's files without a sandbox, once no sandbox holds it (409 until the
    # killed sandbox's VM has let go of it), and a write there is what the next sandbox mounts.
    got = None
    for _ in range(60):
        try:
            got = vol.read_file("/note.txt", api_url=e2b_env["E2B_API_URL"])
            break
        except e2b.VolumeException as exc:
            if "409" not in str(exc):
                raise
            time.sleep(0.5)
    assert got == "kept on the volume"
    vol.write_file("/from-api.txt", "written without a sandbox", api_url=e2b_env["E2B_API_URL"])
    third = e2b.Sandbox.create(template="base", timeout=300, volume_mounts={"/mnt/v": vol})
    try:
        assert third.files.read("/mnt/v/from-api.txt") == "written without a sandbox"
    finally:
        third.kill()
    assert e2b.Volume.destroy(vol.volume_id) is True
    assert e2b.Volume.destroy(vol.volume_id) is False
    assert all(v.name != name for v in e2b.Volume.list())
