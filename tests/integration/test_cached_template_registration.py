"""Nodes that start together register their cached templates at once (services/nodeagent/vm/vmdriver.py,
``register_cached_template``), on a real PostgreSQL. ``ON CONFLICT (name)`` arbitrates only the name: when two
inserts of one name both pass its pre-check before either has written, the second meets the first's
uncommitted row, goes on to the (owner, alias) index of migration 0037, waits there and fails with a unique
violation once the first commits (a second node of a fresh stack failed its start so). With the per-name lock
every registration succeeds and one row holds the name."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest

from podbay_nodeagent.vm.vmdriver import register_cached_template, register_cached_template_in

pytestmark = pytest.mark.integration


async def test_registrations_of_one_name_at_once_all_succeed(pool: asyncpg.Pool, pg_dsn: str) -> None:
    # ``pool`` (tests/integration/conftest.py) has migrated the database.
    nodes = await asyncpg.create_pool(pg_dsn, min_size=8, max_size=8)  # eight nodes, a connection each
    names = [f"regrace-{secrets.token_hex(4)}" for _ in range(150)]
    try:
        failures: list[BaseException] = []
        for name in names:
            done = await asyncio.gather(*(register_cached_template(nodes, name, f"sha256:{i}", 256, 1, 1 << 20)
                                          for i in range(8)), return_exceptions=True)
            failures += [r for r in done if isinstance(r, BaseException)]
        assert failures == [], f"{len(failures)} registrations failed, e.g. {failures[0]!r}"
        rows = await nodes.fetch("SELECT name, alias, owner_tenant FROM templates WHERE name = ANY($1::text[])", names)
        assert sorted(r["name"] for r in rows) == sorted(names)
        assert all(r["alias"] == r["name"] and r["owner_tenant"] is None for r in rows)
    finally:
        await nodes.execute("DELETE FROM templates WHERE name = ANY($1::text[])", names)
        await nodes.close()


async def test_a_registration_waits_for_one_in_flight_and_then_updates_it(pool: asyncpg.Pool, pg_dsn: str) -> None:
    name = f"regwait-{secrets.token_hex(4)}"
    first = await asyncpg.connect(pg_dsn)
    try:
        tx = first.transaction()
        await tx.start()
        await register_cached_template_in(first, name, "sha256:a", 256, 1, 1 << 20)  # node A, not committed yet
        second = asyncio.create_task(register_cached_template(pool, name, "sha256:b", 512, 2, 2 << 20))  # node B
        await asyncio.sleep(0.5)
        assert not second.done()  # B waits for A
        await tx.commit()
        await asyncio.wait_for(second, 30)
        rows = await pool.fetch("SELECT digest, memory_mib, alias FROM templates WHERE name = $1", name)
        assert [(r["digest"], r["memory_mib"], r["alias"]) for r in rows] == [("sha256:b", 512, name)]
    finally:
        await first.close()
        await pool.execute("DELETE FROM templates WHERE name = $1", name)
