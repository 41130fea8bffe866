"""The SDK and the CLI against the real stack and real microVMs (HTTP only, as users run them)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from podbay import AsyncSandbox, Sandbox
from podbay.errors import NotFound, PermissionDenied

pytestmark = pytest.mark.e2e


def test_sync_sdk(stack: Any) -> None:
    with Sandbox.create(template="base", api_url=stack.api_url, api_key=stack.api_key) as sb:
        r = sb.exec(["python3", "-c", "print(6*7)"])
        assert r.stdout == "42\n" and r.exit_code == 0 and not r.output_truncated
        big = sb.exec("head -c 17000000 /dev/zero | tr '\\0' a")  # past the 16 MiB a run keeps
        assert big.exit_code == 0 and big.output_truncated and big.stdout == "a" * (16 << 20)
        events = []
        for ev in sb.exec_stream(["sh", "-c", "echo a; sleep 1; echo b"]):
            events.append((time.monotonic(), ev))
        outs = [(t, ev.data) for t, ev in events if ev.type == "stdout"]
        assert "".join(d or "" for _, d in outs) == "a\nb\n"
        assert outs[-1][0] - outs[0][0] > 0.5  # "a" came before "b" was written
        sb.files.write("/tmp/a.txt", b"hi")
        assert sb.files.read("/tmp/a.txt") == b"hi"
        sid = sb.id
        with pytest.raises(PermissionDenied) as denied:  # 403, not a guest failure
            sb.exec(["/etc/passwd"])
        assert denied.value.http_status == 403 and denied.value.details["guest_code"] == "permission_denied"
    with pytest.raises(NotFound):
        Sandbox.connect("sbx_nope", api_url=stack.api_url, api_key=stack.api_key)
    info = [s for s in Sandbox.list(api_url=stack.api_url, api_key=stack.api_key) if s.id == sid]
    assert info == []  # deleted on leaving the with-block


def test_async_sdk(stack: Any) -> None:
    async def go() -> None:
        sb = await AsyncSandbox.create(template="base", api_url=stack.api_url, api_key=stack.api_key)
        async with sb:
            r = await sb.exec("echo $((6*7))")
            assert r.stdout == "42\n"
            await sb.files.write("/tmp/b.bin", bytes(range(256)) * 100)
            assert await sb.files.read("/tmp/b.bin") == bytes(range(256)) * 100
            kinds = [ev.type async for ev in sb.exec_stream(["sh", "-c", "echo x; echo y >&2"])]
            assert kinds[0] == "start" and kinds[-1] == "exit" and "stderr" in kinds

    asyncio.run(go())


def _cli(stack: Any, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    exe = Path(sys.executable).with_name("podbay")
    env = {**stack.env, "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": stack.api_key}
    return subprocess.run([str(exe), *args], env=env, input=stdin, capture_output=True, timeout=180)


def test_cli_user_journey(stack: Any, tmp_path: Path) -> None:
    r = _cli(stack, "sandbox", "create", "--template", "base")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    assert sid.startswith("sbx_")
    try:
        r = _cli(stack, "exec", sid, "--", "python3", "-c", "print(6*7)")
        assert r.returncode == 0 and r.stdout == b"42\n"
        r = _cli(stack, "exec", sid, "--", "sh", "-c", "echo err >&2; exit 5")
        assert r.returncode == 5 and r.stderr.endswith(b"err\n")
        local = tmp_path / "a.txt"
        local.write_bytes(os.urandom(100_000))
        assert _cli(stack, "files", "write", sid, "/tmp/a.txt", str(local)).returncode == 0
        r = _cli(stack, "files", "read", sid, "/tmp/a.txt")
        assert r.returncode == 0 and r.stdout == local.read_bytes()
        r = _cli(stack, "sandbox", "list")
        assert r.returncode == 0 and sid.encode() in r.stdout
        r = _cli(stack, "files", "read", sid, "/nope")
        assert r.returncode != 0 and r.stderr.startswith(b"error: ") and b"not_found" in r.stderr
        assert b"Traceback" not in r.stderr
        # A program the guest cannot start: as a shell, 127 when it is missing, 126 when it is not executable.
        r = _cli(stack, "exec", sid, "--", "/no/such/program")
        assert r.returncode == 127 and b"(not_found)" in r.stderr, r.stderr
        r = _cli(stack, "exec", sid, "--", "/etc/passwd")
        assert r.returncode == 126 and b"/etc/passwd: Permission denied (permission_denied)" in r.stderr, r.stderr
    finally:
        r = _cli(stack, "sandbox", "rm", sid)
    assert r.returncode == 0, r.stderr
    r = _cli(stack, "exec", sid, "--", "true")
    assert r.returncode == 2 and b"invalid_state" in r.stderr


def test_sdk_and_cli_snapshot_restore_fork(stack: Any) -> None:
    with Sandbox.create(template="base", api_url=stack.api_url, api_key=stack.api_key) as sb:
        sb.files.write("/tmp/v.txt", b"one")
        snap = sb.snapshot("full")
        assert snap.kind == "full" and snap.state == "ready"
        sb.files.write("/tmp/v.txt", b"two")
        assert [s.id for s in sb.snapshots()] == [snap.id]
        info = sb.restore(snap.id)
        assert info.state == "running" and sb.files.read("/tmp/v.txt") == b"one"

        r = _cli(stack, "snapshot", "list", sb.id)
        assert r.returncode == 0 and snap.id.encode() in r.stdout
        r = _cli(stack, "sandbox", "fork", sb.id, "--count", "2", "--snapshot", snap.id)
        assert r.returncode == 0, r.stderr
        children = r.stdout.decode().split()
        assert len(children) == 2 and all(c.startswith("sbx_") for c in children)
        for child in children:
            kid = Sandbox.connect(child, api_url=stack.api_url, api_key=stack.api_key)
            assert kid.files.read("/tmp/v.txt") == b"one"
            kid.delete()
        r = _cli(stack, "snapshot", "create", sb.id, "--kind", "bogus")
        assert r.returncode == 2 and r.stderr.startswith(b"error: ")


def test_sdk_and_cli_diff(stack: Any) -> None:
    with Sandbox.create(template="base", api_url=stack.api_url, api_key=stack.api_key) as sb:
        a = sb.snapshot("disk")
        sb.exec("echo hello > /root/new.txt")
        b = sb.snapshot("disk")
        d = sb.diff(a.id, b.id)
        assert any(e.path == "/root/new.txt" and e.change == "added" and e.size == 6 for e in d.entries)
        r = _cli(stack, "snapshot", "diff", sb.id, a.id, b.id)
        assert r.returncode == 0, r.stderr
        assert b"+ file" in r.stdout and b"/root/new.txt" in r.stdout
