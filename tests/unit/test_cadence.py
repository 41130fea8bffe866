"""Snapshot cadence (services/nodeagent/ops/cadence.py) with a fake manager: which snapshots it asks for, what it
skips as unchanged, its phases, its budget (libs/podbay/budget.py) and its yielding to API work."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from podbay.budget import Budget
from podbay.telemetry import CADENCE_SKIPPED
from podbay_nodeagent.ops import apiwork, cadence


def test_due() -> None:
    assert cadence.due(100.0, None, 60)
    assert not cadence.due(100.0, 50.0, 60)
    assert cadence.due(110.0, 50.0, 60)
    assert not cadence.due(110.0, 50.0, 60, changed=False)
    assert not cadence.due(1e9, None, 0)  # interval 0 turns the cadence off


class FakeSnapshots:
    """Per sandbox: changed since its last snapshot (``dirty``; a new one is), per kind; records what is taken."""

    def __init__(self, work_s: float = 0.0) -> None:
        self.dirty: dict[tuple[str, str], bool] = {}
        self.taken: list[tuple[str, str]] = []
        self.work_s = work_s

    async def unchanged(self, sid: str, kind: str) -> bool:
        return not self.dirty.get((sid, kind), True)

    async def take_scheduled(self, sid: str, kind: str) -> None:
        if self.work_s:
            time.sleep(self.work_s)  # blocking on purpose: work that costs its wall time
        self.taken.append((sid, kind))
        self.dirty[(sid, "disk")] = False
        if kind == "full":
            self.dirty[(sid, "full")] = False

    def change(self, sid: str) -> None:
        self.dirty[(sid, "disk")] = self.dirty[(sid, "full")] = True


def _manager(snaps: FakeSnapshots, ids: list[str], *, disk_s: float = 0.05, full_s: float = 0.0,
             budget: float = 0.0) -> SimpleNamespace:
    vms = {sid: SimpleNamespace(stopping=False, channel=object()) for sid in ids}
    return SimpleNamespace(settings=SimpleNamespace(snapshot_full_interval_s=full_s, snapshot_disk_interval_s=disk_s,
                                                    cadence_cpu_budget=budget),
                           vms=vms, snapshots=snaps)


async def _run(manager: SimpleNamespace, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(cadence.cadence_loop(manager, stop))  # type: ignore[arg-type]
    await asyncio.sleep(seconds)
    stop.set()
    await task


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cadence, "TICK_S", 0.01)


async def test_disk_snapshots_only_when_the_disk_changed() -> None:
    snaps = FakeSnapshots()
    manager = _manager(snaps, ["sbx_1"])
    stop = asyncio.Event()
    task = asyncio.create_task(cadence.cadence_loop(manager, stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.3)
    first = len(snaps.taken)
    skipped = CADENCE_SKIPPED.labels("disk")._value.get()  # noqa: SLF001
    await asyncio.sleep(0.3)  # the disk did not change: no more snapshots
    assert first == 1 and len(snaps.taken) == 1
    assert CADENCE_SKIPPED.labels("disk")._value.get() > skipped  # noqa: SLF001 - counted as skipped
    snaps.change("sbx_1")
    await asyncio.sleep(0.3)
    stop.set()
    await task
    assert [k for _, k in snaps.taken] == ["disk", "disk"]


async def test_a_sandbox_unchanged_since_its_start_takes_no_first_snapshot() -> None:
    snaps = FakeSnapshots()
    snaps.dirty[("sbx_1", "disk")] = snaps.dirty[("sbx_1", "full")] = False  # equal to its template's files
    await _run(_manager(snaps, ["sbx_1"], disk_s=0.03, full_s=0.1), 0.5)
    assert snaps.taken == []


async def test_full_snapshots_skip_idle_guests_and_follow_change() -> None:
    snaps = FakeSnapshots()
    manager = _manager(snaps, ["sbx_1"], disk_s=0, full_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(cadence.cadence_loop(manager, stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.35)
    assert snaps.taken == [("sbx_1", "full")]  # the first; then neither disk nor RAM changed
    skipped = CADENCE_SKIPPED.labels("full")._value.get()  # noqa: SLF001
    await asyncio.sleep(0.3)
    assert snaps.taken == [("sbx_1", "full")]
    assert CADENCE_SKIPPED.labels("full")._value.get() > skipped  # noqa: SLF001
    snaps.dirty[("sbx_1", "full")] = True  # the guest's memory changed
    await asyncio.sleep(0.3)
    stop.set()
    await task
    assert snaps.taken == [("sbx_1", "full"), ("sbx_1", "full")]


def test_phases_spread_sandboxes_over_the_interval() -> None:
    ids = [f"sbx_{i:04d}" for i in range(150)]
    phases = [cadence.phase(s, 60.0) for s in ids]
    assert all(0 <= p < 60 for p in phases)
    per_second = [sum(1 for p in phases if int(p) == s) for s in range(60)]
    assert max(per_second) <= 10  # not 150 in one second
    assert cadence.phase("sbx_0001", 60.0) == cadence.phase("sbx_0001", 60.0)  # fixed per sandbox


def test_budget_paces_work_to_its_share() -> None:
    now = [100.0]
    b = Budget(0.1, clock=lambda: now[0])
    assert b.wait_s() == 0
    b.charge(0.5)  # half a second of work at 10%: 4.5 s without work
    assert b.wait_s() == pytest.approx(4.5)
    now[0] += 2
    assert b.wait_s() == pytest.approx(2.5)
    b.charge(0.5)  # charged while still waiting: the debt adds up
    assert b.wait_s() == pytest.approx(7.0)
    free = Budget(0.0, clock=lambda: now[0])
    free.charge(10)
    assert free.wait_s() == 0  # 0: unpaced


async def test_budget_holds_the_cadence_back() -> None:
    ids = [f"sbx_{i}" for i in range(20)]
    unpaced, paced = FakeSnapshots(work_s=0.01), FakeSnapshots(work_s=0.01)
    await _run(_manager(unpaced, ids, disk_s=0.01, budget=0.0), 0.6)
    await _run(_manager(paced, ids, disk_s=0.01, budget=0.2), 0.6)  # 10% for the node agent's half
    # 20 first snapshots of 10 ms each need 2 s at 10% of a core; unpaced they all happen at once.
    assert len(unpaced.taken) == 20
    assert 1 <= len(paced.taken) <= 8


async def test_budget_turn_waits_for_api_work_but_not_forever() -> None:
    stop = asyncio.Event()
    busy = [True]
    b = Budget(0.0)
    t = time.monotonic()
    task = asyncio.create_task(b.turn(stop, lambda: busy[0], max_defer_s=5.0))
    await asyncio.sleep(0.5)
    assert not task.done()  # API work waiting: the cadence waits
    busy[0] = False
    assert await task and time.monotonic() - t < 2
    assert await b.turn(stop, lambda: True, max_defer_s=0.4)  # never starved: at most max_defer_s late


async def test_the_cadence_yields_to_api_calls_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cadence, "MAX_DEFER_S", 60.0)
    snaps = FakeSnapshots()
    monkeypatch.setitem(apiwork._started, -1, time.monotonic())  # noqa: SLF001 - an exec call in flight
    assert apiwork.busy()
    manager = _manager(snaps, ["sbx_1"], disk_s=0.02)
    stop = asyncio.Event()
    task = asyncio.create_task(cadence.cadence_loop(manager, stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.4)
    assert snaps.taken == []  # held back while the call runs
    apiwork._started.pop(-1)  # noqa: SLF001 - the call finished
    await asyncio.sleep(0.5)
    stop.set()
    await task
    assert snaps.taken == [("sbx_1", "disk")]
    assert not apiwork.busy(time.monotonic() + apiwork.BUSY_WINDOW_S + 1)


async def test_api_work_notes_sandbox_calls_while_they_run() -> None:
    seen: list[bool] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        seen.append(apiwork.busy())

    mw = apiwork.ApiWork(app)  # type: ignore[arg-type]
    await mw({"type": "http", "path": "/internal/v1/sandboxes/sbx_1/exec"}, None, None)  # type: ignore[arg-type]
    await mw({"type": "http", "path": "/healthz"}, None, None)  # type: ignore[arg-type]
    assert seen == [True, False] and not apiwork.busy()
