"""This node's memory as its sandboxes really use it, and the release of RAM when it runs short.

Every ``node_heartbeat_s`` (:class:`MemoryWatch`, a task of its own) the node measures, on a worker thread,
the host (MemAvailable less the mapped file pages, i.e. touched guest RAM) and the VMs it runs (sandboxes and
warm slots: QEMU's PSS, which holds the guest RAM pages it touched, ``podbay.vmmem``). Reading one QEMU's PSS
walks its page tables (about 3 ms of CPU here under load), so a VM is measured when it first appears and then
again every ``VM_REMEASURE_S`` once its QEMU used ``VM_REMEASURE_CPU_S`` of CPU since (else after
``VM_REMEASURE_MAX_S``: an idle guest's PSS follows what it runs), a share of them each tick; the host, which
admission follows, every tick. A paused sandbox whose RAM was released
(hibernated: its QEMU exited) has no VM, so it counts 0. The figures go into the heartbeat
(:meth:`MemoryWatch.report`), where placement admits by them (services/scheduler/placement.py), and into
``podbay_node_memory_mib``.

The node's **room** is ``min(available - MEMORY_HEADROOM_MIB, NODE_MEMORY_MIB - sandboxes)`` (the second term
only when NODE_MEMORY_MIB is set). When the room falls below two sandboxes' expected cost (the low-water
mark: a create or two may be on their way, admitted by the scheduler because this node said it can free
memory), the node releases RAM until the room is back above it, in this order:

0. warm slots: nobody uses them, and the pool prepares them again only once the room allows
   (``WarmPool.has_room`` asks :meth:`MemoryWatch.fits`, the same rule, so a refill never undoes a release);
1. paused sandboxes, longest paused first: their RAM is written to their files and QEMU exits
   (``SandboxManager.hibernate``, what PAUSED_RELEASE_S does on a timer);
2. then running sandboxes whose lease action is ``pause`` and whose guest has been idle (below
   IDLE_CPU_PERCENT of a core) for MEMORY_PRESSURE_IDLE_S, longest idle first: paused like an expired lease
   (event ``paused``, reason ``memory pressure``; their processes carry on at resume), then released.

What these could free is the heartbeat's ``memory_reclaimable_mib``, which the scheduler counts as room, so a
create is refused only when releasing everything releasable would not make room for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from prometheus_client import Counter, Gauge

from podbay.service import run_every
from podbay.vmmem import HostMemory, VmMemory, available_for_vms, host_memory, vm_memory

from .lease import cpu_percent, cpu_ticks

if TYPE_CHECKING:
    from .sandboxes import SandboxManager
    from .warm import WarmPool

__all__ = ["MemoryWatch", "NodeMemory", "Candidate", "release_order", "to_release", "FALLBACK_OVERHEAD_MIB"]

log = logging.getLogger("podbay.nodeagent.memory")

_CLK_TCK = os.sysconf("SC_CLK_TCK")

#: Before any sandbox runs here, a fresh one is expected to cost its RAM plus this (QEMU itself), MiB.
FALLBACK_OVERHEAD_MIB = 64
#: A VM's PSS is read again after this many seconds (an idle guest's changes slowly; the host is read each tick).
VM_REMEASURE_S = 30.0
#: ... but only once its QEMU has used this much CPU (seconds) since the last read: a guest that did not run
#: touched no new page, and an idle one (~0.5% of a core) would otherwise be read every 30 s for nothing.
VM_REMEASURE_CPU_S = 1.0
#: A VM is read again after this many seconds whatever its CPU did (its PSS also moves when the QEMUs it
#: shares pages with come and go).
VM_REMEASURE_MAX_S = 300.0

MEMORY_MIB = Gauge("podbay_node_memory_mib", "This node's measured memory, MiB: host_total, host_available "
                   "(MemAvailable), available (less guest RAM in the page cache), sandboxes (what its VMs cost), "
                   "reclaimable, sandbox_cost (median of running sandboxes), room (what placement may still "
                   "use), headroom.", ["kind"])
MEMORY_VMS = Gauge("podbay_node_memory_vms", "VMs this node measured, by kind (running, paused, warm).", ["kind"])
MEMORY_RELEASES = Counter("podbay_node_memory_releases_total", "VMs whose RAM this node released under "
                          "memory pressure, by kind (warm, paused, idle_running) and outcome (ok, failed).",
                          ["kind", "outcome"])


@dataclass(frozen=True)
class Candidate:
    """A VM whose RAM could be released: ``kind`` ``warm`` (a warm slot, ``sandbox_id`` its slot id),
    ``paused`` (since ``since``, monotonic s) or ``idle`` (running, guest idle since ``since``), costing
    ``cost_mib``."""

    sandbox_id: str
    kind: Literal["warm", "paused", "idle"]
    since: float
    cost_mib: float


#: Release order of the kinds: what nobody uses, then what nobody runs, then what runs idle.
_KIND_ORDER = {"warm": 0, "paused": 1, "idle": 2}


def release_order(candidates: list[Candidate]) -> list[Candidate]:
    """Warm slots first; then paused sandboxes, longest paused first; then idle running ones, longest idle
    first."""
    return sorted(candidates, key=lambda c: (_KIND_ORDER[c.kind], c.since, c.sandbox_id))


def to_release(candidates: list[Candidate], need_mib: float) -> list[Candidate]:
    """The shortest prefix of :func:`release_order` that frees at least ``need_mib`` (all of them when they
    cannot; none when ``need_mib <= 0``)."""
    out: list[Candidate] = []
    freed = 0.0
    for c in release_order(candidates):
        if freed >= need_mib:
            break
        out.append(c)
        freed += c.cost_mib
    return out


@dataclass(frozen=True)
class NodeMemory:
    """One measurement of this node, MiB. ``available_mib``: what the host can still give VMs;
    ``sandboxes_mib``: what its VMs cost; ``reclaimable_mib``: the candidates' cost; ``cost_mib``: expected
    cost of a fresh sandbox (setting, else the running ones' median, else None); ``limit_mib``: NODE_MEMORY_MIB
    when set."""

    host: HostMemory
    available_mib: float
    sandboxes_mib: float
    reclaimable_mib: float
    cost_mib: float | None
    limit_mib: int | None
    headroom_mib: int
    candidates: list[Candidate]
    per_vm: dict[str, VmMemory] = field(repr=False)
    measured_at: datetime

    @property
    def room_mib(self) -> float:
        """What new sandboxes may still use before the headroom (or the limit) is reached; may be negative."""
        room = self.available_mib - self.headroom_mib
        if self.limit_mib is not None:
            room = min(room, self.limit_mib - self.sandboxes_mib)
        return room


class MemoryWatch:
    """Measures this node's memory every ``node_heartbeat_s`` and releases RAM under pressure (module doc)."""

    def __init__(self, manager: SandboxManager, warm: WarmPool | None = None) -> None:
        self.m = manager
        self.warm = warm
        self.latest: NodeMemory | None = None
        self._cpu: dict[str, tuple[float, int]] = {}
        self._idle_since: dict[str, float] = {}
        # key (sandbox id, or warm:<slot>) -> (pid, monotonic time measured, measurement)
        self._vm_cache: dict[str, tuple[int, float, VmMemory]] = {}
        self._vm_ticks: dict[str, int] = {}  # key -> its QEMU's CPU ticks when its PSS was read

    def report(self) -> dict[str, object]:
        """The heartbeat's ``memory_*`` fields (empty before the first measurement)."""
        m = self.latest
        if m is None:
            return {}
        return {"memory_available_mib": int(m.available_mib), "memory_sandboxes_mib": round(m.sandboxes_mib),
                "memory_reclaimable_mib": int(m.reclaimable_mib),
                "memory_sandbox_cost_mib": None if m.cost_mib is None else round(m.cost_mib),
                "memory_limit_mib": m.limit_mib, "memory_headroom_mib": m.headroom_mib,
                "memory_measured_at": m.measured_at}

    async def run(self, stop: asyncio.Event) -> None:
        """Measure, publish, and release under pressure until ``stop``; errors are logged and it goes on."""
        await run_every(stop, self.m.settings.node_heartbeat_s, self.tick, log, "memory measurement failed")

    def expected_cost_mib(self, m: NodeMemory) -> float:
        """What one more fresh sandbox (or warm slot) is expected to cost here, MiB."""
        return m.cost_mib if m.cost_mib is not None else self.m.settings.sandbox_memory_mib + FALLBACK_OVERHEAD_MIB

    def fits(self, memory_mib: int) -> bool | None:
        """Whether one more VM leaves the room at or above the low-water mark (so that pressure would not
        release it again at once), by the latest measurement; None before the first. ``memory_mib`` is the
        VM's nominal size, used only while no sandbox here has been measured."""
        m = self.latest
        if m is None:
            return None
        cost = m.cost_mib if m.cost_mib is not None else memory_mib + FALLBACK_OVERHEAD_MIB
        return m.room_mib - cost >= 2 * self.expected_cost_mib(m)

    async def tick(self) -> NodeMemory:
        """One measurement (and, under pressure, one round of releases); returns the measurement."""
        m = await self.measure()
        low_water = 2 * self.expected_cost_mib(m)
        need = low_water - m.room_mib
        if need > 0 and m.candidates:
            victims = to_release(m.candidates, need)
            log.info("memory short (room %.0f MiB, low water %.0f): releasing %d sandbox(es)", m.room_mib,
                     low_water, len(victims))
            for c in victims:
                await self._release(c)
            m = await self.measure()
        return m

    async def measure(self) -> NodeMemory:
        """Measure every VM and the host (on a worker thread), update the gauges, keep it as ``latest``."""
        s = self.m.settings
        now = time.monotonic()
        vms = {sid: (vm.handle.pid, vm.handle.process.paths.ram, vm.paused_at)
               for sid, vm in list(self.m.vms.items()) if not vm.stopping}
        slots = {f"warm:{sid}": (slot.handle.pid, slot.handle.process.paths.ram, now)
                 for sid, slot in list(self.warm.slots.items())} if self.warm is not None else {}
        # Idle for CPU: a running guest above IDLE_CPU_PERCENT of a core since the last tick is busy now.
        for sid, (pid, _, paused_at) in vms.items():
            ticks = cpu_ticks(pid)
            if ticks is None:
                continue
            sample = (now, ticks)
            prev = self._cpu.get(sid)
            self._cpu[sid] = sample
            if paused_at is not None:
                self._idle_since[sid] = now  # idleness of a running guest counts from its last resume
            elif prev is None:
                self._idle_since.setdefault(sid, now)
            elif cpu_percent(prev, sample) > s.idle_cpu_percent:
                self._idle_since[sid] = now
        for gone in set(self._cpu) - set(vms):
            self._cpu.pop(gone, None)
            self._idle_since.pop(gone, None)
        pausable: set[str] = set()
        if s.memory_pressure_idle_s > 0:
            idle = [sid for sid, (_, _, p) in vms.items()
                    if p is None and now - self._idle_since.get(sid, now) >= s.memory_pressure_idle_s]
            if idle:
                rows = await self.m.pool.fetch(
                    "SELECT id FROM sandboxes WHERE id = ANY($1::text[]) AND node_id=$2 AND state='running'"
                    " AND lease_action='pause'", idle, self.m.node_id)
                pausable = {r["id"] for r in rows}

        pids = {key: pid for key, (pid, _, _) in {**vms, **slots}.items()}
        cpu_now = {sid: self._cpu[sid][1] for sid in vms if sid in self._cpu}
        host, per = await asyncio.to_thread(self._take, pids, now, cpu_now)
        sandboxes = sum(v.cost_mib for v in per.values())
        available = available_for_vms(host)
        candidates = [Candidate(sid, "paused", paused_at, per[sid].cost_mib)
                      for sid, (_, _, paused_at) in vms.items() if paused_at is not None and sid in per]
        candidates += [Candidate(sid, "idle", self._idle_since.get(sid, now), per[sid].cost_mib)
                       for sid in pausable if sid in per]
        candidates += [Candidate(key.removeprefix("warm:"), "warm", 0.0, per[key].cost_mib)
                       for key in slots if key in per]
        running = [per[sid].cost_mib for sid, (_, _, p) in vms.items() if p is None and sid in per]
        cost = float(s.memory_sandbox_estimate_mib) if s.memory_sandbox_estimate_mib > 0 else (
            statistics.median(running) if running else None)
        m = NodeMemory(host=host, available_mib=available, sandboxes_mib=sandboxes,
                       reclaimable_mib=sum(c.cost_mib for c in candidates), cost_mib=cost,
                       limit_mib=s.node_memory_mib if s.node_memory_mib > 0 else None,
                       headroom_mib=s.memory_headroom_mib, candidates=candidates, per_vm=per,
                       measured_at=datetime.now(UTC))
        self.latest = m
        for kind, value in (("host_total", host.total_mib), ("host_available", host.available_mib),
                            ("available", available), ("sandboxes", sandboxes), ("reclaimable", m.reclaimable_mib),
                            ("sandbox_cost", cost or 0.0), ("room", m.room_mib), ("headroom", m.headroom_mib)):
            MEMORY_MIB.labels(kind).set(round(value, 1))
        MEMORY_VMS.labels("running").set(len(running))
        MEMORY_VMS.labels("paused").set(sum(1 for _, _, p in vms.values() if p is not None))
        MEMORY_VMS.labels("warm").set(len(slots))
        return m

    def _take(self, pids: dict[str, int], now: float,
              ticks: dict[str, int] | None = None) -> tuple[HostMemory, dict[str, VmMemory]]:
        """The host now, and each VM: new ones (or a new pid) measured now, the rest from the cache except the
        oldest share due again (``VM_REMEASURE_S`` spread over the ticks). ``ticks``: each VM's QEMU CPU time
        now (clock ticks; a VM without is taken as busy); one that used less than ``VM_REMEASURE_CPU_S`` since
        its last read is due only after ``VM_REMEASURE_MAX_S``. Runs on a worker thread."""
        cache, read_at = self._vm_cache, self._vm_ticks
        ticks = ticks or {}
        for gone in set(cache) - set(pids):
            cache.pop(gone, None)
        for gone in set(read_at) - set(cache):
            read_at.pop(gone, None)
        fresh = [k for k, pid in pids.items() if k not in cache or cache[k][0] != pid]

        def is_due(k: str) -> bool:
            age = now - cache[k][1]
            if age >= VM_REMEASURE_MAX_S:
                return True
            if age < VM_REMEASURE_S:
                return False
            cpu, before = ticks.get(k), read_at.get(k)
            return cpu is None or before is None or cpu - before >= VM_REMEASURE_CPU_S * _CLK_TCK

        due = sorted((k for k in pids if k not in fresh and is_due(k)), key=lambda k: cache[k][1])
        share = max(1, math.ceil(len(pids) * self.m.settings.node_heartbeat_s / VM_REMEASURE_S))
        for key in fresh + due[:share]:
            got = vm_memory(pids[key], None)  # PSS only: the RAM file's read-ahead pages are not a cost
            if got is None:
                cache.pop(key, None)
                read_at.pop(key, None)
            else:
                cache[key] = (pids[key], now, got)
                if key in ticks:
                    read_at[key] = ticks[key]
                else:
                    read_at.pop(key, None)
        return host_memory(), {k: cache[k][2] for k in pids if k in cache}

    async def _release(self, c: Candidate) -> None:
        kind = {"warm": "warm", "paused": "paused", "idle": "idle_running"}[c.kind]
        try:
            if c.kind == "warm":
                done = self.warm is not None and await self.warm.release(c.sandbox_id, "memory pressure")
            else:
                if c.kind == "idle":
                    await self.m.lease_expired(c.sandbox_id, "pause", reason="memory pressure")
                done = await self.m.hibernate(c.sandbox_id)
        except Exception:
            log.exception("releasing the RAM of %s under memory pressure failed", c.sandbox_id)
            MEMORY_RELEASES.labels(kind, "failed").inc()
            return
        if done:
            MEMORY_RELEASES.labels(kind, "ok").inc()
            log.info("memory pressure: released the RAM of %s %s %s (%.0f MiB)", c.kind,
                     "slot" if c.kind == "warm" else "sandbox", c.sandbox_id, c.cost_mib)
