"""guestd run on this host as a subprocess (``--listen``, QEMU-like socket), driven by the real GuestChannel.

Runs as root here, so ``user`` tests switch to ``nobody``. Machine-level calls go to a recording fake.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from podbay.channel import frames
from podbay.channel.client import ChannelClosed, ExecProcess, GuestChannel
from podbay.channel.frames import Decoder, Frame, FrameType
from podbay.contracts.channel import ExecSpec
from podbay.errors import Conflict, InvalidRequest, NotFound, NotWritable, PermissionDenied

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="guestd tests switch users and need root")


def _start_guestd(sock: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PODBAY_GUESTD_LEAK_CHECK="leaked")
    with open(log.with_suffix(".stderr"), "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "podbay_guestd", "--listen", str(sock), "--fake-system", str(log)],
            env=env,
            stderr=err,
        )


@pytest.fixture(scope="module")
def guestd_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("guestd")
    proc = _start_guestd(d / "ch.sock", d / "system.log")
    for _ in range(400):
        if (d / "ch.sock").exists() or proc.poll() is not None:
            break
        time.sleep(0.05)
    yield d / "ch.sock"
    proc.terminate()
    proc.wait(10)
    assert proc.returncode in (0, -signal.SIGTERM), (d / "system.stderr").read_text()


@pytest.fixture
async def ch(guestd_socket: Path) -> AsyncIterator[GuestChannel]:
    channel = await GuestChannel.connect(guestd_socket, timeout_s=30, request_timeout_s=30)
    yield channel
    await channel.close()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


async def _until(predicate: object, what: str, limit_s: float = 20.0) -> None:
    for _ in range(int(limit_s / 0.05)):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


# -- exec ----------------------------------------------------------------------------------------


async def test_exec_stdout(ch: GuestChannel) -> None:
    out, err, res = await ch.run(ExecSpec(argv=["python3", "-c", "print(6 * 7)"]))
    assert (out, err, res.exit_code, res.timed_out) == (b"42\n", b"", 0, False)
    assert res.pid > 0


async def test_exec_stderr_and_exit_code(ch: GuestChannel) -> None:
    out, err, res = await ch.run(ExecSpec(shell="echo out; echo oops >&2; exit 7"))
    assert (out, err, res.exit_code) == (b"out\n", b"oops\n", 7)


async def test_exec_stdin_streams_beyond_the_window(ch: GuestChannel) -> None:
    data = os.urandom(3 * frames.INITIAL_WINDOW + 12345)
    got = bytearray()
    async with ch.exec(ExecSpec(argv=["cat"], stdin=True)) as proc:

        async def feed() -> None:
            for i in range(0, len(data), 100_000):
                await proc.write_stdin(data[i : i + 100_000])
            await proc.close_stdin()

        feeder = asyncio.create_task(feed())
        async for kind, chunk in proc:
            assert kind == "stdout"
            got += chunk
        await feeder
        res = await proc.wait()
    assert res.exit_code == 0
    assert bytes(got) == data


async def test_run_with_stdin_bytes(ch: GuestChannel) -> None:
    out, _, res = await ch.run(ExecSpec(argv=["wc", "-c"]), stdin=b"x" * 5000)
    assert out.strip() == b"5000" and res.exit_code == 0


async def test_exec_env_cwd_and_clean_environment(ch: GuestChannel, tmp_path: Path) -> None:
    out, _, res = await ch.run(
        ExecSpec(
            shell='echo "$FOO|$PWD|$HOME|$PATH|${PODBAY_GUESTD_LEAK_CHECK:-none}"',
            env={"FOO": "bar"},
            cwd=str(tmp_path),
        )
    )
    foo, pwd, home, path, leak = out.decode().strip().split("|")
    assert (foo, pwd, home, leak) == ("bar", str(tmp_path), "/root", "none")
    assert "/usr/bin" in path.split(":")
    assert res.exit_code == 0


async def test_exec_as_nobody(ch: GuestChannel) -> None:
    out, _, res = await ch.run(ExecSpec(shell='id -u; id -g; echo "$HOME $USER"; pwd', user="nobody"))
    assert out.decode().split("\n")[:4] == ["65534", "65534", "/nonexistent nobody", "/"]
    out2, _, _ = await ch.run(ExecSpec(argv=["id", "-u"], user=65534))
    assert out2 == b"65534\n"
    assert res.exit_code == 0


async def test_exec_timeout_kills_the_process_group(ch: GuestChannel) -> None:
    proc = ch.exec(ExecSpec(shell="sleep 300 & echo $!; wait", timeout_s=0.5))
    async with proc:
        _, line = await proc.__anext__()
        child = int(line)
        res = await proc.wait()
    assert (res.timed_out, res.exit_code) == (True, -signal.SIGKILL)
    await _until(lambda: not _alive(child), "background child killed")


async def test_exec_signal(ch: GuestChannel) -> None:
    async with ch.exec(ExecSpec(argv=["sleep", "60"])) as proc:
        pid = await proc.started()
        assert _alive(pid)
        await proc.signal(signal.SIGTERM)
        res = await proc.wait()
    assert (res.exit_code, res.timed_out, res.pid) == (-signal.SIGTERM, False, pid)


async def test_exec_large_output_respects_flow_control(ch: GuestChannel) -> None:
    size = 8 * 1024 * 1024
    script = "import sys\nb = bytes(range(256)) * 4096\nfor _ in range(8): sys.stdout.buffer.write(b)\n"
    expected = hashlib.sha256((bytes(range(256)) * 4096) * 8).hexdigest()
    async with ch.exec(ExecSpec(argv=["python3", "-c", script])) as proc:
        queue = proc._stream.queue

        def queued() -> int:
            items = list(queue._queue)  # type: ignore[attr-defined]
            return sum(len(f.payload) - 1 for f in items if isinstance(f, Frame) and f.type is FrameType.DATA)

        # Without reading, the guest may only send one window; wait until the queue stops growing.
        last = -1
        while queued() != last:
            last = queued()
            await asyncio.sleep(0.3)
        assert 0 < last <= frames.INITIAL_WINDOW
        assert proc.exit is None
        digest = hashlib.sha256()
        total = 0
        async for kind, chunk in proc:
            assert kind == "stdout"
            digest.update(chunk)
            total += len(chunk)
        res = await proc.wait()
    assert (total, res.exit_code) == (size, 0)
    assert digest.hexdigest() == expected


async def test_run_caps_output_and_says_so(ch: GuestChannel) -> None:
    out, _, res = await ch.run(ExecSpec(shell="head -c 5000 /dev/zero"), max_output_bytes=1000)
    assert out == b"\0" * 1000
    assert res.output_truncated and res.exit_code == 0
    _, _, res2 = await ch.run(ExecSpec(shell="head -c 500 /dev/zero"), max_output_bytes=1000)
    assert not res2.output_truncated


async def test_exec_errors(ch: GuestChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        await ch.run(ExecSpec(argv=["/no/such/program"]))
    with pytest.raises(NotFound):
        await ch.run(ExecSpec(argv=["true"], cwd=str(tmp_path / "missing")))
    with pytest.raises(InvalidRequest):
        await ch.run(ExecSpec(argv=["true"], user="no-such-user-here"))
    out, _, _ = await ch.run(ExecSpec(argv=["echo", "still", "fine"]))
    assert out == b"still fine\n"


async def test_leaving_the_context_kills_the_process(ch: GuestChannel) -> None:
    async with ch.exec(ExecSpec(argv=["sleep", "60"])) as proc:
        pid = await proc.started()
    await _until(lambda: not _alive(pid), "process killed on cancel")


async def test_many_concurrent_streams(ch: GuestChannel, tmp_path: Path) -> None:
    blob = os.urandom(300_000)
    (tmp_path / "blob").write_bytes(blob)

    async def one(i: int) -> bytes:
        out, _, res = await ch.run(ExecSpec(shell=f"echo {i}; head -c 200000 /dev/zero"))
        assert res.exit_code == 0
        return out

    async def read() -> bytes:
        return b"".join([c async for c in ch.read_file(str(tmp_path / "blob"))])

    outs = await asyncio.gather(*(one(i) for i in range(8)), read(), ch.ping())
    for i in range(8):
        assert outs[i] == f"{i}\n".encode() + b"\0" * 200000
    assert outs[8] == blob
    assert outs[9]["pid"] > 0


# -- files ---------------------------------------------------------------------------------------


async def test_write_and_read_5_mib(ch: GuestChannel, tmp_path: Path) -> None:
    data = os.urandom(5 * 1024 * 1024)
    target = tmp_path / "big.bin"
    st = await ch.write_file(str(target), data, mode=0o600)
    assert (st["size"], st["mode"], st["type"]) == (len(data), 0o600, "file")
    got = b"".join([c async for c in ch.read_file(str(target))])
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert target.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["big.bin"]  # no temporary file left
    part = b"".join([c async for c in ch.read_file(str(target), offset=1000, length=70000)])
    assert part == data[1000:71000]


async def test_write_from_iterator_append_and_owner(ch: GuestChannel, tmp_path: Path) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(5):
            yield bytes([65 + i]) * 100_000

    target = tmp_path / "it.txt"
    await ch.write_file(str(target), chunks())
    await ch.write_file(str(target), b"tail", append=True)
    content = target.read_bytes()
    assert content == b"".join(bytes([65 + i]) * 100_000 for i in range(5)) + b"tail"
    st = await ch.write_file(str(tmp_path / "owned"), b"x", user="nobody")
    assert (st["uid"], st["gid"]) == (65534, 65534)


async def test_write_with_parents_makes_missing_directories(ch: GuestChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        await ch.write_file(str(tmp_path / "no" / "f"), b"x")
    st = await ch.write_file(str(tmp_path / "a" / "b" / "f"), b"x", user="nobody", parents=True)
    assert (tmp_path / "a" / "b" / "f").read_bytes() == b"x" and st["uid"] == 65534
    assert (tmp_path / "a").stat().st_uid == 65534 and (tmp_path / "a" / "b").stat().st_uid == 65534


async def test_a_write_to_proc_version_is_not_writable(ch: GuestChannel, tmp_path: Path) -> None:
    # /proc takes no new names, so the temp file beside /proc/version fails with ENOENT: the answer must
    # say the file is not writable, not that it does not exist.
    with pytest.raises(NotWritable, match="/proc/version is not writable") as info:
        await ch.write_file("/proc/version", b"x", parents=True)
    assert info.value.details["path"] == "/proc/version" and "No such file" not in info.value.message
    with pytest.raises(NotFound):  # a file truly missing stays not found
        await ch.write_file(str(tmp_path / "missing-dir" / "f"), b"x")


async def test_stat_list_mkdir_remove(ch: GuestChannel, tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    st = await ch.mkdir(str(deep))
    assert st.type == "dir" and deep.is_dir()
    await ch.write_file(str(tmp_path / "a" / "f.txt"), b"hello")
    os.symlink("f.txt", tmp_path / "a" / "link")
    entries = await ch.list_dir(str(tmp_path / "a"))
    assert [(e.name, e.type) for e in entries] == [("b", "dir"), ("f.txt", "file"), ("link", "symlink")]
    assert entries[1].size == 5 and entries[1].path == str(tmp_path / "a" / "f.txt")
    st2 = await ch.stat(str(tmp_path / "a" / "f.txt"))
    assert (st2.name, st2.size, st2.type) == ("f.txt", 5, "file")
    await ch.remove(str(tmp_path / "a" / "f.txt"))
    assert not (tmp_path / "a" / "f.txt").exists()
    await ch.remove(str(tmp_path / "a"), recursive=True)
    assert not (tmp_path / "a").exists()


async def test_list_large_directory(ch: GuestChannel, tmp_path: Path) -> None:
    for i in range(3000):
        (tmp_path / f"file-{i:05d}-{'x' * 40}").touch()
    entries = await ch.list_dir(str(tmp_path))
    assert len(entries) == 3000
    assert entries[0].name.startswith("file-00000") and entries[-1].name.startswith("file-02999")


async def test_file_errors(ch: GuestChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        await ch.stat(str(tmp_path / "missing"))
    with pytest.raises(NotFound):
        [c async for c in ch.read_file(str(tmp_path / "missing"))]
    with pytest.raises(InvalidRequest) as exc:
        [c async for c in ch.read_file(str(tmp_path))]
    assert exc.value.details["guest_code"] == "is_a_directory"
    with pytest.raises(NotFound):
        await ch.write_file(str(tmp_path / "no" / "dir" / "f"), b"x" * 3_000_000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").touch()
    with pytest.raises(Conflict):
        await ch.mkdir(str(tmp_path / "d"), exist_ok=False)
    with pytest.raises(InvalidRequest):
        await ch.remove(str(tmp_path / "d"))
    with pytest.raises(InvalidRequest):
        await ch.stat("relative/path")
    with pytest.raises(InvalidRequest) as exc:
        await ch.list_dir(str(tmp_path / "d" / "f"))
    assert exc.value.details["guest_code"] == "not_a_directory"
    assert (await ch.ping())["version"] == 1


async def test_directory_kind_errors_are_client_errors(ch: GuestChannel, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("file")
    with pytest.raises(InvalidRequest) as exc:
        await ch.write_file(str(tmp_path), b"x")
    assert exc.value.details["guest_code"] == "is_a_directory"
    with pytest.raises(InvalidRequest) as exc:
        await ch.run(ExecSpec(argv=["true"], cwd=str(tmp_path / "f")))
    assert exc.value.details["guest_code"] == "not_a_directory"
    with pytest.raises(InvalidRequest) as exc:
        await ch.mkdir(str(tmp_path / "f" / "sub"))
    assert exc.value.details["guest_code"] == "not_a_directory"
    with pytest.raises(InvalidRequest) as exc:
        await ch.mkdir(str(tmp_path / "f" / "sub"), parents=False)
    assert exc.value.details["guest_code"] == "not_a_directory"
    with pytest.raises(InvalidRequest) as exc:
        await ch.write_file(str(tmp_path / "f" / "sub"), b"x")
    assert exc.value.details["guest_code"] == "not_a_directory"
    assert (tmp_path / "f").read_text() == "file"


@pytest.mark.parametrize("append", [False, True])
async def test_write_refuses_to_replace_a_non_regular_file(ch: GuestChannel, tmp_path: Path, append: bool) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    targets = [fifo]
    link = tmp_path / "link-to-fifo"
    link.symlink_to(fifo)
    targets.append(link)
    dev = tmp_path / "null"
    try:
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own, never the host's
        targets.append(dev)
    except OSError:
        pass  # no CAP_MKNOD here: the FIFO stands for every non-regular file
    for target in targets:
        with pytest.raises(InvalidRequest, match="not a regular file") as exc:
            await ch.write_file(str(target), b"data", append=append)
        assert exc.value.details["guest_code"] == "invalid"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link)
    if dev in targets:
        assert stat.S_ISCHR(os.lstat(dev).st_mode)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".podbay-tmp")]
    # A symlink to a regular file is still written (the link is replaced, as before).
    (tmp_path / "real").write_bytes(b"old")
    (tmp_path / "link-to-real").symlink_to(tmp_path / "real")
    await ch.write_file(str(tmp_path / "link-to-real"), b"new", append=append)
    assert (tmp_path / "link-to-real").read_bytes() == (b"oldnew" if append else b"new")


# -- reconnects and hostile hosts ------------------------------------------------------------------


async def test_reconnect_in_the_middle_of_streams(guestd_socket: Path, tmp_path: Path) -> None:
    ch1 = await GuestChannel.connect(guestd_socket, timeout_s=30)
    proc = ch1.exec(ExecSpec(shell="echo start; exec sleep 60"))
    kind, line = await proc.__anext__()
    assert (kind, line) == ("stdout", b"start\n")
    pid = proc.pid
    assert pid is not None
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b"x" * 100_000
        await never.wait()
        yield b"never sent"

    writer = asyncio.create_task(ch1.write_file(str(tmp_path / "half"), stalled()))
    await _until(lambda: any(p.name.endswith(".podbay-tmp") for p in tmp_path.iterdir()), "temp file")
    await ch1.close()
    with pytest.raises(ChannelClosed) as exc:
        await proc.wait()
    assert exc.value.retryable
    with pytest.raises(ChannelClosed):
        await writer
    assert ch1.closed
    with pytest.raises(ChannelClosed):
        await ch1.ping()

    ch2 = await GuestChannel.connect(guestd_socket, timeout_s=30)
    try:
        assert (await ch2.ping())["session"] == ch2.info.session  # type: ignore[union-attr]
        # The old session's exec survives (orphaned, output dropped); its file transfer was abandoned.
        assert _alive(pid)
        await _until(lambda: list(tmp_path.iterdir()) == [], "temp file of the abandoned write removed")
        out, _, _ = await ch2.run(ExecSpec(argv=["echo", "again"]))
        assert out == b"again\n"
    finally:
        os.kill(pid, signal.SIGKILL)
        await ch2.close()


class RawHost:
    """A bare socket speaking frames to guestd, for inputs the real client never sends."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(20)
        self.dec = Decoder()
        self.frames: list[Frame] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def wait_for(self, stream: int, ftype: FrameType) -> Frame:
        while True:
            for i, frame in enumerate(self.frames):
                if frame.stream == stream and frame.type is ftype:
                    return self.frames.pop(i)
            data = self.sock.recv(65536)
            assert data, "guestd closed the connection"
            self.frames += self.dec.feed(data)

    def close(self) -> None:
        self.sock.close()


async def test_hostile_host_input_fails_only_that_stream(guestd_socket: Path) -> None:
    raw = await asyncio.to_thread(RawHost, guestd_socket)
    pids: list[int] = []
    try:

        def scenario() -> None:
            raw.send(frames.encode_json(FrameType.HELLO, 0, {"version": 1, "session": "raw-1"}))
            raw.wait_for(0, FrameType.HELLO)
            raw.send(os.urandom(5000))  # garbage
            raw.send(frames.encode_frame(FrameType.OPEN, 11, b"{not json"))
            raw.send(frames.encode_json(FrameType.OPEN, 12, {"op": "format_disk", "args": {}}))
            raw.send(frames.encode_json(FrameType.OPEN, 13, {"op": "stat", "args": [1, 2]}))
            raw.send(frames.encode_json(FrameType.OPEN, 14, {"op": "exec", "args": {"argv": "not-a-list"}}))
            raw.send(frames.encode_frame(FrameType.DATA, 999, b"\x03orphan data"))
            # A process that never reads stdin: the guest grants no credit, and the host overruns the window.
            sleeper = {"op": "exec", "args": {"argv": ["sleep", "60"], "stdin": True}}
            raw.send(frames.encode_json(FrameType.OPEN, 15, sleeper))
            pids.append(frames.parse_json(raw.wait_for(15, FrameType.STARTED).payload)["pid"])
            chunk = frames.encode_data(15, 0, b"y" * frames.CHUNK_SIZE)
            for _ in range(frames.INITIAL_WINDOW // frames.CHUNK_SIZE + 2):
                raw.send(chunk)
            for sid in (11, 12, 13, 14, 15):
                err = frames.parse_json(raw.wait_for(sid, FrameType.ERROR).payload)
                assert err["code"] == "invalid", (sid, err)
            raw.send(frames.encode_json(FrameType.OPEN, 16, {"op": "ping", "args": {}}))
            assert frames.parse_json(raw.wait_for(16, FrameType.RESULT).payload)["session"] == "raw-1"

        await asyncio.to_thread(scenario)
    finally:
        raw.close()
    ch = await GuestChannel.connect(guestd_socket, timeout_s=30)
    try:
        assert (await ch.ping())["version"] == 1
        await _until(lambda: not _alive(pids[0]), "the overrunning exec was killed")
    finally:
        await ch.close()


async def test_torn_frame_from_a_vanished_host_then_reconnect(guestd_socket: Path) -> None:
    """A host that dies mid-frame leaves guestd waiting for a payload that never comes; the next host's
    HELLO must still get through (the guest never sees the disconnect)."""
    raw = await asyncio.to_thread(RawHost, guestd_socket)
    torn = frames.encode_data(77, 0, b"z" * 200_000)
    await asyncio.to_thread(raw.send, torn[:5000])
    raw.close()
    ch = await GuestChannel.connect(guestd_socket, timeout_s=30)
    try:
        assert (await ch.ping())["version"] == 1
        out, _, _ = await ch.run(ExecSpec(argv=["echo", "ok"]))
        assert out == b"ok\n"
    finally:
        await ch.close()


async def test_exec_process_is_an_async_iterator(ch: GuestChannel) -> None:
    proc = ch.exec(ExecSpec(shell="echo a; echo b >&2"))
    assert isinstance(proc, ExecProcess)
    events = sorted([e async for e in proc])
    assert events == [("stderr", b"b\n"), ("stdout", b"a\n")]
    assert (await proc.wait()).exit_code == 0


# -- spawn paths and the worker pool ---------------------------------------------------------------

_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


def _ignored(status: bytes) -> set[int]:
    """Signal numbers in the SigIgn mask of a /proc/<pid>/status text."""
    line = next(ln for ln in status.decode().splitlines() if ln.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


@pytest.mark.parametrize("cwd", [None, "/"], ids=["home-posix-spawn", "other-dir-popen"])
async def test_exec_children_get_default_signals_and_the_right_cwd(ch: GuestChannel, cwd: str | None) -> None:
    """Both ways of starting a process (posix_spawn in guestd's home, Popen elsewhere) give the child
    default SIGPIPE/SIGXFSZ (guestd itself ignores them), a session of its own and the asked cwd."""
    out, _, res = await ch.run(ExecSpec(argv=["cat", "/proc/self/status"], cwd=cwd))
    assert res.exit_code == 0
    assert not _ignored(out) & set(_DEFAULT_SIGNALS)
    out, _, _ = await ch.run(ExecSpec(shell="pwd; echo $$; cat /proc/$$/stat", cwd=cwd))
    pwd, pid, stat = out.decode().split("\n", 2)
    sid = stat.rsplit(")", 1)[1].split()[3]  # fields after the command: state, ppid, pgrp, session
    assert pwd == (cwd or "/root")
    assert sid == pid


@pytest.mark.parametrize(
    ("user", "needle"),
    [
        (99999999999, "no such user: 99999999999"),
        ("99999999999", "no such user: 99999999999"),
        (2**32 - 1, "no such user: 4294967295"),
        (-1, "no such user: -1"),
        ("no-such-user-here", "no such user: 'no-such-user-here'"),
    ],
)
async def test_exec_and_write_reject_unknown_users(
    ch: GuestChannel, tmp_path: Path, user: str | int, needle: str
) -> None:
    with pytest.raises(InvalidRequest) as exc:
        await ch.run(ExecSpec(argv=["true"], user=user))
    assert needle in str(exc.value) and exc.value.details["guest_code"] == "invalid"
    with pytest.raises(InvalidRequest, match="no such user"):
        await ch.write_file(str(tmp_path / "f"), b"x", user=user)
    assert not (tmp_path / "f").exists()


async def test_exec_highest_uid_without_passwd_entry_runs(ch: GuestChannel) -> None:
    out, _, res = await ch.run(ExecSpec(argv=["id", "-u"], user=2**32 - 2))
    assert (out, res.exit_code) == (b"4294967294\n", 0)


@pytest.mark.parametrize("user", [None, "nobody"])
async def test_exec_empty_program_name_is_invalid(ch: GuestChannel, user: str | None) -> None:
    with pytest.raises(InvalidRequest, match="empty program name") as exc:
        await ch.run(ExecSpec(argv=[""], user=user))
    assert exc.value.details["guest_code"] == "invalid"


async def test_exec_missing_or_unrunnable_program(ch: GuestChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no-such-program-here"):
        await ch.run(ExecSpec(argv=["no-such-program-here"]))
    with pytest.raises(NotFound, match="no-such-program-here"):
        await ch.run(ExecSpec(argv=["no-such-program-here"], user="nobody"))
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(PermissionDenied) as info:  # 403, as the CLI's 126: not the guest's failure
        await ch.run(ExecSpec(argv=[str(script)]))
    assert info.value.details["guest_code"] == "permission_denied"
    with pytest.raises(NotFound):  # looked up in the child's PATH, not guestd's
        await ch.run(ExecSpec(argv=["true"], env={"PATH": str(tmp_path)}))


async def test_exec_result_does_not_wait_for_a_daemon_holding_the_pipes(ch: GuestChannel) -> None:
    """A background child keeping stdout open delays the RESULT only by the quiet-pipe wait, not
    until it exits; its later output is drained and dropped."""
    out, _, res = await ch.run(ExecSpec(shell="(sleep 30; echo late) & echo now", timeout_s=20))
    assert (out, res.exit_code, res.timed_out) == (b"now\n", 0, False)


async def test_many_sequential_and_concurrent_ops_reuse_workers(ch: GuestChannel) -> None:
    """More concurrent operations than idle workers, then many short ones: all answer, in any order."""
    results = await asyncio.gather(*(ch.run(ExecSpec(shell=f"sleep 0.2; echo {i}")) for i in range(24)))
    assert [int(out) for out, _, _ in results] == list(range(24))
    for i in range(30):
        out, _, res = await ch.run(ExecSpec(argv=["echo", str(i)]))
        assert (out, res.exit_code) == (f"{i}\n".encode(), 0)
    pings = await asyncio.gather(*(ch.ping() for _ in range(50)))
    assert len({p["pid"] for p in pings}) == 1
