"""``podbay.naming``: a sandbox's hostname is the same whether Python or PostgreSQL derives it (a new row's is
derived in SQL by podbay.lifecycle.insert_sql; the node agent and the fork command use the Python rule)."""

from __future__ import annotations

import asyncpg

from podbay.naming import sandbox_hostname, sandbox_hostname_sql
from podbay.outbox import new_id


async def test_the_sql_rule_is_the_python_rule(pg_dsn: str) -> None:
    ids = [new_id("sbx") for _ in range(50)]
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch(f"SELECT id, {sandbox_hostname_sql('id')} AS hostname FROM unnest($1::text[]) AS id",
                                ids)
    finally:
        await conn.close()
    assert {r["id"]: r["hostname"] for r in rows} == {i: sandbox_hostname(i) for i in ids}


def test_a_hostname_is_sbx_and_the_ids_first_12_hex_digits() -> None:
    assert sandbox_hostname("sbx_3f2a9c01b7d4e5f60718") == "sbx-3f2a9c01b7d4"
