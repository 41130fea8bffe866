"""The node's lease loop (services/nodeagent/ops/lease.py) against a real PostgreSQL: a lease shortened through
``podbay.lifecycle.set_lease`` (E2B's ``set_timeout``) runs out within a fraction of a second of its deadline,
woken by LISTEN/NOTIFY and the nearest-deadline sleep, not at the next periodic pass; a busy guest is still
renewed instead."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest

from podbay import lifecycle
from podbay.outbox import new_id
from podbay_nodeagent.ops import lease as lease_mod

pytestmark = pytest.mark.integration

NODE = "lease-timing-node"


@dataclass
class _Manager:
    """What the lease loop reads of a SandboxManager: its VMs (a QEMU's pid: here any process), settings,
    pool and node; ``lease_expired`` records when it was called."""

    pool: asyncpg.Pool
    node_id: str = NODE
    vms: dict[str, Any] = field(default_factory=dict)
    settings: Any = field(default_factory=lambda: SimpleNamespace(paused_release_s=0, idle_cpu_percent=10.0))
    expired: dict[str, float] = field(default_factory=dict)

    async def lease_expired(self, sandbox_id: str, action: str) -> None:
        self.expired[sandbox_id] = time.time()
        await self.pool.execute("UPDATE sandboxes SET state='deleting' WHERE id=$1", sandbox_id)

    async def hibernate(self, sandbox_id: str) -> None:
        raise AssertionError("nothing is paused here")


@pytest.fixture
def idle_pid() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> AsyncIterator[str]:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('lease-timing', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:1', 1024, 1, 'tcg', 'drained') ON CONFLICT DO NOTHING", NODE)
    yield tid
    await pool.execute("UPDATE sandboxes SET state='deleted' WHERE tenant_id=$1", tid)


async def _sandbox(pool: asyncpg.Pool, tenant: str) -> str:
    sid = new_id("sbx")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, node_id, lease_s, lease_expires_at, lease_action) VALUES ($1,$2,"
        "'lease-timing','d','running','running',1,256,1,'h',$3,600, now() + interval '600 seconds', 'delete')",
        sid, tenant, NODE)
    return sid


async def test_a_shortened_lease_runs_out_on_time(pool: asyncpg.Pool, tenant: str, idle_pid: int) -> None:
    manager = _Manager(pool)
    stop = asyncio.Event()
    loop = asyncio.create_task(lease_mod.lease_loop(manager, stop))  # type: ignore[arg-type]
    try:
        late: list[float] = []
        for _ in range(3):  # a periodic pass every TICK_S would be up to TICK_S late: three rounds tell
            sid = await _sandbox(pool, tenant)
            manager.vms[sid] = SimpleNamespace(handle=SimpleNamespace(pid=idle_pid), paused_at=None, stopping=False)
            await asyncio.sleep(lease_mod.TICK_S + 0.3)  # an idle CPU window is measured
            await lifecycle.set_lease(pool, sid, 1)  # E2B's set_timeout(1)
            deadline = (await pool.fetchval("SELECT extract(epoch FROM lease_expires_at) FROM sandboxes"
                                            " WHERE id=$1", sid))
            for _ in range(60):
                if sid in manager.expired:
                    break
                await asyncio.sleep(0.05)
            assert sid in manager.expired, "the lease never ran out"
            late.append(manager.expired[sid] - float(deadline))
            del manager.vms[sid]
        assert all(-0.01 < d < 0.5 for d in late), late
    finally:
        stop.set()
        await asyncio.wait_for(loop, 5)


async def test_a_busy_guest_is_renewed_not_expired(pool: asyncpg.Pool, tenant: str) -> None:
    busy = subprocess.Popen(["python3", "-c", "while True: pass"])
    manager = _Manager(pool)
    manager.settings.idle_cpu_percent = 0.5  # a spinning process gets more than this even on a loaded machine
    stop = asyncio.Event()
    loop = asyncio.create_task(lease_mod.lease_loop(manager, stop))  # type: ignore[arg-type]
    try:
        sid = await _sandbox(pool, tenant)
        manager.vms[sid] = SimpleNamespace(handle=SimpleNamespace(pid=busy.pid), paused_at=None, stopping=False)
        await asyncio.sleep(lease_mod.TICK_S + 0.3)
        await lifecycle.set_lease(pool, sid, 1)
        await asyncio.sleep(2.0)
        assert sid not in manager.expired  # renewed at each deadline instead
        assert await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sid) == "running"
    finally:
        busy.kill()
        busy.wait()
        stop.set()
        await asyncio.wait_for(loop, 5)
