"""guestd's kept processes (``keep``, ``procs``, ``attach``, ``proc_*``) and PTY execs, run on this host over
a socket and driven by the real GuestChannel (the fixtures of test_guestd)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from podbay.channel.client import ExecProcess, GuestChannel
from podbay.contracts.channel import ExecSpec, PtySize
from podbay.errors import InvalidRequest, NotFound
from test_guestd import _alive, _until, ch, guestd_socket  # noqa: F401 - fixtures and helpers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="guestd tests switch users and need root")


async def _read_until(proc: ExecProcess, needle: bytes, limit_s: float = 20.0) -> bytes:
    out = b""

    async def run() -> None:
        nonlocal out
        async for _, data in proc:
            out += data
            if needle in out:
                return

    await asyncio.wait_for(run(), limit_s)
    return out


async def test_kept_process_outlives_cancel_and_is_listed(ch: GuestChannel) -> None:
    proc = ch.exec(ExecSpec(argv=["sleep", "60"], keep=True, tag="sleeper"))
    pid = await proc.started()
    await proc.__aexit__(None, None, None)  # CANCEL: a kept process keeps running
    await asyncio.sleep(0.3)
    assert _alive(pid)
    listed = {p.pid: p for p in await ch.procs()}
    assert listed[pid].tag == "sleeper" and listed[pid].argv == ["sleep", "60"]
    await ch.proc_signal(pid, signal.SIGKILL)
    await _until(lambda: not _alive(pid), "killed kept process")
    for _ in range(100):
        if pid not in {p.pid for p in await ch.procs()}:
            break
        await asyncio.sleep(0.05)
    assert pid not in {p.pid for p in await ch.procs()}


async def test_attach_from_a_new_session_gets_output_and_exit(guestd_socket: Path) -> None:
    first = await GuestChannel.connect(guestd_socket, timeout_s=30)
    proc = first.exec(ExecSpec(shell="read line; echo got:$line; exit 7", keep=True, stdin=True))
    pid = await proc.started()
    await first.close()  # the host goes away; a new session orphans the old stream
    second = await GuestChannel.connect(guestd_socket, timeout_s=30)
    try:
        assert pid in {p.pid for p in await second.procs()}
        async with second.attach(pid) as att:
            assert await att.started() == pid
            await second.proc_input(pid, b"hello\n")
            out = await _read_until(att, b"got:hello")
            ex = await att.wait()
        assert b"got:hello" in out and ex.exit_code == 7
        await _until(lambda: not _alive(pid), "exited")
        with pytest.raises(NotFound):
            await second.proc_signal(pid, signal.SIGTERM)
    finally:
        await second.close()


async def test_proc_input_and_close_stdin(ch: GuestChannel) -> None:
    async with ch.exec(ExecSpec(argv=["cat"], keep=True, stdin=True)) as proc:
        pid = await proc.started()
        await ch.proc_input(pid, b"abc")
        await ch.proc_close_stdin(pid)
        out = b""
        async for _, data in proc:
            out += data
        assert out == b"abc" and (await proc.wait()).exit_code == 0


async def test_kept_process_without_stdin_refuses_input(ch: GuestChannel) -> None:
    async with ch.exec(ExecSpec(argv=["sleep", "30"], keep=True)) as proc:
        pid = await proc.started()
        with pytest.raises(InvalidRequest):
            await ch.proc_input(pid, b"x")
        with pytest.raises(InvalidRequest):
            await ch.proc_resize(pid, cols=80, rows=24)
        await ch.proc_signal(pid, signal.SIGTERM)
        assert (await proc.wait()).exit_code == -signal.SIGTERM


async def test_selectors_and_argument_errors(ch: GuestChannel) -> None:
    with pytest.raises(NotFound):
        await ch.proc_signal(999999, signal.SIGTERM)
    async with ch.exec(ExecSpec(argv=["sleep", "30"], keep=True, tag="bad-signal")) as proc:
        pid = await proc.started()
        with pytest.raises(InvalidRequest):
            await ch.proc_signal(pid, 0)
        with pytest.raises(InvalidRequest):
            await ch.proc_resize(pid, cols=0, rows=24)
        await ch.proc_signal(pid, signal.SIGKILL)
        await proc.wait()
    with pytest.raises(ValueError):
        ExecSpec(argv=["true"], tag="t")  # a tag needs keep


async def test_pty_process_sees_a_terminal_and_resizes(ch: GuestChannel) -> None:
    spec = ExecSpec(argv=["bash", "--norc", "-i"], keep=True, pty=PtySize(cols=100, rows=30))
    async with ch.exec(spec) as proc:
        pid = await proc.started()
        await ch.proc_input(pid, b"stty size; tty; echo done-$((6*7))\n")
        out = await _read_until(proc, b"done-42")
        assert b"30 100" in out and b"/dev/pts/" in out
        await ch.proc_resize(pid, cols=120, rows=40)
        await ch.proc_input(pid, b"stty size; echo again-$((1+1))\n")
        out = await _read_until(proc, b"again-2")
        assert b"40 120" in out
        with pytest.raises(InvalidRequest):
            await ch.proc_close_stdin(pid)
        await ch.proc_input(pid, b"exit 3\n")
        assert (await proc.wait()).exit_code == 3
