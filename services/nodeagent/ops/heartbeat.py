"""Node registration and heartbeats (docs/DESIGN.md §4: node heartbeats in a JetStream KV bucket with a TTL).

On start the node upserts its ``nodes`` row; every ``node_heartbeat_s`` it puts a ``NodeHeartbeat`` under
its id in ``podbay_nodes``. The bucket's TTL drops the key of a node that stops, so the scheduler only sees
live nodes. The heartbeat carries the nominal load (guest RAM and vCPUs of its VMs) and, once measured, the
node's measured memory (``memory_*`` fields, from services/nodeagent/ops/memory.py), by which placement admits.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any
from datetime import UTC, datetime

import asyncpg

from podbay.bus import Bus
from podbay.config import Settings
from podbay.contracts.messages import NodeHeartbeat
from podbay.contracts.states import NodeState
from podbay.pressure import cpu_pressure, cpu_saturated
from podbay.telemetry import CPU_PRESSURE, NODE_CAPACITY, NODE_HEARTBEATS, NODE_SANDBOXES, NODE_USED

__all__ = ["node_capacity", "register_node", "heartbeat_loop"]

log = logging.getLogger("podbay.nodeagent.heartbeat")


def node_capacity(settings: Settings) -> tuple[int, int]:
    """(memory MiB, vCPUs) offered to sandboxes: the settings, or 80% of host RAM and 128 vCPUs per core (an
    idle guest uses about 0.5% of a core, so vCPUs are not what fills a node of idle sandboxes)."""
    mem = settings.node_memory_mib
    if mem <= 0:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        mem = int(total * 0.8) >> 20
    cpus = settings.node_vcpus if settings.node_vcpus > 0 else 128 * (os.cpu_count() or 1)
    return mem, cpus


async def register_node(pool: asyncpg.Pool, settings: Settings, dataplane_url: str, accel: str) -> None:
    """Upsert this node's row (capacity, data-plane URL, accelerator). A new node is ``ready``; a known one
    keeps its state: ``draining``/``drained`` stay until an operator changes them, and ``lost`` until the agent
    has reconciled and stopped its stale VMs (``fence.rejoin``)."""
    mem, cpus = node_capacity(settings)
    await pool.execute(
        "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state, started_at, seen_at)"
        " VALUES ($1,$2,$3,$4,$5,$6,now(),now()) ON CONFLICT (id) DO UPDATE SET dataplane_url=$2,"
        " memory_mib=$3, vcpus=$4, accel=$5, started_at=now(), seen_at=now()",
        settings.node_id, dataplane_url, mem, cpus, accel, NodeState.READY)


async def heartbeat_loop(bus: Bus, settings: Settings, dataplane_url: str, accel: str,
                         load: Callable[[], tuple[int, int, int, list[str]]], stop: asyncio.Event,
                         memory: Callable[[], dict[str, Any]] | None = None) -> None:
    """Put a heartbeat now and every ``node_heartbeat_s`` until ``stop``; ``load()`` gives
    (memory used MiB, vCPUs used, sandboxes, template names), ``memory()`` the measured ``memory_*`` fields of
    ``NodeHeartbeat`` (empty before the first measurement)."""
    kv = await bus.nodes_kv()
    mem, cpus = node_capacity(settings)
    NODE_CAPACITY.labels("memory_mib").set(mem)
    NODE_CAPACITY.labels("vcpus").set(cpus)
    while not stop.is_set():
        used_mem, used_cpu, count, templates = load()
        NODE_USED.labels("memory_mib").set(used_mem)
        NODE_USED.labels("vcpus").set(used_cpu)
        NODE_SANDBOXES.set(count)
        pressure = cpu_pressure()
        if pressure is not None:
            CPU_PRESSURE.set(pressure[0])
        hb = NodeHeartbeat(node_id=settings.node_id, dataplane_url=dataplane_url, memory_mib=mem,
                           memory_used_mib=used_mem, vcpus=cpus, vcpus_used=used_cpu, sandboxes=count,
                           templates=templates, accel=accel, at=datetime.now(UTC),
                           cpu_pressure=None if pressure is None else pressure[0],
                           cpu_saturated=cpu_saturated(pressure, settings.node_cpu_pressure_max),
                           **(memory() if memory is not None else {}))
        try:
            await kv.put(settings.node_id, hb.model_dump_json().encode())
            NODE_HEARTBEATS.labels("ok").inc()
        except Exception as exc:
            NODE_HEARTBEATS.labels("failed").inc()
            log.warning("heartbeat failed: %s", exc)
        try:
            await asyncio.wait_for(stop.wait(), timeout=settings.node_heartbeat_s)
        except TimeoutError:
            pass
    try:
        await kv.delete(settings.node_id)  # leave promptly rather than waiting for the TTL
    except Exception:
        pass
