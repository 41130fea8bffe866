"""The scheduler's drain against real PostgreSQL and NATS, with a stand-in source node agent that answers
``migrate_out`` commands: every sandbox is sent to a ``ready`` live node other than the one draining, the
progress and each move's downtime are recorded, the node ends ``drained``; a sandbox that cannot move is
reported, left where it is, and the drain ends ``drain_incomplete`` with the node still ``draining``."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from typing import Any

import pytest

from podbay import db
from podbay.bus import connect_bus
from podbay.contracts import subjects
from podbay.contracts.messages import DrainNodeCmd, MigrateOutCmd, NodeHeartbeat
from podbay_scheduler.drain import drain_node

pytestmark = pytest.mark.integration


async def _setup(pool: Any, kv: Any, tag: str, nodes: dict[str, str], live: set[str]) -> tuple[str, str]:
    tenant, tpl = f"t-{tag}", f"dt-{tag}"
    await db.migrate(pool)
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)", tpl)
    for node, state in nodes.items():
        await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                           " ($1, 'http://127.0.0.1:1', 4096, 8, 'tcg', $2)", node, state)
        if node in live:
            hb = NodeHeartbeat(node_id=node, dataplane_url="http://127.0.0.1:1", memory_mib=4096, memory_used_mib=0,
                               vcpus=8, vcpus_used=0, sandboxes=0, templates=[tpl], accel="tcg", at=datetime.now(UTC))
            await kv.put(node, hb.model_dump_json().encode())
    return tenant, tpl


async def _sandbox(pool: Any, sid: str, tenant: str, tpl: str, node: str, state: str) -> None:
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, node_id, generation,"
        " memory_mib, vcpus, hostname) VALUES ($1, $2, $3, 'd', $4, $4, $5, 3, 256, 1, 'h')",
        sid, tenant, tpl, state, node)


class FakeSource:
    """Answers the draining node's ``migrate_out`` commands as its node agent would (no VMs): moves the row
    to the destination at generation + 1 and records the figures, or fails the operation for ``refuse``."""

    def __init__(self, pool: Any, bus: Any, node: str, refuse: set[str]) -> None:
        self.pool, self.bus, self.node, self.refuse = pool, bus, node, refuse
        self.seen: list[MigrateOutCmd] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        sub = await self.bus.pull_subscribe(subjects.node_consumer(self.node), subjects.node_cmd_filter(self.node))
        while not self.stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=0.5)
            except Exception:
                continue
            for msg in msgs:
                assert msg.subject == subjects.node_cmd(self.node, "migrate_out")
                cmd = MigrateOutCmd.model_validate_json(msg.data)
                self.seen.append(cmd)
                if cmd.sandbox_id in self.refuse:
                    await self.pool.execute("UPDATE operations SET state='failed', error_code='migration_failed',"
                                            " error_message='guest would not move', finished_at=now() WHERE id=$1",
                                            cmd.operation_id)
                else:
                    await self.pool.execute("UPDATE sandboxes SET node_id=$2, generation=generation+1 WHERE id=$1",
                                            cmd.sandbox_id, cmd.dest_node)
                    await self.pool.execute(
                        "UPDATE operations SET state='succeeded', finished_at=now(), data=$2 WHERE id=$1",
                        cmd.operation_id, {"downtime_ms": 1.5, "total_ms": 900.0})
                await msg.ack()


async def _run_drain(pool: Any, bus: Any, src: str, refuse: set[str], tenant: str) -> tuple[Any, FakeSource, str]:
    op = f"op_{os.urandom(6).hex()}"
    await pool.execute("INSERT INTO operations (id, tenant_id, kind, state, node_id) VALUES ($1,$2,'drain','pending',$3)",
                       op, tenant, src)
    await pool.execute("UPDATE nodes SET state='draining' WHERE id=$1", src)
    fake = FakeSource(pool, bus, src, refuse)
    task = asyncio.create_task(fake.run())
    try:
        prog = await asyncio.wait_for(drain_node(pool, bus, DrainNodeCmd(operation_id=op, node_id=src),
                                                 migrate_timeout_s=30), 60)
    finally:
        fake.stop.set()
        await task
    return prog, fake, op


async def test_drain_moves_every_sandbox_to_a_ready_node_and_marks_it_drained(nats_url: str, pg_dsn: str) -> None:
    tag = os.urandom(3).hex()
    src, dst, other, lost = f"da-{tag}", f"db-{tag}", f"dc-{tag}", f"dd-{tag}"
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=4)
    bus = await connect_bus(nats_url, name="drain-test", heartbeat_ttl_s=60)
    try:
        kv = await bus.nodes_kv()
        # ``other`` is alive but draining itself, ``lost`` is ready in PostgreSQL but has no heartbeat.
        tenant, tpl = await _setup(pool, kv, tag, {src: "ready", dst: "ready", other: "draining", lost: "ready"},
                                   live={src, dst, other})
        await _sandbox(pool, f"sbx_{tag}_run", tenant, tpl, src, "running")
        await _sandbox(pool, f"sbx_{tag}_pau", tenant, tpl, src, "paused")
        await _sandbox(pool, f"sbx_{tag}_sus", tenant, tpl, src, "suspended")  # no node work needed
        prog, fake, op = await _run_drain(pool, bus, src, set(), tenant)

        assert prog.complete and (prog.total, prog.moved) == (2, 2)
        assert {c.dest_node for c in fake.seen} == {dst}
        assert {c.generation for c in fake.seen} == {3}
        row = await pool.fetchrow("SELECT state, error_code, progress FROM operations WHERE id=$1", op)
        assert row["state"] == "succeeded" and row["error_code"] is None
        assert row["progress"]["moved"] == 2 and row["progress"]["total"] == 2
        assert [m["downtime_ms"] for m in row["progress"]["moves"]] == [1.5, 1.5]
        assert await pool.fetchval("SELECT state FROM nodes WHERE id=$1", src) == "drained"
        assert await pool.fetchval("SELECT count(*) FROM sandboxes WHERE node_id=$1 AND state IN"
                                   " ('running','paused')", src) == 0
        kinds = await pool.fetch("SELECT kind, state, node_id FROM operations WHERE sandbox_id LIKE $1",
                                 f"sbx_{tag}_%")
        assert {(k["kind"], k["state"], k["node_id"]) for k in kinds} == {("migrate", "succeeded", src)}
    finally:
        await bus.close()
        await pool.close()


async def test_a_sandbox_that_cannot_move_stays_and_the_drain_is_incomplete(nats_url: str, pg_dsn: str) -> None:
    tag = os.urandom(3).hex()
    src, dst = f"da-{tag}", f"db-{tag}"
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=4)
    bus = await connect_bus(nats_url, name="drain-test", heartbeat_ttl_s=60)
    try:
        kv = await bus.nodes_kv()
        tenant, tpl = await _setup(pool, kv, tag, {src: "ready", dst: "ready"}, live={src, dst})
        stuck, moves = f"sbx_{tag}_stuck", f"sbx_{tag}_moves"
        await _sandbox(pool, stuck, tenant, tpl, src, "running")
        await _sandbox(pool, moves, tenant, tpl, src, "running")
        prog, _fake, op = await _run_drain(pool, bus, src, {stuck}, tenant)

        assert not prog.complete and prog.moved == 1
        assert prog.failed == [{"sandbox_id": stuck, "reason": "guest would not move"}]
        row = await pool.fetchrow("SELECT state, error_code, error_message FROM operations WHERE id=$1", op)
        assert (row["state"], row["error_code"]) == ("failed", "drain_incomplete")
        assert stuck in row["error_message"]
        assert await pool.fetchval("SELECT state FROM nodes WHERE id=$1", src) == "draining"
        # The one that could not move is still where it was, untouched.
        assert tuple(await pool.fetchrow("SELECT node_id, state, generation FROM sandboxes WHERE id=$1", stuck)) \
            == (src, "running", 3)
    finally:
        await bus.close()
        await pool.close()


async def test_no_other_node_means_nothing_moves(nats_url: str, pg_dsn: str) -> None:
    tag = os.urandom(3).hex()
    src = f"da-{tag}"
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=4)
    bus = await connect_bus(nats_url, name="drain-test", heartbeat_ttl_s=60)
    try:
        kv = await bus.nodes_kv()
        tenant, tpl = await _setup(pool, kv, tag, {src: "ready"}, live={src})
        sid = f"sbx_{tag}_only"
        await _sandbox(pool, sid, tenant, tpl, src, "running")
        prog, fake, op = await _run_drain(pool, bus, src, set(), tenant)
        assert fake.seen == []  # never asked to move it onto itself
        assert prog.moved == 0 and prog.failed and prog.failed[0]["sandbox_id"] == sid
        assert await pool.fetchval("SELECT error_code FROM operations WHERE id=$1", op) == "drain_incomplete"
        assert await pool.fetchval("SELECT node_id FROM sandboxes WHERE id=$1", sid) == src
    finally:
        await bus.close()
        await pool.close()
