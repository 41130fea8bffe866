"""The guest console log (services/nodeagent/vm/console.py): capped, rotated, rate-limited, and read from QEMU's
console socket without ever blocking it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from podbay_nodeagent.vm.console import ConsoleLimits, ConsoleLog, pump
from podbay_nodeagent.vm.vmm import VmConfig, VmPaths, build_qemu_argv

KIB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_log_rotates_at_its_cap_and_keeps_one_older_file(tmp_path: Path) -> None:
    clock = Clock()
    log = ConsoleLog(tmp_path / "console.log", ConsoleLimits(max_bytes=10 * KIB, rate_bytes_s=1 << 30),
                     clock=clock)
    for i in range(50):
        clock.t += 1.0
        assert log.write(bytes([65 + i % 26]) * 1000) == 1000
    log.close()
    assert (tmp_path / "console.log").stat().st_size <= 10 * KIB
    assert (tmp_path / "console.log.1").stat().st_size <= 10 * KIB
    assert sorted(os.listdir(tmp_path)) == ["console.log", "console.log.1"]
    # The newest bytes are in console.log, the ones before them in console.log.1.
    assert (tmp_path / "console.log").read_bytes().endswith(bytes([65 + 49 % 26]) * 1000)


def test_one_huge_write_keeps_at_most_the_burst(tmp_path: Path) -> None:
    log = ConsoleLog(tmp_path / "console.log", ConsoleLimits(max_bytes=4 * KIB, rate_bytes_s=1 << 30),
                     clock=Clock())
    assert log.write(b"x" * (64 * KIB)) == 4 * KIB
    log.close()
    assert (tmp_path / "console.log.1").read_bytes() == b"x" * (4 * KIB)
    assert (tmp_path / "console.log").read_bytes().startswith(b"\n[podbay: 61440 console bytes dropped")


def test_bytes_over_the_rate_are_dropped_and_noted(tmp_path: Path) -> None:
    clock = Clock()
    log = ConsoleLog(tmp_path / "console.log", ConsoleLimits(max_bytes=8 * KIB, rate_bytes_s=1 * KIB), clock=clock)
    assert log.write(b"a" * (8 * KIB)) == 8 * KIB  # the burst
    assert log.write(b"b" * (16 * KIB)) == 0  # nothing left: dropped
    clock.t += 2.0  # two seconds at 1 KiB/s
    assert log.write(b"c" * (4 * KIB)) == 2 * KIB
    log.close()
    assert log.dropped == 16 * KIB + 2 * KIB and log.kept == 10 * KIB
    text = (tmp_path / "console.log").read_bytes() + (tmp_path / "console.log.1").read_bytes()
    assert b"[podbay: 16384 console bytes dropped over 1 KiB/s]" in text
    assert b"[podbay: 2048 console bytes dropped over 1 KiB/s]" in text  # noted at close


def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    (tmp_path / "console.log").symlink_to(secret)
    log = ConsoleLog(tmp_path / "console.log", ConsoleLimits(), clock=Clock())
    assert log.write(b"hello") == 0  # logged once, never raised
    assert secret.read_text() == "x"


def test_qemu_serial_console_is_a_socket_chardev(tmp_path: Path) -> None:
    paths = VmPaths(tmp_path)
    argv = build_qemu_argv(VmConfig(kernel=Path("k"), initrd=Path("i")), paths, tsc_khz=1)
    chardevs = [argv[i + 1] for i, a in enumerate(argv) if a == "-chardev"]
    assert f"socket,id=con0,path={paths.console_sock},server=on,wait=off" in chardevs
    assert not any(c.startswith("file,") for c in chardevs)
    assert paths.console_sock == tmp_path / "run" / "console.sock"


async def test_pump_reads_a_flood_into_a_capped_log_and_ends_at_eof(tmp_path: Path) -> None:
    sock = tmp_path / "console.sock"
    sent = 16 * 1024 * KIB

    async def qemu(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunk = b"flood\n" * 10923
        left = sent
        while left > 0:
            writer.write(chunk[:left])
            await writer.drain()
            left -= len(chunk)
        writer.close()

    server = await asyncio.start_unix_server(qemu, str(sock))
    log = ConsoleLog(tmp_path / "console.log", ConsoleLimits(max_bytes=1024 * KIB, rate_bytes_s=64 * KIB))
    try:
        await asyncio.wait_for(pump(sock, log), 60)
    finally:
        server.close()
        await server.wait_closed()
    assert (tmp_path / "console.log").stat().st_size <= 1024 * KIB
    assert log.kept + log.dropped == sent and log.dropped > 14 * 1024 * KIB


async def test_pump_without_a_socket_gives_up_quietly(tmp_path: Path) -> None:
    log = ConsoleLog(tmp_path / "console.log", ConsoleLimits())
    await asyncio.wait_for(pump(tmp_path / "missing.sock", log), 5)
    assert not (tmp_path / "console.log").exists()


async def test_a_second_reader_picks_up_after_the_first_goes(tmp_path: Path) -> None:
    """A node agent restart: the old reader's connection ends, the new one appends to the same log."""
    sock = tmp_path / "console.sock"
    conns: list[asyncio.StreamWriter] = []

    async def qemu(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        writer.write(f"line {len(conns)}\n".encode())
        await writer.drain()
        if len(conns) == 2:
            writer.close()

    server = await asyncio.start_unix_server(qemu, str(sock))
    path = tmp_path / "console.log"
    try:
        first = asyncio.create_task(pump(sock, ConsoleLog(path, ConsoleLimits())))
        while not path.exists() or not path.read_bytes():
            await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(pump(sock, ConsoleLog(path, ConsoleLimits())), 10)
    finally:
        server.close()
        await server.wait_closed()
    assert path.read_text() == "line 1\nline 2\n"
