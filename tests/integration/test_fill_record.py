"""services/nodeagent/computer/fill_memory.py's durable record against a real PostgreSQL: a sandbox's filled set is the
``credential.fill`` ``allow`` audit rows of the sandbox and its ancestors (a fork child holds its parent's page,
and its grandparent's), with each value revealed from the credential store as the fill reveals it; refusals,
other sandboxes' fills and the values of deleted credentials are not in it, and no value is in the rows."""

from __future__ import annotations

from types import SimpleNamespace

import asyncpg
import pytest
from podbay_nodeagent.computer.fill_memory import PgFillRecord

from podbay import audit
from podbay.credentials import PgCredentialStore, new_key
from podbay.outbox import new_id

KEY = new_key()


@pytest.fixture
async def tenant(pool: asyncpg.Pool) -> str:
    tid = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('fill-record-test', 'd', 256,"
                       " 1) ON CONFLICT DO NOTHING")
    return tid


async def _sandbox(pool: asyncpg.Pool, tenant: str, parent: str | None = None) -> str:
    sid = new_id("sbx")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, parent_sandbox_id) VALUES ($1,$2,'fill-record-test','d','running','running',256,1,'h',$3)",
        sid, tenant, parent)
    return sid


async def _credential(pool: asyncpg.Pool, tenant: str, value: str) -> str:
    cid = new_id("cred")
    sealed = await PgCredentialStore(KEY).seal(cid, tenant, value)
    await pool.execute("INSERT INTO credentials (id, tenant_id, name, hosts, header, format, backend, ciphertext)"
                       " VALUES ($1,$2,$1,'{127.0.0.1}','Authorization','Bearer {value}','pg',$3)",
                       cid, tenant, sealed.ciphertext)
    return cid


async def _fill(pool: asyncpg.Pool, tenant: str, sandbox: str, cred: str, selector: str,
                decision: str = "allow") -> None:
    """The row Filler.fill writes."""
    async with pool.acquire() as conn, conn.transaction():
        await audit.record(conn, tenant_id=tenant, actor="node:n1", action="credential.fill", target=cred,
                           sandbox_id=sandbox, decision=decision,
                           detail={"credential": cred, "selector": selector, "origin": "http://127.0.0.1:8000"})


async def test_a_fork_child_and_its_child_inherit_the_ancestors_fills(pool: asyncpg.Pool, tenant: str) -> None:
    record = PgFillRecord(pool, SimpleNamespace(credential_backend="pg", credential_key=KEY))  # type: ignore[arg-type]
    parent = await _sandbox(pool, tenant)
    a, b, refused = [await _credential(pool, tenant, v) for v in ("pw-a", "pw-b", "pw-refused")]
    await _fill(pool, tenant, parent, a, "#pw")
    await _fill(pool, tenant, parent, a, "#pw")  # filled twice: one value, one selector
    await _fill(pool, tenant, parent, refused, "#x", decision="deny")
    child = await _sandbox(pool, tenant, parent)
    await _fill(pool, tenant, child, b, "#otp")
    grandchild = await _sandbox(pool, tenant, child)
    unrelated = await _sandbox(pool, tenant)

    got = await record.load(parent)
    assert (got.values, got.selectors) == ({"pw-a"}, {"#pw"})
    got = await record.load(child)
    assert (got.values, got.selectors) == ({"pw-a", "pw-b"}, {"#pw", "#otp"})
    got = await record.load(grandchild)
    assert (got.values, got.selectors) == ({"pw-a", "pw-b"}, {"#pw", "#otp"})
    got = await record.load(unrelated)
    assert (got.values, got.selectors) == (set(), set())
    rows = await pool.fetch("SELECT detail::text AS d FROM audit_log WHERE sandbox_id = ANY($1)", [parent, child])
    assert rows and not any("pw-" in r["d"] for r in rows)


async def test_a_deleted_credential_keeps_its_mask_but_has_no_value(pool: asyncpg.Pool, tenant: str) -> None:
    record = PgFillRecord(pool, SimpleNamespace(credential_backend="pg", credential_key=KEY))  # type: ignore[arg-type]
    sid = await _sandbox(pool, tenant)
    cid = await _credential(pool, tenant, "pw-gone")
    await _fill(pool, tenant, sid, cid, "#pw")
    await pool.execute("UPDATE credentials SET deleted_at = now(), ciphertext = NULL WHERE id = $1", cid)
    got = await record.load(sid)
    assert (got.values, got.selectors) == (set(), {"#pw"})
