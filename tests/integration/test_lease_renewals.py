"""Lease renewals earned by data-plane calls are batched (podbay.renewals) against real PostgreSQL: N execs of
a running sandbox write no sandbox row until the flush, which renews the lease in one write; a lease that
ends soon is renewed at once by the call itself; a sandbox paused before the flush keeps its lease (the flush
renews running sandboxes only); the flush loop writes what it holds when it stops. Writes are counted by a
row trigger on ``sandboxes`` limited to this test's tenant."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime

import asyncpg
import httpx
import pytest

from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.outbox import Relay
from podbay.renewals import SYNC_MARGIN_S, LeaseRenewals
from podbay_api import nodes_client
from podbay_api.core.auth import Principal
from podbay_api.core.context import ApiContext
from podbay.contracts.states import SandboxCommand

pytestmark = pytest.mark.integration

LEASE_S = 600


async def _count_writes(pool: asyncpg.Pool, tag: str, tenant: str) -> str:
    """A row trigger counting UPDATEs of ``tenant``'s sandboxes into table ``writes_<tag>``; returns its name."""
    table = f"writes_{tag}"
    await pool.execute(f"CREATE TABLE {table} (n int NOT NULL)")
    await pool.execute(
        f"CREATE FUNCTION count_{tag}() RETURNS trigger LANGUAGE plpgsql AS"
        f" $$BEGIN INSERT INTO {table} VALUES (1); RETURN NEW; END$$")
    await pool.execute(f"CREATE TRIGGER trg_{tag} AFTER UPDATE ON sandboxes FOR EACH ROW"
                       f" WHEN (NEW.tenant_id = '{tenant}') EXECUTE FUNCTION count_{tag}()")
    return table


async def _drop(pool: asyncpg.Pool, tag: str) -> None:
    await pool.execute(f"DROP TRIGGER IF EXISTS trg_{tag} ON sandboxes")
    await pool.execute(f"DROP FUNCTION IF EXISTS count_{tag}()")
    await pool.execute(f"DROP TABLE IF EXISTS writes_{tag}")


async def _lease(pool: asyncpg.Pool, sid: str) -> datetime:
    value: datetime = await pool.fetchval("SELECT lease_expires_at FROM sandboxes WHERE id=$1", sid)
    return value


async def test_execs_renew_the_lease_in_one_batched_write(pool: asyncpg.Pool, nats_url: str) -> None:
    tag = os.urandom(3).hex()
    tenant, node = f"t-{tag}", f"rn-{tag}"
    sids = [f"sbx_{tag}_{i}" for i in range(3)]
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)", f"lr-{tag}")
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES"
                       " ($1, 'http://127.0.0.1:1', 4096, 8, 'tcg')", node)
    await pool.executemany(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, node_id, generation, lease_s, lease_expires_at) VALUES ($1, $2, $5, 'd', 'running',"
        " 'running', 256, 1, 'h', $3, 1, $4, now() + $4::int * interval '1 second' - interval '60 seconds')",
        [(sid, tenant, node, LEASE_S, f"lr-{tag}") for sid in sids])
    table = await _count_writes(pool, tag, tenant)
    bus = await connect_bus(nats_url, name=f"renewals-{tag}", heartbeat_ttl_s=10)
    try:
        renewals = LeaseRenewals(pool)
        ctx = ApiContext(settings=Settings(), pool=pool, bus=bus, relay=Relay(pool, bus),
                         nodes_http=httpx.AsyncClient(), renewals=renewals)
        who = Principal(tenant_id=tenant, key_id=f"key-{tag}")
        busy, paused, soon = sids
        before = await _lease(pool, busy)
        # 40 execs of one sandbox and one of another: the lookups write no sandbox row (their audit rows only).
        for _ in range(40):
            await nodes_client.lookup(ctx, who, busy, SandboxCommand.EXEC, "sandbox.exec", {"program": "true"})
        await nodes_client.lookup(ctx, who, paused, SandboxCommand.EXEC, "sandbox.exec", {"program": "true"})
        assert await pool.fetchval(f"SELECT count(*) FROM {table}") == 0
        assert await _lease(pool, busy) == before
        assert await pool.fetchval("SELECT count(*) FROM audit_log WHERE tenant_id=$1", tenant) == 41
        # The second one pauses (its lease action ran) before the flush: the flush must not renew it.
        await pool.execute("UPDATE sandboxes SET state='paused' WHERE id=$1", paused)
        paused_lease = await _lease(pool, paused)
        base = await pool.fetchval(f"SELECT count(*) FROM {table}")
        # One flush: one statement, one row written for the 40 execs of the running sandbox.
        assert await renewals.flush() == 2
        assert renewals.flushes == 1
        assert await pool.fetchval(f"SELECT count(*) FROM {table}") == base + 1
        renewed = await _lease(pool, busy)
        assert renewed > before
        assert await pool.fetchval("SELECT $1 >= now() + ($2::int - 1) * interval '1 second'", renewed, LEASE_S)
        assert await _lease(pool, paused) == paused_lease
        # Nothing noted since: the next flush writes nothing.
        assert await renewals.flush() == 0
        assert renewals.flushes == 1
        # A lease that ends within the margin is renewed by the call itself, at once, not noted.
        await pool.execute("UPDATE sandboxes SET lease_expires_at = now() + $2::int * interval '1 second'"
                           " WHERE id=$1", soon, int(SYNC_MARGIN_S) - 1)
        base = await pool.fetchval(f"SELECT count(*) FROM {table}")
        await nodes_client.lookup(ctx, who, soon, SandboxCommand.EXEC, "sandbox.exec", {"program": "true"})
        assert await pool.fetchval(f"SELECT count(*) FROM {table}") == base + 1
        assert await pool.fetchval("SELECT lease_expires_at >= now() + ($2::int - 1) * interval '1 second'"
                                   " FROM sandboxes WHERE id=$1", soon, LEASE_S)
        assert await renewals.flush() == 0
        # The loop's last pass, when told to stop, writes what it holds.
        await pool.execute("UPDATE sandboxes SET lease_expires_at = now() + interval '100 seconds' WHERE id=$1", busy)
        await nodes_client.lookup(ctx, who, busy, SandboxCommand.FILES)
        stop = asyncio.Event()
        stop.set()
        await renewals.run(stop)
        assert await pool.fetchval("SELECT lease_expires_at >= now() + ($2::int - 1) * interval '1 second'"
                                   " FROM sandboxes WHERE id=$1", busy, LEASE_S)
    finally:
        await bus.close()
        await _drop(pool, tag)
