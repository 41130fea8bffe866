"""Snapshot cadence (docs/DESIGN.md §5): disk snapshots often, full snapshots less often, per sandbox.

Every ``TICK_S`` the node looks at its running sandboxes: a disk snapshot is due when
``snapshot_disk_interval_s`` has passed since the last one *and* the disk changed since (the mtime of
its ``disk.img``, which QEMU's writes move); a full snapshot is due every ``snapshot_full_interval_s``.
Paused sandboxes are skipped (nothing changes while paused). At most one cadence snapshot runs at a time
per node, so the cadence never competes with API calls for both cores. Interval 0 turns a kind off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sandboxes import SandboxManager

__all__ = ["cadence_loop", "due"]

log = logging.getLogger("podbay.nodeagent.cadence")

TICK_S = 5.0


def due(now: float, last: float | None, interval_s: float, *, changed: bool = True) -> bool:
    """Whether a snapshot is due: cadence on, ``interval_s`` passed since ``last`` (or since the sandbox
    was first seen), and, for disk snapshots, the disk changed."""
    if interval_s <= 0 or not changed:
        return False
    return last is None or now - last >= interval_s


async def cadence_loop(manager: SandboxManager, stop: asyncio.Event) -> None:
    """Run until ``stop``; errors are logged and the loop goes on."""
    s = manager.settings
    last_disk: dict[str, float] = {}
    last_full: dict[str, float] = {}
    disk_mtime: dict[str, int] = {}
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=TICK_S)
            return
        except TimeoutError:
            pass
        now = time.monotonic()
        for sid, vm in list(manager.vms.items()):
            if vm.stopping or vm.channel is None:
                continue
            # A sandbox seen for the first time starts its clocks now rather than snapshotting at once.
            last_disk.setdefault(sid, now)
            last_full.setdefault(sid, now)
            try:
                mtime = vm.handle.process.paths.disk.stat().st_mtime_ns
            except OSError:
                continue
            try:
                if due(now, last_full[sid], s.snapshot_full_interval_s):
                    err = await manager.snapshots.take_scheduled(sid, "full")
                    last_full[sid] = last_disk[sid] = time.monotonic()
                    disk_mtime[sid] = mtime
                    if err:
                        log.info("scheduled full snapshot of %s skipped: %s", sid, err)
                elif due(now, last_disk[sid], s.snapshot_disk_interval_s, changed=disk_mtime.get(sid) != mtime):
                    err = await manager.snapshots.take_scheduled(sid, "disk")
                    last_disk[sid] = time.monotonic()
                    disk_mtime[sid] = mtime
                    if err:
                        log.info("scheduled disk snapshot of %s skipped: %s", sid, err)
            except Exception:
                log.exception("scheduled snapshot of %s failed", sid)
        for gone in set(last_disk) - set(manager.vms):
            last_disk.pop(gone, None)
            last_full.pop(gone, None)
            disk_mtime.pop(gone, None)
