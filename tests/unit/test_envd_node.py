"""The node's envd API (services/nodeagent/envd) in-process over ASGI, on a real guestd run on this host
(the fixtures of test_guestd), with a fake sandbox manager: Connect unary and streaming calls with the JSON
codec, and the plain /files API."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from podbay.channel.client import GuestChannel
from podbay.contracts.templates import ImageConfig
from podbay.errors import NotFound
from podbay_nodeagent.envd import EnvdApp
from test_guestd import ch, guestd_socket  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="guestd tests switch users and need root")

SBX = "sbx_test"


class _Manager:
    def __init__(self, channel: GuestChannel) -> None:
        self._ch = channel
        self.vms = {SBX: object()}

    def channel(self, sandbox_id: str, generation: int | None) -> GuestChannel:
        if sandbox_id not in self.vms:
            raise NotFound(f"sandbox {sandbox_id} is not running on node test")
        return self._ch


@pytest.fixture
async def envd_app(ch: GuestChannel) -> AsyncIterator[EnvdApp]:  # noqa: F811
    app = EnvdApp(_Manager(ch))  # type: ignore[arg-type]
    yield app
    app.close()


@pytest.fixture
async def client(envd_app: EnvdApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=envd_app), base_url="http://node") as c:
        yield c


def _root_auth() -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(b"root:").decode()}


async def _unary(c: httpx.AsyncClient, method: str, body: dict[str, Any], user_root: bool = True,
                 sandbox: str = SBX) -> httpx.Response:
    return await c.post(f"/internal/e2b/{sandbox}/{method}", json=body,
                        headers={"connect-protocol-version": "1", **(_root_auth() if user_root else {})})


async def _stream(c: httpx.AsyncClient, method: str, body: dict[str, Any], stop: Any,
                  headers: dict[str, str] | None = None, auth: bool = True) -> list[dict[str, Any]]:
    """Messages of a server-streaming call until ``stop(msg)`` is true (or the stream ends)."""
    payload = json.dumps(body).encode()
    out: list[dict[str, Any]] = []
    async with c.stream("POST", f"/internal/e2b/{SBX}/{method}", content=struct.pack(">BI", 0, len(payload)) + payload,
                        headers={"content-type": "application/connect+json", **(_root_auth() if auth else {}),
                                 **(headers or {})}) as r:
        assert r.status_code == 200
        buf = b""
        async for chunk in r.aiter_bytes():
            buf += chunk
            while len(buf) >= 5:
                flags, n = struct.unpack(">BI", buf[:5])
                if len(buf) < 5 + n:
                    break
                msg, buf = json.loads(buf[5:5 + n]), buf[5 + n:]
                if flags & 2:
                    out.append({"_end": msg})
                    return out
                out.append(msg)
                if stop(msg):
                    return out
    return out


async def test_filesystem_unary_calls_and_errors(client: httpx.AsyncClient, tmp_path: Path) -> None:
    d = tmp_path / "made" / "deep"
    r = await _unary(client, "filesystem.Filesystem/MakeDir", {"path": str(d)})
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    r = await _unary(client, "filesystem.Filesystem/MakeDir", {"path": str(d)})
    assert r.status_code == 409 and r.json()["code"] == "already_exists"
    (d / "f.txt").write_text("abc")
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(d / "f.txt")})
    entry = r.json()["entry"]
    assert (entry["name"], entry["size"], entry["permissions"], entry["owner"]) == ("f.txt", "3", "-rw-r--r--", "root")
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(d / "missing")})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = await _unary(client, "filesystem.Filesystem/ListDir", {"path": str(tmp_path), "depth": 3})
    assert [e["path"] for e in r.json()["entries"]] == [str(tmp_path / "made"), str(d), str(d / "f.txt")]
    r = await _unary(client, "filesystem.Filesystem/Move", {"source": str(d / "f.txt"), "destination": str(d / "g")})
    assert r.json()["entry"]["path"] == str(d / "g")
    r = await _unary(client, "filesystem.Filesystem/Remove", {"path": str(tmp_path / "made")})
    assert r.status_code == 200 and not (tmp_path / "made").exists()
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": "/"}, sandbox="sbx_other")
    assert r.status_code == 404


async def test_files_upload_download(client: httpx.AsyncClient, tmp_path: Path) -> None:
    target = tmp_path / "up" / "a.bin"
    r = await client.post(f"/internal/e2b/{SBX}/files", params={"path": str(target), "username": "root"},
                          files=[("file", (str(target), b"\x00\x01data"))])
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "a.bin", "type": "file", "path": str(target)}]
    assert target.read_bytes() == b"\x00\x01data"
    r = await client.post(f"/internal/e2b/{SBX}/files", params={"path": str(tmp_path / "raw.txt"), "username": "root"},
                          content=b"raw body", headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and (tmp_path / "raw.txt").read_bytes() == b"raw body"
    r = await client.get(f"/internal/e2b/{SBX}/files", params={"path": str(target), "username": "root"})
    assert r.status_code == 200 and r.content == b"\x00\x01data"
    r = await client.get(f"/internal/e2b/{SBX}/files", params={"path": str(tmp_path / "nope")})
    assert r.status_code == 404 and r.json()["code"] == 404
    r = await client.get(f"/internal/e2b/{SBX}/files", params={"path": str(tmp_path)})
    assert r.status_code == 400
    assert (await client.get(f"/internal/e2b/{SBX}/health")).status_code == 204


async def test_process_start_streams_and_list(client: httpx.AsyncClient) -> None:
    msgs = await _stream(client, "process.Process/Start",
                         {"process": {"cmd": "/bin/sh", "args": ["-c", "echo out; echo err >&2; exit 4"]}},
                         lambda m: "end" in m.get("event", {}))
    events = [m["event"] for m in msgs]
    assert "start" in events[0] and events[0]["start"]["pid"] > 0
    out = b"".join(base64.b64decode(e["data"].get("stdout", "")) for e in events if "data" in e)
    err = b"".join(base64.b64decode(e["data"].get("stderr", "")) for e in events if "data" in e)
    assert (out, err) == (b"out\n", b"err\n")
    assert events[-1]["end"]["exitCode"] == 4 and events[-1]["end"]["status"] == "exit status 4"
    r = await _unary(client, "process.Process/List", {})
    assert r.status_code == 200
    r = await _unary(client, "process.Process/SendSignal", {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


async def test_start_uses_the_sandbox_default_env_under_the_requests_own(client: httpx.AsyncClient) -> None:
    default = {"x-podbay-e2b-env": base64.b64encode(json.dumps({"A": "sandbox", "B": "sandbox"}).encode()).decode()}
    msgs = await _stream(client, "process.Process/Start",
                         {"process": {"cmd": "/bin/sh", "args": ["-c", "echo $A $B"], "envs": {"B": "call"}}},
                         lambda m: "end" in m.get("event", {}), headers=default)
    out = b"".join(base64.b64decode(m["event"]["data"].get("stdout", "")) for m in msgs if "data" in m["event"])
    assert out == b"sandbox call\n"


class _Defaults:
    """A sandbox manager's template configs (``ExecDefaults``), here one fixed config."""

    def __init__(self, cfg: ImageConfig) -> None:
        self.cfg = cfg

    async def get(self, sandbox_id: str) -> ImageConfig | None:
        return self.cfg if sandbox_id == SBX else None


async def test_start_takes_the_templates_workdir_user_and_env(ch: GuestChannel, tmp_path: Path) -> None:  # noqa: F811
    app = EnvdApp(_Manager(ch), _Defaults(ImageConfig(workdir=str(tmp_path), user="root",  # type: ignore[arg-type]
                                                      env={"T": "template", "A": "template"})))
    default = {"x-podbay-e2b-env": base64.b64encode(json.dumps({"A": "sandbox"}).encode()).decode()}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
            body = {"process": {"cmd": "/bin/sh", "args": ["-c", "pwd; id -un; echo $T $A"]}}
            msgs = await _stream(c, "process.Process/Start", body, lambda m: "end" in m.get("event", {}),
                                 headers=default, auth=False)
    finally:
        app.close()
    out = b"".join(base64.b64decode(m["event"]["data"].get("stdout", "")) for m in msgs if "data" in m["event"])
    assert out.decode().splitlines() == [str(tmp_path), "root", "template sandbox"]


async def test_polling_watchers_buffer_events_and_expire_when_nobody_fetches(
        envd_app: EnvdApp, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from podbay_nodeagent.envd import filesystem

    r = await _unary(client, "filesystem.Filesystem/CreateWatcher", {"path": str(tmp_path), "includeEntry": True})
    wid = r.json()["watcherId"]
    (tmp_path / "n.txt").write_text("x")
    events: list[dict[str, Any]] = []
    for _ in range(200):
        r = await _unary(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        events += r.json().get("events", [])
        if any(e["name"] == "n.txt" and e["type"] == "EVENT_TYPE_CREATE" for e in events):
            break
        await asyncio.sleep(0.05)
    created = next(e for e in events if e["name"] == "n.txt" and e["type"] == "EVENT_TYPE_CREATE")
    assert created["entry"]["path"] == str(tmp_path / "n.txt")
    r = await _unary(client, "filesystem.Filesystem/RemoveWatcher", {"watcherId": wid})
    assert r.status_code == 200
    r = await _unary(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
    assert r.status_code == 404

    monkeypatch.setattr(filesystem, "WATCHER_IDLE_S", 0.3)
    monkeypatch.setattr(filesystem, "_IDLE_CHECK_S", 0.05)
    r = await _unary(client, "filesystem.Filesystem/CreateWatcher", {"path": str(tmp_path)})
    idle = r.json()["watcherId"]
    assert idle in envd_app.filesystem.watcher_ids()
    for _ in range(200):  # nobody fetches: the watcher stops and is forgotten
        if idle not in envd_app.filesystem.watcher_ids():
            break
        await asyncio.sleep(0.05)
    assert idle not in envd_app.filesystem.watcher_ids()
    r = await _unary(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": idle})
    assert r.status_code == 404


async def test_process_tables_of_deleted_sandboxes_are_dropped(envd_app: EnvdApp, client: httpx.AsyncClient) -> None:
    envd_app.manager.vms["sbx_two"] = object()
    assert (await _unary(client, "process.Process/List", {}, sandbox="sbx_two")).status_code == 200
    assert "sbx_two" in envd_app.tables
    del envd_app.manager.vms["sbx_two"]
    assert (await _unary(client, "process.Process/List", {})).status_code == 200
    assert set(envd_app.tables) == {SBX}


async def test_remove_of_a_missing_path_succeeds_as_in_envd(client: httpx.AsyncClient, tmp_path: Path) -> None:
    r = await _unary(client, "filesystem.Filesystem/Remove", {"path": str(tmp_path / "never-made")})
    assert r.status_code == 200, r.text


async def test_relative_cwd_is_taken_from_the_users_home(client: httpx.AsyncClient) -> None:
    msgs = await _stream(client, "process.Process/Start",
                         {"process": {"cmd": "/bin/sh", "args": ["-c", "pwd"], "cwd": "../tmp"}},
                         lambda m: "end" in m.get("event", {}))
    out = b"".join(base64.b64decode(m["event"]["data"].get("stdout", "")) for m in msgs if "data" in m["event"])
    assert out == b"/tmp\n"  # root's home is /root: /root/../tmp


async def test_stream_ends_with_deadline_exceeded_at_connect_timeout_ms(client: httpx.AsyncClient) -> None:
    msgs = await _stream(client, "process.Process/Start", {"process": {"cmd": "/bin/sleep", "args": ["30"]}},
                         lambda m: False, headers={"connect-timeout-ms": "700"})
    assert msgs[-1]["_end"]["error"]["code"] == "deadline_exceeded"
    pid = msgs[0]["event"]["start"]["pid"]
    # A Start's Connect-Timeout-Ms is the command's timeout, as envd's: at it the process (and its group) is
    # killed, so nothing is left to signal (E2B #500; tests/unit/test_envd_process_deadline.py).
    for _ in range(50):  # the kill is sent before the stream ends; its exit is noted a moment later
        r = await _unary(client, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
        if r.status_code == 404:
            break
        await asyncio.sleep(0.1)
    assert r.status_code == 404, r.text


async def test_kill_right_after_a_pty_start_kills_the_shell(ch: GuestChannel) -> None:  # noqa: F811
    import signal

    from podbay.contracts.channel import ExecSpec, PtySize

    # What envd's SendSignal does (proc_signal) at once after Start: the terminal's process may not have
    # made its process group yet, and the kill must still land.
    for _ in range(5):
        handle = ch.exec(ExecSpec(argv=["/bin/bash", "-l"], keep=True, pty=PtySize(cols=80, rows=24)))
        async with handle:
            pid = await handle.started()
            await ch.proc_signal(pid, signal.SIGKILL)
            ex = await handle.wait()
        assert ex.exit_code == -signal.SIGKILL, ex


async def test_upload_metadata_becomes_user_e2b_xattrs_shown_by_stat_and_list(
        client: httpx.AsyncClient, tmp_path: Path) -> None:
    target = tmp_path / "meta.txt"
    r = await client.post(f"/internal/e2b/{SBX}/files", params={"path": str(target), "username": "root"},
                          content=b"m", headers={"content-type": "application/octet-stream",
                                                 "X-Metadata-Owner-Team": "Blue", "X-Metadata-k": "v"})
    assert r.status_code == 200, r.text
    assert os.getxattr(target, "user.e2b.owner-team") == b"Blue" and os.getxattr(target, "user.e2b.k") == b"v"
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(target)})
    assert r.json()["entry"]["metadata"] == {"owner-team": "Blue", "k": "v"}
    r = await _unary(client, "filesystem.Filesystem/ListDir", {"path": str(tmp_path)})
    assert [e.get("metadata") for e in r.json()["entries"]] == [{"owner-team": "Blue", "k": "v"}]


async def test_a_symlinks_entry_has_its_targets_type_and_resolved_absolute_path(
        client: httpx.AsyncClient, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("hello")
    (tmp_path / "d" / "f.txt").chmod(0o600)
    os.symlink("f.txt", tmp_path / "d" / "to_file")  # relative, as `ln -s f.txt to_file` makes it
    os.symlink(str(tmp_path / "d"), tmp_path / "to_dir")
    os.symlink("d/to_file", tmp_path / "chain")  # a link to a link: resolved all the way
    os.symlink("missing", tmp_path / "broken")
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "d" / "to_file")})
    entry = r.json()["entry"]
    assert entry["type"] == "FILE_TYPE_FILE" and entry["symlinkTarget"] == str(tmp_path / "d" / "f.txt")
    assert entry["mode"] == 0o600 and entry["permissions"].startswith("L") and "isSymlink" not in entry
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "to_dir")})
    assert (r.json()["entry"]["type"], r.json()["entry"]["symlinkTarget"]) == ("FILE_TYPE_DIRECTORY", str(tmp_path / "d"))
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "broken")})
    broken = r.json()["entry"]
    assert broken.get("type", "FILE_TYPE_UNSPECIFIED") == "FILE_TYPE_UNSPECIFIED"
    assert broken["symlinkTarget"] == str(tmp_path / "broken")
    r = await _unary(client, "filesystem.Filesystem/ListDir", {"path": str(tmp_path)})
    listed = {e["name"]: e for e in r.json()["entries"]}
    assert listed["chain"]["type"] == "FILE_TYPE_FILE" and listed["chain"]["symlinkTarget"] == str(tmp_path / "d" / "f.txt")
    assert listed["to_dir"]["type"] == "FILE_TYPE_DIRECTORY" and "symlinkTarget" not in listed["d"]


async def test_metadata_is_returned_on_upload_kept_by_move_and_dropped_by_an_overwrite(
        client: httpx.AsyncClient, tmp_path: Path) -> None:
    target = tmp_path / "m.txt"
    params = {"path": str(target), "username": "root"}
    r = await client.post(f"/internal/e2b/{SBX}/files", params=params, content=b"1",
                          headers={"content-type": "application/octet-stream", "X-Metadata-Author": "mish"})
    assert r.json() == [{"name": "m.txt", "type": "file", "path": str(target), "metadata": {"author": "mish"}}]
    r = await _unary(client, "filesystem.Filesystem/Move", {"source": str(target), "destination": str(tmp_path / "n.txt")})
    assert r.json()["entry"]["metadata"] == {"author": "mish"}
    params["path"] = str(tmp_path / "n.txt")
    r = await client.post(f"/internal/e2b/{SBX}/files", params=params, files=[("file", ("n.txt", b"2"))])
    assert r.json() == [{"name": "n.txt", "type": "file", "path": str(tmp_path / "n.txt")}]
    r = await _unary(client, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "n.txt")})
    assert "metadata" not in r.json()["entry"]


@pytest.mark.parametrize("header", [("X-Metadata-Good", "bad\x7fvalue"), ("X-Metadata-Big", "v" * 4100),
                                    ("X-Metadata-" + "k" * 250, "v")])
async def test_invalid_metadata_is_refused_with_400_and_writes_nothing(
        client: httpx.AsyncClient, tmp_path: Path, header: tuple[str, str]) -> None:
    r = await client.post(f"/internal/e2b/{SBX}/files", params={"path": str(tmp_path / "x"), "username": "root"},
                          content=b"x", headers={"content-type": "application/octet-stream", header[0]: header[1]})
    assert r.status_code == 400 and r.json()["message"].startswith("invalid metadata: "), r.text
    assert not (tmp_path / "x").exists()


async def test_a_poll_right_after_an_upload_has_its_create_chmod_and_write(
        client: httpx.AsyncClient, tmp_path: Path) -> None:
    """The synchronous SDK's files.write then get_new_events, with no pause between them: envd's answer
    holds the write's events (create, chmod for the owner, write), in that order."""
    (tmp_path / "f.txt").write_text("old")
    r = await _unary(client, "filesystem.Filesystem/CreateWatcher", {"path": str(tmp_path), "includeEntry": True})
    wid = r.json()["watcherId"]
    try:
        up = {"username": "root", "path": str(tmp_path / "new.txt")}
        assert (await client.post(f"/internal/e2b/{SBX}/files", params=up, content=b"n",
                                  headers={"content-type": "application/octet-stream"})).status_code == 200
        r = await _unary(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        assert [(e["name"], e["type"]) for e in r.json().get("events", [])] == [
            ("new.txt", "EVENT_TYPE_CREATE"), ("new.txt", "EVENT_TYPE_CHMOD"), ("new.txt", "EVENT_TYPE_WRITE")]
        up["path"] = str(tmp_path / "f.txt")
        assert (await client.post(f"/internal/e2b/{SBX}/files", params=up, content=b"changed",
                                  headers={"content-type": "application/octet-stream"})).status_code == 200
        r = await _unary(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        events = r.json().get("events", [])
        write = next(e for e in events if e["type"] == "EVENT_TYPE_WRITE")
        assert write["name"] == "f.txt" and write["entry"]["path"] == str(tmp_path / "f.txt")
        # Nothing changed through envd since: the poll answers at once, empty.
        r = await _unary(client, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        assert r.json().get("events", []) == []
    finally:
        await _unary(client, "filesystem.Filesystem/RemoveWatcher", {"watcherId": wid})
