"""Lease and idle policy (docs/DESIGN.md §5): a sandbox whose lease ran out is paused (or deleted), but only
when its guest is idle — never a silent kill, and never while it works. The same loop releases the RAM
of sandboxes paused for longer than ``paused_release_s`` (``SandboxManager.hibernate``).

Every ``TICK_S`` the node samples the CPU time of each of its QEMU processes (``/proc/<pid>/stat``
utime + stime): that is the guest's own activity, running processes included. A running sandbox past
``lease_expires_at`` that used more than ``idle_cpu_percent`` of a core over the last window is busy, so
its lease is renewed; otherwise its ``lease_action`` applies: ``pause`` (event ``paused`` with reason
``lease expired``) or ``delete``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from podbay.lifecycle import renew_lease

if TYPE_CHECKING:
    from .sandboxes import SandboxManager

__all__ = ["lease_loop", "cpu_ticks", "cpu_percent"]

log = logging.getLogger("podbay.nodeagent.lease")

TICK_S = 2.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks, or None when it is gone (proc(5): fields 14 and 15)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def cpu_percent(prev: tuple[float, int], now: tuple[float, int]) -> float:
    """Percent of one core used between two (monotonic seconds, ticks) samples."""
    dt = now[0] - prev[0]
    if dt <= 0:
        return 0.0
    return 100.0 * (now[1] - prev[1]) / _CLK_TCK / dt


async def lease_loop(manager: SandboxManager, stop: asyncio.Event) -> None:
    """Apply lease expiry until ``stop``; errors are logged and the loop goes on."""
    samples: dict[str, tuple[float, int]] = {}
    usage: dict[str, float] = {}
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=TICK_S)
            return
        except TimeoutError:
            pass
        for sid, vm in list(manager.vms.items()):
            ticks = cpu_ticks(vm.handle.pid)
            if ticks is None:
                continue
            sample = (time.monotonic(), ticks)
            if sid in samples:
                usage[sid] = cpu_percent(samples[sid], sample)
            samples[sid] = sample
        for gone in set(samples) - set(manager.vms):
            samples.pop(gone, None)
            usage.pop(gone, None)
        release_s = manager.settings.paused_release_s
        if release_s > 0:
            now = time.monotonic()
            for sid, vm in list(manager.vms.items()):
                if vm.paused_at is not None and not vm.stopping and now - vm.paused_at >= release_s:
                    try:
                        await manager.hibernate(sid)
                    except Exception:
                        log.exception("releasing the RAM of paused sandbox %s failed", sid)
        try:
            rows = await manager.pool.fetch(
                "SELECT id, lease_action FROM sandboxes WHERE node_id=$1 AND state='running'"
                " AND lease_expires_at < now()", manager.node_id)
        except Exception as exc:
            log.warning("lease check failed: %s", exc)
            continue
        for r in rows:
            sid = r["id"]
            if sid not in usage:
                continue  # no full window measured yet
            if usage[sid] > manager.settings.idle_cpu_percent:
                await renew_lease(manager.pool, sid)
                log.info("lease of %s ran out but the guest is busy (%.1f%% CPU): renewed", sid, usage[sid])
                continue
            log.info("lease of %s ran out and the guest is idle (%.1f%% CPU): %s", sid, usage[sid], r["lease_action"])
            try:
                await manager.lease_expired(sid, r["lease_action"])
            except Exception:
                log.exception("lease action on %s failed", sid)
