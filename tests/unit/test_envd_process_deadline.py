"""envd's Start on the node (services/nodeagent/envd/process.py) with a fake guest channel: when the start
stream's ``Connect-Timeout-Ms`` (the SDK's command ``timeout``) passes, the stream ends with
DEADLINE_EXCEEDED and the process's group gets SIGKILL (E2B #500); a Connect's deadline kills nothing."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from podbay_nodeagent.envd.process import ProcessService, ProcessTable
from podbay_nodeagent.envd.proto.process import process_pb as pb

PID = 4242


class _Handle:
    """A kept process that runs until killed."""

    def __init__(self, killed: asyncio.Event) -> None:
        self._killed = killed

    async def started(self) -> int:
        return PID

    def __aiter__(self) -> _Handle:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        await self._killed.wait()
        raise StopAsyncIteration

    async def wait(self) -> Any:
        from podbay.contracts.channel import ExecExit

        return ExecExit(exit_code=-9, pid=PID)

    async def __aenter__(self) -> _Handle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Channel:
    def __init__(self) -> None:
        self.killed = asyncio.Event()
        self.signals: list[tuple[int, int]] = []

    async def procs(self) -> list[Any]:
        return []

    def exec(self, spec: Any) -> _Handle:
        return _Handle(self.killed)

    async def proc_signal(self, pid: int, signum: int) -> None:
        self.signals.append((pid, signum))
        if signum == signal.SIGKILL:
            self.killed.set()


class _Ctx:
    """A request context whose deadline is ``timeout_s`` from now."""

    def __init__(self, timeout_s: float) -> None:
        self.request_headers: dict[str, str] = {}
        self._deadline = time.monotonic() + timeout_s

    @property
    def timeout_ms(self) -> float:
        return (self._deadline - time.monotonic()) * 1000


async def _drain(stream: Any) -> ConnectError:
    with pytest.raises(ConnectError) as err:
        async for _ in stream:
            pass
    return err.value


async def test_a_start_past_its_deadline_kills_the_process_group() -> None:
    ch, table = _Channel(), ProcessTable()
    svc = ProcessService(lambda ctx: (ch, table))  # type: ignore[arg-type, return-value]
    req = pb.StartRequest(process=pb.ProcessConfig(cmd="/bin/bash", args=["-c", "sleep 300 & sleep 301"]))
    err = await asyncio.wait_for(_drain(svc.start(req, _Ctx(0.3))), 5)  # type: ignore[arg-type]
    assert err.code is Code.DEADLINE_EXCEEDED
    assert ch.signals == [(PID, signal.SIGKILL)]


async def test_a_connect_past_its_deadline_kills_nothing() -> None:
    ch, table = _Channel(), ProcessTable()
    svc = ProcessService(lambda ctx: (ch, table))  # type: ignore[arg-type, return-value]
    start = svc.start(pb.StartRequest(process=pb.ProcessConfig(cmd="sleep", args=["300"])),
                      _Ctx(60))  # type: ignore[arg-type]
    await start.__anext__()  # started
    sel = pb.ProcessSelector(selector=Oneof("pid", PID))
    err = await asyncio.wait_for(_drain(svc.connect(pb.ConnectRequest(process=sel), _Ctx(0.3))), 5)  # type: ignore[arg-type]
    assert err.code is Code.DEADLINE_EXCEEDED and ch.signals == []
    await start.aclose()
    for p in table.procs.values():
        if p.task is not None:
            p.task.cancel()
