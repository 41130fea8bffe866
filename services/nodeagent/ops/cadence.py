"""Snapshot cadence (docs/DESIGN.md §5): disk snapshots often, full snapshots less often, per sandbox, and only
of what changed.

Every ``TICK_S`` the node looks at its running sandboxes. A disk snapshot is due ``snapshot_disk_interval_s``
after the last one, a full snapshot every ``snapshot_full_interval_s``; each sandbox's clocks start at a
phase of their own (``phase``: a hash of its id), so 150 sandboxes seen in the same second are not all due in
the same second. A due snapshot is taken only if its files changed since the last snapshot
(``SnapshotOps.unchanged``: the extent maps of ``disk.img``, and for a full one ``ram``, equal those of the reflinks in
the last snapshot of that kind, :mod:`podbay.extents`); else it is skipped (``podbay_cadence_skipped_total``) and its
clock starts again. Interval 0 turns a kind off.

Budget (:mod:`podbay.budget`): the work runs one item at a time under half of ``cadence_cpu_budget`` (a share
of one core; the snapshotter's promotions get the other half): after work of ``w`` seconds (wall time: CPU
and IO alike) the next item waits ``w / share - w``, so the cadence's duty cycle stays within it. While API
work is waiting on the node's data plane (:mod:`.apiwork`: exec and file calls started in the last
``apiwork.BUSY_WINDOW_S``) the next item waits, up to ``MAX_DEFER_S``, so a user's command never queues
behind a snapshot (a disk snapshot freezes the guest's filesystem for its reflink).
``podbay_cadence_lag_seconds`` is the worst lateness of a due item; under a steady load of changes larger
than the budget it grows, and the lag says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import TYPE_CHECKING

from podbay.budget import Budget
from podbay.service import wait_stop
from podbay.telemetry import CADENCE_LAG_SECONDS, CADENCE_SKIPPED, CADENCE_WORK_SECONDS

from . import apiwork

if TYPE_CHECKING:
    from .sandboxes import SandboxManager

__all__ = ["cadence_loop", "due", "phase"]

log = logging.getLogger("podbay.nodeagent.cadence")

TICK_S = 5.0
MAX_DEFER_S = 30.0  # API back-off: at most this long per item, so a busy node still snapshots within its interval


def due(now: float, last: float | None, interval_s: float, *, changed: bool = True) -> bool:
    """Whether a snapshot is due: cadence on, ``interval_s`` passed since ``last`` (or since the sandbox
    was first seen), and, for disk snapshots, the disk changed."""
    if interval_s <= 0 or not changed:
        return False
    return last is None or now - last >= interval_s


def phase(sandbox_id: str, interval_s: float) -> float:
    """A sandbox's fixed offset in ``[0, interval_s)`` seconds (CRC-32 of its id), spreading first snapshots."""
    return (zlib.crc32(sandbox_id.encode()) / 2**32) * max(0.0, interval_s)


async def cadence_loop(manager: SandboxManager, stop: asyncio.Event) -> None:
    """Run until ``stop``; errors are logged and the loop goes on."""
    s = manager.settings
    budget = Budget(s.cadence_cpu_budget / 2)  # the other half: the snapshotter's promotions
    last_disk: dict[str, float] = {}
    last_full: dict[str, float] = {}
    while not stop.is_set():
        if await wait_stop(stop, TICK_S):
            return
        now = time.monotonic()
        todo: list[tuple[float, str, str]] = []  # (due since, sandbox, kind)
        for sid, vm in list(manager.vms.items()):
            if vm.stopping or vm.channel is None:
                continue
            # A sandbox seen for the first time starts its clocks at its phase: its first check comes
            # within one interval, not at once and not at the same moment as everyone else's.
            last_disk.setdefault(sid, now - phase(sid, s.snapshot_disk_interval_s))
            last_full.setdefault(sid, now - phase(sid, s.snapshot_full_interval_s))
            if due(now, last_full[sid], s.snapshot_full_interval_s):
                todo.append((last_full[sid] + s.snapshot_full_interval_s, sid, "full"))
            elif due(now, last_disk[sid], s.snapshot_disk_interval_s):
                todo.append((last_disk[sid] + s.snapshot_disk_interval_s, sid, "disk"))
        todo.sort()
        CADENCE_LAG_SECONDS.set(max((now - d for d, _, _ in todo), default=0.0))
        for due_at, sid, kind in todo:
            if not await budget.turn(stop, apiwork.busy, MAX_DEFER_S):
                return
            cur = manager.vms.get(sid)  # it may have stopped while the cadence waited its turn
            if cur is None or cur.stopping or cur.channel is None:
                continue
            CADENCE_LAG_SECONDS.set(max(0.0, time.monotonic() - due_at))
            try:
                await _one(manager, budget, sid, kind, last_disk, last_full)
            except Exception:
                log.exception("scheduled snapshot of %s failed", sid)
        CADENCE_LAG_SECONDS.set(0.0)
        for gone in set(last_disk) - set(manager.vms):
            last_disk.pop(gone, None)
            last_full.pop(gone, None)


async def _one(manager: SandboxManager, budget: Budget, sid: str, kind: str, last_disk: dict[str, float],
               last_full: dict[str, float]) -> None:
    """Check, and take if changed, one due snapshot; both charged to ``budget``."""
    t = time.perf_counter()
    unchanged = await manager.snapshots.unchanged(sid, kind)
    took = time.perf_counter() - t
    CADENCE_WORK_SECONDS.labels("check").inc(took)
    budget.charge(took)
    if unchanged:
        CADENCE_SKIPPED.labels(kind).inc()
        last_disk[sid] = time.monotonic()
        if kind == "full":
            last_full[sid] = last_disk[sid]
        return
    t = time.perf_counter()
    err = await manager.snapshots.take_scheduled(sid, kind)
    took = time.perf_counter() - t
    CADENCE_WORK_SECONDS.labels(f"snapshot_{kind}").inc(took)
    budget.charge(took)
    last_disk[sid] = time.monotonic()
    if kind == "full":
        last_full[sid] = last_disk[sid]
    if err:
        log.info("scheduled %s snapshot of %s skipped: %s", kind, sid, err)
