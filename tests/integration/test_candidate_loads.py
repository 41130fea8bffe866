"""The scheduler's candidate loads against real PostgreSQL (services/scheduler/load.py ``candidate_loads``): a
placement reads the sandboxes of a batch of nodes, not of the whole fleet, yet keeps K nodes placement's
filter keeps, every affine node, and finds the one node with room however far the walk must go."""

from __future__ import annotations

import os
import random
from datetime import UTC, datetime

import asyncpg
import pytest

from podbay.contracts.messages import NodeHeartbeat
from podbay_scheduler import load
from podbay_scheduler.load import BATCH, candidate_loads
from podbay_scheduler.main import _kept
from podbay_scheduler.placement import Request

pytestmark = pytest.mark.integration

NODES = 300


def _hb(node: str, tpl: str) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, dataplane_url="http://127.0.0.1:1", memory_mib=4096, memory_used_mib=0,
                         vcpus=8, vcpus_used=0, sandboxes=0, templates=[tpl], accel="tcg", at=datetime.now(UTC))


async def _fleet(pool: asyncpg.Pool, tag: str) -> tuple[str, str, list[str]]:
    """A tenant, a template and NODES ready nodes, each running 4 sandboxes of 512 MiB and 1 vCPU."""
    tenant, tpl = f"t-{tag}", f"ct-{tag}"
    nodes = [f"cn-{tag}-{i:03d}" for i in range(NODES)]
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 512, 1)", tpl)
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) SELECT id,"
                       " 'http://127.0.0.1:1', 4096, 8, 'tcg' FROM unnest($1::text[]) id", nodes)
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, node_id) SELECT 'sbx_' || $3 || '_' || i, $1, $2, 'd', 'running', 'running', 512, 1, 'h',"
        " ($4::text[])[1 + i % cardinality($4::text[])] FROM generate_series(0, 4 * cardinality($4::text[]) - 1) i",
        tenant, tpl, tag, nodes)
    return tenant, tpl, nodes


async def test_a_placement_reads_a_batch_of_nodes_and_keeps_k_plus_the_affine(
        pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = os.urandom(3).hex()
    tenant, tpl, nodes = await _fleet(pool, tag)
    warm = nodes[137]
    await pool.execute("INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state)"
                       " VALUES ($1, $2, $3, 'd', 512, 1, 'ready')", f"sbx_{tag}_w", warm, tpl)
    read: list[int] = []
    real = load.node_loads

    async def counting(conn: asyncpg.Connection, hbs: list[NodeHeartbeat], **kw: object) -> list[load.NodeLoad]:
        read.append(len(hbs))
        return await real(conn, hbs, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(load, "node_loads", counting)
    req = Request(tpl, 512, 1)
    async with pool.acquire() as conn:
        got = await candidate_loads(conn, [_hb(n, tpl) for n in nodes], keep=lambda n: _kept(n, req), k=2,
                                    wake=False, tenant_id=tenant, template=tpl, digest="d", snapshot_id=None,
                                    rng=random.Random(7))
    # One query of a batch (plus the affine node), not of 300 nodes.
    assert read == [BATCH + 1] or read == [BATCH]
    ids = [n.node_id for n in got]
    assert warm in ids and len(ids) == 3 and len(set(ids)) == 3
    by_id = {n.node_id: n for n in got}
    assert by_id[warm].warm_ready == 1 and by_id[warm].memory_used_mib == 4 * 512 + 512
    assert all(n.memory_used_mib >= 4 * 512 and n.tenant_sandboxes == 4 for n in got)


async def test_the_walk_goes_on_until_it_finds_the_one_node_with_room(pool: asyncpg.Pool) -> None:
    tag = os.urandom(3).hex()
    tenant, tpl, nodes = await _fleet(pool, tag)
    roomy = nodes[251]
    # Every node but one is full (4 x 512 MiB + 4 x 512 MiB of 4096); a draining node with room is passed by.
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, node_id) SELECT 'sbx_' || $3 || '_f' || i, $1, $2, 'd', 'running', 'running', 2048, 1, 'h', n"
        " FROM unnest($4::text[]) WITH ORDINALITY AS u(n, i)", tenant, tpl, tag,
        [n for n in nodes if n not in (roomy, nodes[3])])
    await pool.execute("UPDATE nodes SET state = 'draining' WHERE id = $1", nodes[3])
    req = Request(tpl, 512, 1)
    async with pool.acquire() as conn:
        got = await candidate_loads(conn, [_hb(n, tpl) for n in nodes], keep=lambda n: _kept(n, req), k=2,
                                    wake=False, tenant_id=tenant, template=tpl, digest="d", snapshot_id=None)
        assert [n.node_id for n in got] == [roomy]
        # Nothing kept at all: empty (the scheduler then reads every node to say why).
        await pool.execute("UPDATE nodes SET state = 'draining' WHERE id = $1", roomy)
        assert await candidate_loads(conn, [_hb(n, tpl) for n in nodes], keep=lambda n: _kept(n, req), k=2,
                                     wake=False, tenant_id=tenant, template=tpl, digest="d", snapshot_id=None) == []
