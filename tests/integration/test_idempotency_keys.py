"""Idempotency keys of creates (services/api/services/idempotency.py, migration 0028) against a real PostgreSQL: a key
is recorded once per tenant, a retry finds it, another body is refused, an expired key is ignored, replaced
and swept; two creates with one key at once leave one record; the warm claim records the key in its one
statement and claims nothing for a key that has a row."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest

from podbay.contracts.api import SandboxCreate
from podbay.errors import IdempotencyKeyReused
from podbay.outbox import new_id
from podbay_api.services import idempotency
from podbay_api.services.idempotency import IdempotencyKey
from podbay_api.services.warm import CLAIM_SQL

TTL_S = 3600.0
TEMPLATE = "idem-test"


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> str:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd-idem', 256, 1)"
                       " ON CONFLICT DO NOTHING", TEMPLATE)
    return tid


async def _sandbox(conn: asyncpg.Connection | asyncpg.Pool, tenant: str) -> str:
    sid = new_id("sbx")
    await conn.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, lease_s) VALUES ($1,$2,$3,'d-idem','pending','running',0,256,1,'h',600)",
        sid, tenant, TEMPLATE)
    return sid


def _key(body: SandboxCreate, key: str | None = None) -> IdempotencyKey:
    return IdempotencyKey(key or secrets.token_hex(8), idempotency.request_hash("sandbox.create", body))


async def test_a_key_is_recorded_once_found_by_a_retry_and_refused_with_another_body(
        pool: asyncpg.Pool, tenant: str) -> None:
    body = SandboxCreate(template=TEMPLATE, metadata={"a": "1"})
    idem = _key(body)
    sid, op = await _sandbox(pool, tenant), new_id("op")
    async with pool.acquire() as conn, conn.transaction():
        assert await idempotency.record(conn, tenant, idem, sid, op, TTL_S)
    prior = await idempotency.lookup(pool, tenant, idem.key, TTL_S)
    assert prior == idempotency.Prior(idem.request_hash, sid, op)
    idempotency.check(prior, _key(SandboxCreate(template=TEMPLATE, metadata={"a": "1"}), idem.key))
    # A live key is not taken over by a second record.
    other = await _sandbox(pool, tenant)
    async with pool.acquire() as conn, conn.transaction():
        assert not await idempotency.record(conn, tenant, idem, other, new_id("op"), TTL_S)
    assert (await idempotency.lookup(pool, tenant, idem.key, TTL_S)) == prior
    with pytest.raises(IdempotencyKeyReused) as err:
        idempotency.check(prior, _key(SandboxCreate(template=TEMPLATE, metadata={"a": "2"}), idem.key))
    assert err.value.http_status == 422 and err.value.details["sandbox_id"] == sid
    # Keys are per tenant: another tenant's same key is its own.
    tenant2 = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant2)
    assert await idempotency.lookup(pool, tenant2, idem.key, TTL_S) is None
    async with pool.acquire() as conn, conn.transaction():
        assert await idempotency.record(conn, tenant2, idem, await _sandbox(conn, tenant2), new_id("op"), TTL_S)


async def test_defaults_hash_alike_and_another_endpoint_does_not() -> None:
    explicit = SandboxCreate.model_validate({"template": TEMPLATE, "metadata": {}})
    assert idempotency.request_hash("sandbox.create", explicit) == idempotency.request_hash(
        "sandbox.create", SandboxCreate(template=TEMPLATE))
    assert idempotency.request_hash("sandbox.fork", explicit) != idempotency.request_hash("sandbox.create", explicit)


async def test_an_expired_key_is_ignored_replaced_and_swept(pool: asyncpg.Pool, tenant: str) -> None:
    idem = _key(SandboxCreate(template=TEMPLATE))
    first = await _sandbox(pool, tenant)
    async with pool.acquire() as conn, conn.transaction():
        assert await idempotency.record(conn, tenant, idem, first, new_id("op"), TTL_S)
    await pool.execute("UPDATE idempotency_keys SET created_at = now() - interval '2 hours'"
                       " WHERE tenant_id=$1 AND key=$2", tenant, idem.key)
    assert await idempotency.lookup(pool, tenant, idem.key, TTL_S) is None
    assert await idempotency.lookup(pool, tenant, idem.key, 3 * TTL_S) is not None  # younger than a longer TTL
    second = await _sandbox(pool, tenant)
    async with pool.acquire() as conn, conn.transaction():
        assert await idempotency.record(conn, tenant, idem, second, new_id("op"), TTL_S)
    prior = await idempotency.lookup(pool, tenant, idem.key, TTL_S)
    assert prior is not None and prior.sandbox_id == second
    # The sweep deletes expired rows only.
    stale = _key(SandboxCreate(template=TEMPLATE))
    async with pool.acquire() as conn, conn.transaction():
        assert await idempotency.record(conn, tenant, stale, await _sandbox(conn, tenant), new_id("op"), TTL_S)
    await pool.execute("UPDATE idempotency_keys SET created_at = now() - interval '2 hours'"
                       " WHERE tenant_id=$1 AND key=$2", tenant, stale.key)
    assert await idempotency.sweep(pool, TTL_S, batch=1) >= 1
    keys = {r["key"] for r in await pool.fetch("SELECT key FROM idempotency_keys WHERE tenant_id=$1", tenant)}
    assert keys == {idem.key}


async def test_two_creates_with_one_key_at_once_leave_one_record(pool: asyncpg.Pool, tenant: str) -> None:
    """The second create's insert waits on the first one's uncommitted row and, once it commits, is refused;
    the second transaction rolls back (KeyTaken through the guard) and its sandbox is gone with it."""
    idem = _key(SandboxCreate(template=TEMPLATE))
    first_conn = await pool.acquire()
    tx = first_conn.transaction()
    await tx.start()
    first = await _sandbox(first_conn, tenant)
    assert await idempotency.record(first_conn, tenant, idem, first, new_id("op"), TTL_S)
    second_started = asyncio.Event()

    async def second_create() -> tuple[bool, str]:
        async with idempotency.TakenGuard() as guard, pool.acquire() as conn, conn.transaction():
            sid = await _sandbox(conn, tenant)
            second_started.set()
            if not await idempotency.record(conn, tenant, idem, sid, new_id("op"), TTL_S):
                raise idempotency.KeyTaken(idem.key)
        return guard.taken, sid

    task = asyncio.create_task(second_create())
    await second_started.wait()
    await tx.commit()
    await pool.release(first_conn)
    taken, second = await task
    assert taken
    assert await pool.fetchval("SELECT count(*) FROM sandboxes WHERE id=$1", second) == 0
    prior = await idempotency.lookup(pool, tenant, idem.key, TTL_S)
    assert prior is not None and prior.sandbox_id == first


def _claim_args(tenant: str, op_id: str, idem: IdempotencyKey | None) -> list[object]:
    event = {"sandbox_id": "", "type": "created", "data": {}}
    return [TEMPLATE, None, tenant, None, f"podbay.evt.audit.{tenant}.sandbox.create", {}, 600, "pause", op_id,
            "key_test", new_id("evt"), "podbay.evt.sandbox.", ".created", event,
            {"sandbox_id": "", "data": {"audit_id": 0, "target": None}}, {"warm": True}, None, new_id("evt"),
            idem.key if idem else None, idem.request_hash if idem else None,
            # The tenant's sandboxes, vCPU, memory and disk limits (services/api/services/quotas.py): generous.
            1000, 1000, 1 << 30, 1 << 30]


async def test_the_warm_claim_records_the_key_in_its_statement_and_claims_nothing_for_a_known_key(
        pool: asyncpg.Pool, tenant: str) -> None:
    node = f"node-idem-{secrets.token_hex(3)}"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:9', 1024, 1, 'tcg', 'ready')", node)
    slots = [f"sbx_{secrets.token_hex(12)}" for _ in range(2)]
    try:
        for slot in slots:
            await pool.execute(
                "INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state, ready_at)"
                " VALUES ($1, $2, $3, 'd-idem', 256, 1, 'ready', now())", slot, node, TEMPLATE)
        idem = _key(SandboxCreate(template=TEMPLATE))
        op_id = new_id("op")
        row = await pool.fetchrow(CLAIM_SQL, *_claim_args(tenant, op_id, idem))
        assert row is not None and row["id"] in slots
        prior = await idempotency.lookup(pool, tenant, idem.key, TTL_S)
        assert prior == idempotency.Prior(idem.request_hash, row["id"], op_id)
        # A retry with the key claims nothing: the other slot stays ready, no sandbox is written.
        assert await pool.fetchrow(CLAIM_SQL, *_claim_args(tenant, new_id("op"), idem)) is None
        left = [s for s in slots if s != row["id"]][0]
        assert await pool.fetchval("SELECT state FROM warm_slots WHERE id=$1", left) == "ready"
        assert await pool.fetchval("SELECT count(*) FROM sandboxes WHERE id=$1", left) == 0
        # Without a key the claim records none.
        plain = await pool.fetchrow(CLAIM_SQL, *_claim_args(tenant, new_id("op"), None))
        assert plain is not None and plain["id"] == left
        assert await pool.fetchval("SELECT count(*) FROM idempotency_keys WHERE sandbox_id=$1", left) == 0
    finally:
        await pool.execute("UPDATE nodes SET state='drained' WHERE id=$1", node)
