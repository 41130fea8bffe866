"""The fleet simulation at a small size (issue 42; the 1,000-node run is tests/bench/fleet.py): the real api,
scheduler and warmpool processes against 10 simulated node agents (podbay.devstack.simnode) on the session's
NATS and PostgreSQL, a few hundred creates through the public API. Correctness only, no timing: every create
answers 201 with a running sandbox, placed exactly once (one generation, one start), on a node of the fleet
that was live, and no sandbox ran on two nodes."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import httpx
import pytest

from podbay import db
from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.devstack.simnode import SimFleet, start_control_plane
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.devstack.servers import S3Endpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODES = 10
CREATES = 200


async def test_a_simulated_fleet_places_every_create_once_on_a_live_node(
        nats_url: str, pg_dsn: str, s3: S3Endpoint) -> None:
    tag = os.urandom(3).hex()
    tpl = f"fleet-{tag}"
    root = Path(tempfile.mkdtemp(prefix="podbay-fleet-test-"))
    stack = Stack(data_dir=root / "stack", log_dir=root / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), durable=False,
                  external=External(nats_url=nats_url, pg_dsn=pg_dsn, s3_url=s3.url, s3_access_key=s3.access_key,
                                    s3_secret_key=s3.secret_key),
                  base_env={**os.environ, "PODBAY_S3_BUCKET": s3.bucket, "PODBAY_LOG_LEVEL": "WARNING"},
                  s3_bucket=s3.bucket)
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=10)
    bus = await connect_bus(nats_url, name=f"fleet-{tag}", heartbeat_ttl_s=10)
    fleet = SimFleet(pool, bus, [f"fs-{tag}-{i}" for i in range(NODES)], templates={tpl: "d"},
                     consumer_prefix=f"simfleet-{tag}")
    try:
        await db.migrate(pool)
        await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)", tpl)
        await fleet.start()
        stack.start_servers()
        await asyncio.to_thread(start_control_plane, stack)
        key = await asyncio.to_thread(stack.create_api_key, f"fleet-{tag}", "test")
        gate = asyncio.Semaphore(30)
        async with httpx.AsyncClient(base_url=stack.api_url, headers={"Authorization": f"Bearer {key}"},
                                     timeout=60) as client:
            async def one() -> httpx.Response:
                async with gate:
                    return await client.post("/v1/sandboxes", json={"template": tpl})

            answers = await asyncio.gather(*(one() for _ in range(CREATES)))
        assert Counter(r.status_code for r in answers) == {201: CREATES}, answers[0].text
        ids = [r.json()["id"] for r in answers]
        assert len(set(ids)) == CREATES
        rows = {r["id"]: r for r in await pool.fetch(
            "SELECT s.id, s.state, s.node_id, s.generation, o.state AS op FROM sandboxes s"
            " JOIN operations o ON o.sandbox_id = s.id AND o.kind = 'create' WHERE s.id = ANY($1::text[])", ids)}
        assert len(rows) == CREATES
        for sid in ids:
            row = rows[sid]
            # Placed once: generation 1 (one PLACE), started once, by the node the row names, one of the fleet's.
            assert (row["state"], row["generation"], row["op"]) == ("running", 1, "succeeded"), dict(row)
            assert row["node_id"] in fleet.nodes
            assert fleet.started[sid] == [(row["node_id"], 1)]
            assert sid in fleet.nodes[row["node_id"]].running
            assert sum(sid in n.running for n in fleet.nodes.values()) == 1
        # Spread over the fleet (K random candidates per placement): more than one node took sandboxes.
        assert len({rows[s]["node_id"] for s in ids}) > 1
        assert fleet.refused == 0
    finally:
        await fleet.stop()
        stack.stop(grace_s=5.0)
        kill_strays(root / "stack")
        await bus.close()
        await pool.close()
        shutil.rmtree(root, ignore_errors=True)
