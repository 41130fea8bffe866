"""guestd's machine operations (after_restore, freeze/thaw) against the recording fake, and the pty port."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
import tty
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from podbay.channel import frames
from podbay.channel.client import GuestChannel
from podbay.channel.frames import Decoder, FrameType
from podbay.contracts.channel import ExecSpec, GuestVolume, Op
from podbay.errors import InvalidRequest


@pytest.fixture(scope="module")
def guestd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("guestd_sys")
    sock, log = d / "ch.sock", d / "system.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "podbay_guestd", "--listen", str(sock), "--fake-system", str(log)],
        stderr=subprocess.DEVNULL,
    )
    yield sock, log
    proc.terminate()
    proc.wait(10)


@pytest.fixture
async def ch(guestd: tuple[Path, Path]) -> AsyncIterator[GuestChannel]:
    channel = await GuestChannel.connect(guestd[0], timeout_s=30)
    yield channel
    await channel.close()


def _calls(log: Path) -> list[list[object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


async def test_after_restore(ch: GuestChannel, guestd: tuple[Path, Path]) -> None:
    log = guestd[1]
    seed = os.urandom(64)
    clock = 1_800_000_000_000_000_000
    res = await ch.after_restore(hostname="sb-42", seed=seed, time_ns=clock, env={"SANDBOX_ID": "sb-42"})
    assert (res.hostname, res.entropy_credited, res.crng_reseeded, res.clock_set, res.env_keys) == (
        "sb-42",
        True,
        True,
        True,
        ["SANDBOX_ID"],
    )
    calls = _calls(log)
    assert ["set_clock", clock] in calls
    # the seed must reach /dev/urandom now, not at the kernel's next scheduled reseed
    added = calls.index(["add_entropy", base64.b64encode(seed).decode()])
    assert calls.index(["reseed_crng", None]) > added
    assert ["set_hostname", "sb-42"] in calls
    assert (await ch.ping())["hostname"] == "sb-42"
    out, _, _ = await ch.run(ExecSpec(shell='echo "$SANDBOX_ID"'))
    assert out == b"sb-42\n"
    out, _, _ = await ch.run(ExecSpec(shell='echo "$SANDBOX_ID"', env={"SANDBOX_ID": "override"}))
    assert out == b"override\n"
    await ch.after_restore(env={})
    out, _, _ = await ch.run(ExecSpec(shell='echo "${SANDBOX_ID:-unset}"'))
    assert out == b"unset\n"


async def test_after_restore_hands_over_the_access_token(ch: GuestChannel, guestd: tuple[Path, Path]) -> None:
    res = await ch.after_restore(access_token="t" * 43)
    assert res.access_token_set
    assert ["set_access_token", "t" * 43] in _calls(guestd[1])
    assert not (await ch.after_restore(hostname="sb-43")).access_token_set


async def test_after_restore_mounts_volumes_by_slot(ch: GuestChannel, guestd: tuple[Path, Path]) -> None:
    vols = [GuestVolume(slot=0, path="/mnt/data"), GuestVolume(slot=2, path="/srv/ro/", readonly=True)]
    res = await ch.after_restore(volumes=vols)
    assert res.volumes_mounted == ["/mnt/data", "/srv/ro"]
    assert ["mount_volumes", [{"slot": 0, "path": "/mnt/data", "readonly": False},
                              {"slot": 2, "path": "/srv/ro", "readonly": True}]] in _calls(guestd[1])
    for bad in ([{"slot": 0, "path": "relative"}], [{"slot": 99, "path": "/x"}], [{"slot": 0, "path": "/a/../etc"}],
                [{"slot": True, "path": "/x"}], "not a list"):
        stream = ch.open_stream(Op.AFTER_RESTORE, {"volumes": bad})
        with pytest.raises(InvalidRequest):
            await ch.finish(stream, 10)


def test_a_slot_is_found_by_its_serial(tmp_path: Path) -> None:
    from podbay_guestd.volumes import slot_device

    for name, serial in (("vda", ""), ("vdb", "podbay-vol0"), ("vdc", "podbay-vol1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "serial").write_text(serial + "\n")
    assert slot_device(1, str(tmp_path)) == "/dev/vdc"
    with pytest.raises(FileNotFoundError):
        slot_device(3, str(tmp_path))


async def test_freeze_thaw_and_auto_thaw(ch: GuestChannel, guestd: tuple[Path, Path]) -> None:
    log = guestd[1]
    assert await ch.freeze(["/", "/data"], timeout_s=60) == ["/", "/data"]
    calls = _calls(log)
    i = calls.index(["sync", None])
    assert calls[i + 1 : i + 3] == [["freeze", "/"], ["freeze", "/data"]]
    assert await ch.thaw(["/", "/data"]) == ["/", "/data"]
    assert _calls(log)[-2:] == [["thaw", "/data"], ["thaw", "/"]]

    before = len(_calls(log))
    await ch.freeze(timeout_s=0.2)  # no thaw follows: guestd must thaw by itself
    for _ in range(400):
        if ["thaw", "/"] in _calls(log)[before:]:
            break
        await asyncio.sleep(0.05)
    assert _calls(log)[before:][-1] == ["thaw", "/"]


async def test_bad_arguments_are_invalid(ch: GuestChannel) -> None:
    with pytest.raises(InvalidRequest):
        await ch.freeze(["relative"])
    with pytest.raises(InvalidRequest):
        await ch.thaw(["relative"])
    # Values the client's models would refuse, sent raw to check guestd's own validation.
    for args in ({"seed_b64": "***"}, {"hostname": ""}, {"time_ns": -1}, {"env": {"A": 1}}, {"access_token": "short"},
                 {"access_token": "x" * 20 + "\n"}):
        stream = ch.open_stream(Op.AFTER_RESTORE, args)
        with pytest.raises(InvalidRequest):
            await ch.finish(stream, 10)


def test_guestd_on_a_pty() -> None:
    """``--port`` on a character device (here a pty in raw mode), as in a VM's virtio port."""
    master, slave = os.openpty()
    tty.setraw(slave)  # no echo of our own HELLO, even before guestd sets raw mode itself
    path = os.ttyname(slave)
    proc = subprocess.Popen(
        [sys.executable, "-m", "podbay_guestd", "--port", path, "--fake-system", os.devnull],
        stderr=subprocess.DEVNULL,
    )
    try:
        os.close(slave)
        hello = frames.encode_json(FrameType.HELLO, 0, {"version": 1, "session": "pty"})
        dec = Decoder()
        got: list[frames.Frame] = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            os.write(master, hello)
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO until guestd has opened the slave side
                time.sleep(0.05)
                continue
            got += [f for f in dec.feed(data) if f.type is FrameType.HELLO]
        assert got, "no HELLO answer over the pty"
        info = frames.parse_json(got[0].payload)
        assert (info["session"], info["pid"]) == ("pty", proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        os.close(master)


async def test_guestd_runs_from_the_guest_image_layout(tmp_path: Path) -> None:
    """Only the standard library, guestd and the codec, laid out as in the image (/opt/podbay/lib)."""
    import shutil

    lib = tmp_path / "lib"
    shutil.copytree(Path(frames.__file__).parents[3] / "guestd", lib / "podbay_guestd")
    (lib / "podbay" / "channel").mkdir(parents=True)
    (lib / "podbay" / "__init__.py").write_text("")
    (lib / "podbay" / "channel" / "__init__.py").write_text("")
    shutil.copy(frames.__file__, lib / "podbay" / "channel" / "frames.py")
    sock = tmp_path / "img.sock"
    # -S: no site-packages (no pydantic, no editable podbay); -B: no bytecode writes, as in the VM.
    proc = subprocess.Popen(
        [sys.executable, "-S", "-B", "-m", "podbay_guestd", "--listen", str(sock), "--fake-system", os.devnull],
        env={"PYTHONPATH": str(lib), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        stderr=subprocess.DEVNULL,
    )
    try:
        ch = await GuestChannel.connect(sock, timeout_s=30)
        try:
            assert (await ch.ping())["pid"] == proc.pid
            out, _, res = await ch.run(ExecSpec(argv=["echo", "image"]))
            assert (out, res.exit_code) == (b"image\n", 0)
        finally:
            await ch.close()
    finally:
        proc.terminate()
        proc.wait(10)
    assert not list(lib.rglob("__pycache__"))


def test_the_hostname_goes_on_the_127_0_1_1_line_of_etc_hosts() -> None:
    """sudo and ``hostname -f`` resolve the machine's own name; a sandbox's name is new at every restore."""
    from guestd.ops_system import hosts_with_hostname

    template = "127.0.0.1\tlocalhost\n127.0.1.1\tpodbay\n\n# IPv6\n::1 localhost ip6-localhost\n"
    out = hosts_with_hostname(template, "sbx-1a2b")
    assert out == "127.0.0.1\tlocalhost\n127.0.1.1\tsbx-1a2b\n\n# IPv6\n::1 localhost ip6-localhost\n"
    assert hosts_with_hostname(out, "sbx-3c4d").count("127.0.1.1") == 1  # replaced, never added again
    assert hosts_with_hostname("127.0.0.1 localhost\n", "sbx-x") == "127.0.0.1 localhost\n127.0.1.1\tsbx-x\n"
    assert hosts_with_hostname("", "sbx-x") == "127.0.1.1\tsbx-x\n"
    # a commented-out line and a second 127.0.1.1 line: the comment stays, the duplicate goes
    assert hosts_with_hostname("#127.0.1.1 old\n127.0.1.1 a\n127.0.1.1 b\n", "n") == "#127.0.1.1 old\n127.0.1.1\tn\n"


def test_a_full_file_system_is_no_space() -> None:
    import errno

    from guestd.errors import from_oserror

    for code in (errno.ENOSPC, errno.EDQUOT):
        err = from_oserror(OSError(code, os.strerror(code), "/tmp/big"))
        assert err.code == "no_space" and err.message.startswith("/tmp/big: ")
