"""The gateway's audited credential uses (services/gateway/store.py) against a real PostgreSQL: two gateways
racing for the last uses of a minute agree, because counting and recording happen under one advisory lock."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import asyncpg
import pytest

from podbay import db
from podbay.outbox import new_id
from podbay_gateway.shaping import CredentialRow
from podbay_gateway.store import GatewayStore

pytestmark = pytest.mark.integration


@pytest.fixture
async def pools(pg_dsn: str) -> AsyncIterator[tuple[asyncpg.Pool, asyncpg.Pool]]:
    a = await db.connect_pool(pg_dsn, min_size=1, max_size=6)
    await db.migrate(a)
    b = await db.connect_pool(pg_dsn, min_size=1, max_size=6)
    yield a, b
    await a.close()
    await b.close()


async def _credential(pool: asyncpg.Pool, **kw: object) -> tuple[CredentialRow, str]:
    tenant, sandbox, cid = new_id("tnt"), new_id("sbx"), new_id("cred")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO credentials (id, tenant_id, name, hosts, header, format, backend, ciphertext,"
                       " rate_limit_per_min, expires_at) VALUES ($1,$2,$1,'{api.test}','Authorization',"
                       "'Bearer {value}','pg','\\x00',$3,$4)", cid, tenant, kw.get("rate"), kw.get("expires_at"))
    row = CredentialRow(id=cid, tenant_id=tenant, name=cid, hosts=("api.test",), header="Authorization",
                        format="Bearer {value}", backend="pg", rate_limit_per_min=kw.get("rate"),  # type: ignore[arg-type]
                        expires_at=kw.get("expires_at"))  # type: ignore[arg-type]
    return row, sandbox


async def test_two_gateways_racing_agree_on_the_rate_limit(pools: tuple[asyncpg.Pool, asyncpg.Pool]) -> None:
    row, sandbox = await _credential(pools[0], rate=3)
    stores = [GatewayStore(pools[0], "node-a"), GatewayStore(pools[1], "node-b")]
    verdicts = await asyncio.gather(*(stores[i % 2].use_credential(row, sandbox_id=sandbox, host="api.test",
                                                                   method="GET", path=f"/{i}") for i in range(10)))
    assert sum(v.allowed for v in verdicts) == 3
    assert {v.code for v in verdicts if not v.allowed} == {"credential_rate_limited"}
    counts = dict(await pools[0].fetch("SELECT decision, count(*) FROM audit_log WHERE target = $1 GROUP BY 1", row.id))
    assert counts == {"allow": 3, "deny": 7}
    events = await pools[0].fetch("SELECT subject FROM outbox WHERE subject LIKE $1", f"podbay.evt.egress.{sandbox}.%")
    subjects = sorted(r["subject"].rsplit(".", 1)[1] for r in events)
    assert subjects == ["credential_refused"] * 7 + ["credential_used"] * 3


async def test_expired_credential_is_refused_and_audited(pools: tuple[asyncpg.Pool, asyncpg.Pool]) -> None:
    row, sandbox = await _credential(pools[0], expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    verdict = await GatewayStore(pools[0], "node-a").use_credential(row, sandbox_id=sandbox, host="api.test",
                                                                     method="POST", path="/x")
    assert not verdict.allowed and verdict.code == "credential_expired"
    audit = await pools[0].fetchrow("SELECT * FROM audit_log WHERE id = $1", verdict.audit_id)
    assert audit["decision"] == "deny" and audit["actor"] == "gateway:node-a" and audit["sandbox_id"] == sandbox
    assert audit["detail"]["reason"] == "credential_expired" and audit["detail"]["method"] == "POST"
