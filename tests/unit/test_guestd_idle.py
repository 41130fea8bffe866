"""guestd's reader sleeps while idle (a guest wakeup is emulated under TCG, so idle polling costs host CPU);
it polls briefly only while a torn frame may need timing out or a stop event is watched."""

from __future__ import annotations

import threading

import pytest
from podbay.channel import frames
from podbay_guestd.ops_system import FakeSystem, GuestState
from podbay_guestd.port import Port
from podbay_guestd.server import IDLE_READ_S, PARTIAL_STALL_S, Server


class _Done(Exception):
    pass


class ScriptedPort(Port):
    """Returns the scripted reads in turn, recording each read's timeout; raises ``_Done`` after the last."""

    def __init__(self, reads: list[bytes | None]) -> None:
        self.reads = list(reads)
        self.timeouts: list[float] = []

    def read(self, timeout_s: float) -> bytes | None:
        self.timeouts.append(timeout_s)
        if not self.reads:
            raise _Done
        return self.reads.pop(0)

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _server(port: Port, tmp_path) -> Server:  # type: ignore[no-untyped-def]
    return Server(port, {}, GuestState(FakeSystem(str(tmp_path / "calls.jsonl"))))


def test_an_idle_reader_waits_long_and_a_partial_frame_shortens_the_wait(tmp_path) -> None:  # type: ignore[no-untyped-def]
    whole = frames.encode_data(5, 1, b"for no stream: counted and ignored")
    port = ScriptedPort([None, None, whole[:-3], None, whole[-3:], None])
    with pytest.raises(_Done):
        _server(port, tmp_path).serve_forever()
    idle, partial = port.timeouts[0], port.timeouts[3]
    assert port.timeouts[:3] == [IDLE_READ_S] * 3
    # While part of a frame waits for its rest, the reader wakes in time to notice a stalled one.
    assert partial < PARTIAL_STALL_S < idle
    # Once the frame completed, the reader goes back to its idle wait.
    assert port.timeouts[5] == IDLE_READ_S


def test_a_stop_event_is_watched_with_short_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = ScriptedPort([None, None])
    with pytest.raises(_Done):
        _server(port, tmp_path).serve_forever(stop=threading.Event())
    assert all(t < PARTIAL_STALL_S for t in port.timeouts)
