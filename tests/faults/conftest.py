"""The fault tests' fleet (issue 42): one per module, started by :func:`fleet` (see faultload.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from faultload import NODES, TEMPLATE, Fleet

from podbay import db
from podbay.bus import Bus, connect_bus
from podbay.config import Settings
from podbay.devstack.servers import S3Endpoint
from podbay.devstack.simnode import SimFleet, start_control_plane
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays


@pytest.fixture(scope="module")
async def fleet(s3: S3Endpoint, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """Start the fault fleet (about 20 s on a loaded 2-core host) and stop all of it after the module. A
    module's ``FLEET_ENV`` (a dict, optional) adds settings of its own to the services' environment."""
    root = Path(tempfile.mkdtemp(prefix="podbay-faults-"))
    tag = os.urandom(3).hex()
    stack = Stack(data_dir=root / "stack", log_dir=root / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), durable=False, nats_servers=3,
                  replicas={"api": 2, "scheduler": 2, "warmpool": 2},
                  external=External(s3_url=s3.url, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key),
                  base_env={**os.environ, "PODBAY_S3_BUCKET": s3.bucket, "PODBAY_LOG_LEVEL": "INFO",
                            **getattr(request.module, "FLEET_ENV", {})},
                  s3_bucket=s3.bucket)
    pool: asyncpg.Pool | None = None
    bus: Bus | None = None
    sim: SimFleet | None = None
    try:
        await asyncio.to_thread(stack.start_servers)
        pool = await db.connect_pool(stack.pg_dsn, min_size=1, max_size=10)
        await db.migrate(pool)
        await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)",
                           TEMPLATE)
        # The simulated nodes reach the cluster through all three servers, as an agent configured with the
        # cluster's URL list does.
        bus = await connect_bus(stack.nats_url, name=f"faults-{tag}", heartbeat_ttl_s=10, replicas=0)
        sim = SimFleet(pool, bus, [f"fn-{tag}-{i}" for i in range(NODES)], templates={TEMPLATE: "d"},
                       consumer_prefix=f"faults-{tag}")
        await sim.start()
        await asyncio.to_thread(start_control_plane, stack)
        key = await asyncio.to_thread(stack.create_api_key, f"faults-{tag}", "test")
        yield Fleet(stack, sim, pool, bus, key, stack.tenant_id)
    finally:
        if sim is not None:
            await sim.stop()
        if bus is not None:
            await bus.close()
        if pool is not None:
            await pool.close()
        await asyncio.to_thread(stack.stop, 5.0)
        kill_strays(root / "stack")
        shutil.rmtree(root, ignore_errors=True)
