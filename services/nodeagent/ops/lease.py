"""Lease and idle policy (docs/DESIGN.md §5): a sandbox whose lease ran out is paused (or deleted), but only
when its guest is idle — never a silent kill, and never while it works. The same loop releases the RAM
of sandboxes paused for longer than ``paused_release_s`` (``SandboxManager.hibernate``).

Every ``TICK_S`` the node samples the CPU time of each of its QEMU processes (``/proc/<pid>/stat``
utime + stime): that is the guest's own activity, running processes included. A running sandbox past
``lease_expires_at`` that used more than ``idle_cpu_percent`` of a core over the last window is busy, so
its lease is renewed; otherwise its ``lease_action`` applies: ``pause`` (event ``paused`` with reason
``lease expired``) or ``delete``.

Expiry is on time without a scan per sandbox: after each pass the loop asks PostgreSQL for the nearest future
deadline of its running sandboxes (one aggregate, with the expired rows, in one round trip) and sleeps until
then, or ``TICK_S`` at most; a lease that changes meanwhile (``podbay.lifecycle.set_lease``/``expire_lease``,
e.g. E2B's ``set_timeout``) wakes it through ``LISTEN`` on :data:`podbay.lifecycle.LEASE_CHANNEL`. So a lease
runs out within about a tenth of a second of its deadline (plus the action's own time), not up to a tick late.
The idle verdict keeps a CPU window of at least ``MIN_WINDOW_S`` (up to ``TICK_S``): a wake just after a pass
does not judge on a few milliseconds of samples.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import asyncpg

from podbay.lifecycle import LEASE_CHANNEL, renew_lease

if TYPE_CHECKING:
    from .sandboxes import SandboxManager

__all__ = ["lease_loop", "cpu_ticks", "cpu_percent"]

log = logging.getLogger("podbay.nodeagent.lease")

TICK_S = 2.0
MIN_WINDOW_S = 0.5  # the shortest CPU window a busy/idle verdict is made on
WAKE_MARGIN_S = 0.05  # woken this much after a deadline, so that PostgreSQL's now() is past it
# The expired leases of the node's running sandboxes, and (one more row, id NULL) seconds to the nearest one
# still to come (NULL when none).
_PASS_SQL = (
    "SELECT id, lease_action, NULL::float8 AS next_s FROM sandboxes WHERE node_id=$1 AND state='running'"
    " AND lease_expires_at < now()"
    " UNION ALL SELECT NULL, NULL, EXTRACT(EPOCH FROM min(lease_expires_at) - now())::float8 FROM sandboxes"
    " WHERE node_id=$1 AND state='running' AND lease_expires_at >= now()")
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


class _LeaseListener:
    """``LISTEN`` on :data:`LEASE_CHANNEL` on a connection of its own, setting ``wake`` when a lease of a
    sandbox of ``node_id`` changed. A lost connection is taken again at the next :meth:`ensure` (meanwhile the
    loop still passes every ``TICK_S``)."""

    def __init__(self, pool: asyncpg.Pool, node_id: str, wake: asyncio.Event) -> None:
        self._pool, self._node_id, self._wake = pool, node_id, wake
        self._conn: asyncpg.Connection | None = None

    def _heard(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload == self._node_id:
            self._wake.set()

    async def ensure(self) -> None:
        if self._conn is not None and not self._conn.is_closed():
            return
        await self.close()
        try:
            conn = await self._pool.acquire(timeout=5.0)  # a busy pool: listen at a later pass
        except Exception as exc:
            log.warning("lease listener: no connection: %s", exc)
            return
        try:
            await conn.add_listener(LEASE_CHANNEL, self._heard)
        except Exception as exc:
            log.warning("lease listener: LISTEN failed: %s", exc)
            await self._pool.release(conn)
            return
        self._conn = conn
        self._wake.set()  # changes before the LISTEN were not heard: look again now

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not conn.is_closed():
                await conn.remove_listener(LEASE_CHANNEL, self._heard)
        except Exception:  # noqa: BLE001 - a broken connection: the pool replaces it
            pass
        try:
            await self._pool.release(conn)
        except Exception:  # noqa: BLE001 - already terminated
            pass


async def _sleep(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` or until ``stop`` or ``wake`` is set -> whether to stop."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waits, timeout=max(seconds, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    wake.clear()
    return stop.is_set()


async def lease_loop(manager: SandboxManager, stop: asyncio.Event) -> None:
    """Apply lease expiry until ``stop``; errors are logged and the loop goes on."""
    base: dict[str, tuple[float, int]] = {}  # the start of each sandbox's current CPU window
    usage: dict[str, float] = {}
    wake = asyncio.Event()
    listener = _LeaseListener(manager.pool, manager.node_id, wake)
    next_in = TICK_S
    try:
        while True:
            await listener.ensure()
            if await _sleep(stop, wake, next_in):
                return
            next_in = await _pass(manager, base, usage)
    finally:
        await listener.close()


async def _pass(manager: SandboxManager, base: dict[str, tuple[float, int]], usage: dict[str, float]) -> float:
    """One pass: sample CPU, release the RAM of long-paused sandboxes, apply expired leases -> seconds until
    the next pass is due (``TICK_S`` at most)."""
    for sid, vm in list(manager.vms.items()):
        ticks = cpu_ticks(vm.handle.pid)
        if ticks is None:
            continue
        sample = (time.monotonic(), ticks)
        start = base.get(sid)
        if start is None:
            base[sid] = sample
            continue
        if sample[0] - start[0] >= MIN_WINDOW_S:
            usage[sid] = cpu_percent(start, sample)
        if sample[0] - start[0] >= TICK_S:
            base[sid] = sample
    for gone in set(base) - set(manager.vms):
        base.pop(gone, None)
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
        rows = await manager.pool.fetch(_PASS_SQL, manager.node_id)
    except Exception as exc:
        log.warning("lease check failed: %s", exc)
        return TICK_S
    next_in = TICK_S
    for r in rows:
        sid = r["id"]
        if sid is None:
            if r["next_s"] is not None:
                next_in = min(next_in, r["next_s"] + WAKE_MARGIN_S)
            continue
        if sid not in usage:
            next_in = min(next_in, MIN_WINDOW_S)  # no window measured yet: judge once there is one
            continue
        if usage[sid] > manager.settings.idle_cpu_percent:
            await renew_lease(manager.pool, sid)
            log.info("lease of %s ran out but the guest is busy (%.1f%% CPU): renewed", sid, usage[sid])
            continue
        log.info("lease of %s ran out and the guest is idle (%.1f%% CPU): %s", sid, usage[sid], r["lease_action"])
        try:
            await manager.lease_expired(sid, r["lease_action"])
        except Exception:
            log.exception("lease action on %s failed", sid)
    return next_in
