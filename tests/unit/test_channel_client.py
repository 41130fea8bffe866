"""GuestChannel against a scripted fake guest: error mapping, flow control, and hostile guests."""

from __future__ import annotations

import asyncio
import os
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from podbay.channel import frames
from podbay.channel.client import ChannelBroken, ChannelClosed, GuestChannel
from podbay.channel.frames import Decoder, Frame, FrameType
from podbay.contracts.channel import ExecSpec
from podbay.errors import (Conflict, GuestError, InvalidRequest, NoSpace, NotFound, NotWritable, PermissionDenied,
                           Timeout)

Handler = Callable[["FakeGuest", int, dict[str, Any]], Awaitable[None]]


def _info(session: str | None) -> dict[str, Any]:
    return {"version": 1, "boot_id": "b", "uptime_s": 1.0, "pid": 1, "hostname": "fake", "session": session}


class FakeGuest:
    """A unix-socket server that answers HELLO and runs ``handlers[op]`` for each OPEN."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handlers: dict[str, Handler] = {"ping": self._ping}
        self.hello: Callable[[str], list[bytes]] = lambda s: [frames.encode_json(FrameType.HELLO, 0, _info(s))]
        self.received: list[Frame] = []
        self.writer: asyncio.StreamWriter | None = None
        self.server: asyncio.AbstractServer | None = None
        self.connections = 0
        self.session: str | None = None

    async def start(self) -> FakeGuest:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def stop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def send(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)

    def send_json(self, ftype: FrameType, sid: int, obj: Any) -> None:
        self.send(frames.encode_json(ftype, sid, obj))

    def got(self, ftype: FrameType, sid: int | None = None) -> list[Frame]:
        return [f for f in self.received if f.type is ftype and (sid is None or f.stream == sid)]

    async def _ping(self, guest: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        self.send_json(FrameType.RESULT, sid, _info(self.session))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.connections += 1
        dec = Decoder()
        tasks: set[asyncio.Task[None]] = set()
        try:
            while data := await reader.read(65536):
                for frame in dec.feed(data):
                    self.received.append(frame)
                    if frame.type is FrameType.HELLO:
                        self.session = frames.parse_json(frame.payload)["session"]
                        for chunk in self.hello(self.session):
                            self.send(chunk)
                    elif frame.type is FrameType.OPEN:
                        req = frames.parse_json(frame.payload)
                        task = asyncio.create_task(self.handlers[req["op"]](self, frame.stream, req["args"]))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            for task in list(tasks):
                task.cancel()
            writer.close()


@pytest.fixture
async def guest(tmp_path: Path) -> AsyncIterator[FakeGuest]:
    fake = await FakeGuest(tmp_path / "fake.sock").start()
    yield fake
    await fake.stop()


@pytest.fixture
async def ch(guest: FakeGuest) -> AsyncIterator[GuestChannel]:
    channel = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=10)
    yield channel
    await channel.close()


def _stat(path: str) -> dict[str, Any]:
    return {"path": path, "name": "x", "type": "file", "size": 1, "mode": 420, "mtime": 0.0}


async def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(400):
        if predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never happened: {what}")


async def test_ping_and_hello_info(guest: FakeGuest, ch: GuestChannel) -> None:
    assert ch.info is not None and ch.info.hostname == "fake"
    assert (await ch.ping())["session"] == guest.session
    assert not ch.closed


@pytest.mark.parametrize(
    ("code", "exc"),
    [
        ("not_found", NotFound),
        ("exists", Conflict),
        ("invalid", InvalidRequest),
        ("is_a_directory", InvalidRequest),
        ("not_a_directory", InvalidRequest),
        ("permission_denied", PermissionDenied),
        ("no_space", NoSpace),
        ("io_error", GuestError),
    ],
)
async def test_guest_errors_map_to_podbay_errors(
    guest: FakeGuest, ch: GuestChannel, code: str, exc: type[Exception]
) -> None:
    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.ERROR, sid, {"code": code, "message": "nope"})

    guest.handlers["stat"] = stat
    with pytest.raises(exc) as info:
        await ch.stat("/x")
    assert info.value.details["guest_code"] == code  # type: ignore[attr-defined]
    if exc is GuestError:
        assert type(info.value) is GuestError
    else:
        assert not isinstance(info.value, GuestError)  # a client error (4xx), not the guest's fault


async def test_malformed_error_and_result_fail_only_that_request(guest: FakeGuest, ch: GuestChannel) -> None:
    answers = iter(
        [
            frames.encode_frame(FrameType.ERROR, 0, b"{broken"),
            frames.encode_frame(FrameType.RESULT, 0, b"{broken"),
            frames.encode_frame(FrameType.RESULT, 0, b'{"path": 5}'),
            frames.encode_frame(FrameType.RESULT, 0, b"[1, 2]"),
        ]
    )

    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        bad = Decoder().feed(next(answers))[0]
        g.send(frames.encode_frame(bad.type, sid, bad.payload))

    guest.handlers["stat"] = stat
    for _ in range(4):
        with pytest.raises(GuestError):
            await ch.stat("/x")
        assert (await ch.ping())["hostname"] == "fake"


async def test_oversized_frame_is_dropped_and_the_request_times_out(guest: FakeGuest, tmp_path: Path) -> None:
    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        head = struct.pack(">2sBBIII", b"PB", 1, FrameType.RESULT, sid, 1 << 30, 0)
        g.send(head + zlib.crc32(head).to_bytes(4, "big") + b"x" * 1000)

    guest.handlers["stat"] = stat
    ch = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=0.5)
    try:
        with pytest.raises(Timeout):
            await ch.stat("/x")
        await _wait_for(lambda: bool(guest.got(FrameType.CANCEL)), "CANCEL after the timeout")
        assert (await ch.ping())["hostname"] == "fake"
    finally:
        await ch.close()


async def test_unknown_streams_and_garbage_are_ignored(guest: FakeGuest, ch: GuestChannel) -> None:
    async def ping(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        for bogus in (sid + 1000, 0xFFFFFFFF, 0):
            g.send(os.urandom(777))
            g.send(frames.encode_data(bogus, 1, b"stray"))
            g.send_json(FrameType.RESULT, bogus, {"x": 1})
            g.send(frames.encode_credit(bogus, 5))
        g.send_json(FrameType.RESULT, sid, _info(g.session))

    guest.handlers["ping"] = ping
    assert (await ch.ping())["hostname"] == "fake"
    assert ch.ignored_frames >= 6


async def test_data_beyond_the_window_fails_that_exec(guest: FakeGuest, ch: GuestChannel) -> None:
    async def flood(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.STARTED, sid, {"pid": 9})
        chunk = frames.encode_data(sid, 1, b"a" * frames.CHUNK_SIZE)
        for _ in range(64):  # 4 MiB without waiting for credit
            g.send(chunk)
            await asyncio.sleep(0)

    guest.handlers["exec"] = flood
    async with ch.exec(ExecSpec(argv=["yes"])) as proc:
        # Nothing is read, so no credit goes out: the guest may send one window and no more.
        await _wait_for(lambda: bool(guest.got(FrameType.CANCEL)), "CANCEL of the flooding stream")
        received = 0
        with pytest.raises(GuestError, match="window"):
            async for _, data in proc:
                received += len(data)
        assert received <= frames.INITIAL_WINDOW
    assert (await ch.ping())["hostname"] == "fake"


async def test_endless_output_within_credit_ends_at_the_host_deadline(guest: FakeGuest) -> None:
    async def endless(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.STARTED, sid, {"pid": 9})
        granted = frames.INITIAL_WINDOW
        sent = 0
        while True:  # honours credit, never ends
            granted = frames.INITIAL_WINDOW + sum(frames.parse_u32(f.payload) for f in g.got(FrameType.CREDIT, sid))
            if sent < granted:
                g.send(frames.encode_data(sid, 1, b"b" * frames.CHUNK_SIZE))
                sent += frames.CHUNK_SIZE
            await asyncio.sleep(0.001)

    guest.handlers["exec"] = endless
    ch = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=0.3)
    try:
        with pytest.raises(Timeout):
            await ch.run(ExecSpec(argv=["yes"], timeout_s=0.2), max_output_bytes=1000)
        assert (await ch.ping())["hostname"] == "fake"
    finally:
        await ch.close()


async def test_endless_control_frames_fail_that_exec(guest: FakeGuest, ch: GuestChannel) -> None:
    async def chatter(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        for _ in range(1000):
            g.send_json(FrameType.STARTED, sid, {"pid": 9})
            await asyncio.sleep(0)

    guest.handlers["exec"] = chatter
    with pytest.raises(GuestError, match="control"):
        await ch.run(ExecSpec(argv=["true"]))
    assert (await ch.ping())["hostname"] == "fake"


async def test_read_file_returns_credit_and_gets_everything(guest: FakeGuest, ch: GuestChannel) -> None:
    total = 3 * frames.INITIAL_WINDOW
    credit = asyncio.Event()
    window = [frames.INITIAL_WINDOW]

    async def read(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        sent = 0
        while sent < total:
            while window[0] <= 0:  # a well-behaved guest waits for CREDIT
                credit.clear()
                await credit.wait()
            n = min(frames.CHUNK_SIZE, window[0], total - sent)
            g.send(frames.encode_data(sid, 3, bytes([sent % 251]) * n))
            window[0] -= n
            sent += n
            await asyncio.sleep(0)
        g.send_json(FrameType.RESULT, sid, {"size": sent})

    async def watch_credit() -> None:
        seen = 0
        while True:
            got = guest.got(FrameType.CREDIT)
            for f in got[seen:]:
                window[0] += frames.parse_u32(f.payload)
                credit.set()
            seen = len(got)
            await asyncio.sleep(0.005)

    guest.handlers["read"] = read
    watcher = asyncio.create_task(watch_credit())
    try:
        size = 0
        async for chunk in ch.read_file("/big"):
            size += len(chunk)
    finally:
        watcher.cancel()
    assert size == total
    granted = sum(frames.parse_u32(f.payload) for f in guest.got(FrameType.CREDIT))
    assert granted >= total - frames.INITIAL_WINDOW


async def test_silent_guest_times_out_and_is_cancelled(guest: FakeGuest, tmp_path: Path) -> None:
    async def silent(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        await asyncio.sleep(3600)

    guest.handlers["stat"] = silent
    ch = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=0.3)
    try:
        with pytest.raises(Timeout):
            await ch.stat("/x")
        await _wait_for(lambda: bool(guest.got(FrameType.CANCEL)), "CANCEL after the timeout")
    finally:
        await ch.close()


async def test_connection_drop_fails_pending_requests_and_reconnect_works(guest: FakeGuest, ch: GuestChannel) -> None:
    async def drop(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.STARTED, sid, {"pid": 9})
        assert g.writer is not None
        g.writer.close()

    guest.handlers["exec"] = drop
    with pytest.raises(ChannelClosed) as info:
        await ch.run(ExecSpec(argv=["sleep", "9"]))
    assert info.value.retryable and isinstance(info.value, GuestError)
    await _wait_for(lambda: ch.closed, "channel marked closed")
    with pytest.raises(ChannelClosed):
        await ch.ping()
    with pytest.raises(ChannelClosed):
        ch.exec(ExecSpec(argv=["true"]))
    again = await GuestChannel.connect(guest.path, timeout_s=10)
    try:
        assert (await again.ping())["hostname"] == "fake"
        assert guest.connections == 2
    finally:
        await again.close()


async def test_connect_times_out_without_a_guest(tmp_path: Path) -> None:
    with pytest.raises(Timeout):
        await GuestChannel.connect(tmp_path / "nothing.sock", timeout_s=0.3)


async def test_connect_times_out_when_the_guest_never_says_hello(guest: FakeGuest) -> None:
    guest.hello = lambda session: []
    with pytest.raises(Timeout):
        await GuestChannel.connect(guest.path, timeout_s=0.6)
    assert len(guest.got(FrameType.HELLO)) >= 2  # HELLO is re-sent while waiting


async def test_connect_retries_until_the_socket_appears(tmp_path: Path) -> None:
    fake = FakeGuest(tmp_path / "late.sock")

    async def late_start() -> None:
        await asyncio.sleep(0.3)
        await fake.start()

    starter = asyncio.create_task(late_start())
    try:
        ch = await GuestChannel.connect(fake.path, timeout_s=10)
        assert (await ch.ping())["hostname"] == "fake"
        await ch.close()
    finally:
        await starter
        await fake.stop()


async def test_connect_ignores_hellos_of_other_sessions(guest: FakeGuest) -> None:
    guest.hello = lambda s: [
        frames.encode_json(FrameType.HELLO, 0, _info("someone-else")),
        frames.encode_json(FrameType.HELLO, 0, _info(s)),
    ]
    ch = await GuestChannel.connect(guest.path, timeout_s=10)
    assert ch.info is not None and ch.info.session == guest.session
    await ch.close()


@pytest.mark.parametrize(
    "payload",
    [b"{bad json", b'{"version": 1}', frames.json_payload({**_info("X"), "version": 99})],
)
async def test_connect_rejects_a_malformed_or_incompatible_hello(guest: FakeGuest, payload: bytes) -> None:
    def hello(session: str) -> list[bytes]:
        body = payload.replace(b'"X"', f'"{session}"'.encode())
        return [frames.encode_frame(FrameType.HELLO, 0, body)]

    guest.hello = hello
    with pytest.raises(GuestError):
        await GuestChannel.connect(guest.path, timeout_s=5)


async def test_request_checks(ch: GuestChannel) -> None:
    with pytest.raises(InvalidRequest):
        ch.exec(ExecSpec(argv=["echo", "x" * frames.MAX_PAYLOAD]))
    proc = ch.exec(ExecSpec(argv=["true"]))
    with pytest.raises(InvalidRequest):
        await proc.write_stdin(b"x")
    with pytest.raises(ValueError):
        ExecSpec(argv=["a"], shell="b")
    with pytest.raises(ValueError):
        ExecSpec()


async def test_list_count_mismatch_is_a_guest_error(guest: FakeGuest, ch: GuestChannel) -> None:
    async def listing(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send(frames.encode_data(sid, 3, (frames.json_payload(_stat("/a")) + b"\n")))
        g.send_json(FrameType.RESULT, sid, {"count": 2})

    guest.handlers["list"] = listing
    with pytest.raises(GuestError, match="counted"):
        await ch.list_dir("/")


async def test_write_stops_when_the_guest_fails_early(guest: FakeGuest, ch: GuestChannel) -> None:
    async def write(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.ERROR, sid, {"code": "not_found", "message": "no parent"})

    never = asyncio.Event()

    async def source() -> AsyncIterator[bytes]:
        yield b"x" * 1000
        await never.wait()
        yield b"y"

    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.ERROR, sid, {"code": "not_found", "message": "no such file"})

    guest.handlers["write"] = write
    guest.handlers["stat"] = stat
    with pytest.raises(NotFound):
        await ch.write_file("/missing/f", source())


async def test_a_write_to_an_existing_file_that_is_not_found_is_not_writable(
        guest: FakeGuest, ch: GuestChannel) -> None:
    # guestd's temp file beside /proc/version cannot be made (ENOENT), yet /proc/version is there.
    async def write(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.ERROR, sid, {"code": "not_found", "message": "/proc/version: No such file or directory"})

    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.RESULT, sid, _stat(args["path"]))

    guest.handlers["write"] = write
    guest.handlers["stat"] = stat
    with pytest.raises(NotWritable) as info:
        await ch.write_file("/proc/version", b"x")
    assert info.value.code == "not_writable" and info.value.http_status == 403
    assert "/proc/version is not writable" in info.value.message and "No such file" not in info.value.message
    assert info.value.details == {"path": "/proc/version", "guest_code": "permission_denied"}


async def test_a_write_refused_for_permission_is_not_writable(guest: FakeGuest, ch: GuestChannel) -> None:
    async def write(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send_json(FrameType.ERROR, sid, {"code": "permission_denied", "message": "/etc/shadow: Permission denied"})

    guest.handlers["write"] = write
    with pytest.raises(NotWritable, match="/etc/shadow is not writable: /etc/shadow: Permission denied"):
        await ch.write_file("/etc/shadow", b"x")


def _torn(sid: int, n: int) -> bytes:
    """``n`` frames whose header is valid and whose payload CRC is not: each one a bad frame."""
    out = b""
    for _ in range(n):
        head = struct.pack(">2sBBIII", b"PB", 1, FrameType.RESULT, sid, 4, 0xDEADBEEF)
        out += head + zlib.crc32(head).to_bytes(4, "big") + b"{}{}"
    return out


async def test_bad_frames_in_a_row_drop_the_channel_with_a_clear_error(guest: FakeGuest) -> None:
    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send(_torn(sid, 3))

    guest.handlers["stat"] = stat
    ch = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=10, max_bad_frames=3)
    try:
        with pytest.raises(ChannelBroken) as info:
            await ch.stat("/x")  # fails at once, not after the request timeout
        assert info.value.code == "guest_channel_broken" and info.value.details["bad_frames"] == 3
        assert "bad frames" in info.value.message
        assert ch.closed
        with pytest.raises(ChannelBroken):
            await ch.ping()
    finally:
        await ch.close()


async def test_fewer_bad_frames_than_the_limit_keep_the_channel(guest: FakeGuest) -> None:
    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send(_torn(sid, 2))
        g.send_json(FrameType.RESULT, sid, _stat("/x"))

    guest.handlers["stat"] = stat
    ch = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=10, max_bad_frames=3)
    try:
        for _ in range(3):  # a delivered frame resets the count
            assert (await ch.stat("/x")).path == "/x"
        assert not ch.closed
    finally:
        await ch.close()


async def test_a_garbage_flood_without_headers_drops_the_channel(guest: FakeGuest) -> None:
    async def stat(g: FakeGuest, sid: int, args: dict[str, Any]) -> None:
        g.send(b"P\0" * (3 * (frames.HEADER_SIZE + frames.MAX_PAYLOAD) // 2 + 1))

    guest.handlers["stat"] = stat
    ch = await GuestChannel.connect(guest.path, timeout_s=10, request_timeout_s=10, max_bad_frames=3)
    try:
        with pytest.raises(ChannelBroken):
            await ch.stat("/x")
    finally:
        await ch.close()


def test_a_broken_channel_reads_as_a_guest_error_on_the_far_side() -> None:
    from podbay.errors import error_from_wire

    err = ChannelBroken("guest channel dropped: the guest sent 8 bad frames in a row", details={"bad_frames": 8})
    back = error_from_wire(err.to_wire(), err.http_status)
    assert isinstance(back, GuestError) and back.code == "guest_channel_broken" and back.http_status == 502
    assert back.details == {"bad_frames": 8}
