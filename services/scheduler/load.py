"""What is committed on the candidate nodes of a placement, read from PostgreSQL (no polling, no cache).

Counted from PostgreSQL rather than from heartbeats, so that placements made a moment ago (whose VMs have not
started yet, or whose node has not heartbeated since) count, whichever scheduler replica made them. The
caller reads the chosen node's load once more under that node's placement lock (services/scheduler/main.py
``Scheduler._reserve``), so no other placement on it commits between that read and its update.

Work per placement stays flat with the fleet's size (:func:`candidate_loads`): placement scores K random
fitting nodes plus the affine ones, so only those need a load. The live nodes are walked in a random order,
a batch at a time (:data:`BATCH` nodes per query, doubling), keeping the first K that placement would keep;
that is a uniform sample of K among all fitting nodes, as :func:`.placement.choose_node` draws it, but each
query reads only its batch's sandboxes (``sandboxes_node`` index), not every sandbox of the fleet. Only when
fewer than K fit does the walk read further, up to every node.

For a node that measures its memory, what its last measurement cannot have seen counts as in flight
(``NodeLoad.inflight``): its sandboxes still ``starting`` or ``resuming``, those that became ``running``
(or changed otherwise) since a second before the measurement, and its warm slots being prepared.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import asyncpg

from podbay.contracts.messages import NodeHeartbeat
from podbay.contracts.states import NodeState

from .placement import NodeLoad

__all__ = ["LOAD_SQL", "AFFINE_SQL", "BATCH", "node_loads", "candidate_loads"]

#: Nodes whose loads the first query of :func:`candidate_loads` reads (at least 4 K; each further query reads
#: twice as many).
BATCH = 8

#: $1 template name, $2 snapshot id a wake restores (or NULL), $3 wake: the nodes with an affinity, which
#: placement always scores: ready warm slots of the template (a create), the snapshot's node (a wake).
AFFINE_SQL = (
    "SELECT DISTINCT node_id FROM warm_slots WHERE NOT $3 AND state = 'ready' AND template = $1"
    " UNION SELECT node_id FROM snapshots WHERE $3 AND id = $2 AND node_id IS NOT NULL"
)

#: $1 tenant id, $2 template name, $3 template digest, $4 snapshot id a wake restores (or NULL), $5 node ids
#: and $6 the time of each one's memory measurement. One row per node of $5 that has anything (each branch
#: reads only those nodes' rows, by index): memory (sandboxes,
#: paused ones too, and warm slots), vCPUs (non-paused sandboxes), the tenant's sandboxes, ready warm slots of
#: the template, the template at the digest, the snapshot taken there, what is in flight since the measurement.
LOAD_SQL = (
    "SELECT node_id, sum(mem)::int AS mem, sum(cpu)::int AS cpu, sum(tenant)::int AS tenant,"
    " sum(warm)::int AS warm, bool_or(tpl) AS tpl, bool_or(snap) AS snap, sum(fly)::int AS inflight FROM ("
    " SELECT node_id, memory_mib AS mem, CASE WHEN state <> 'paused' THEN vcpus ELSE 0 END AS cpu,"
    " (tenant_id = $1)::int AS tenant, 0 AS warm, false AS tpl, false AS snap, 0 AS fly"
    " FROM sandboxes WHERE node_id = ANY($5::text[]) AND state NOT IN ('deleted', 'failed')"
    " UNION ALL SELECT node_id, memory_mib, 0, 0, (state = 'ready' AND template = $2)::int, false, false,"
    " (state = 'preparing')::int FROM warm_slots WHERE node_id = ANY($5::text[]) AND state IN ('preparing', 'ready')"
    " UNION ALL SELECT node_id, 0, 0, 0, 0, true, false, 0 FROM node_templates WHERE template = $2 AND digest = $3"
    " AND node_id = ANY($5::text[])"
    " UNION ALL SELECT node_id, 0, 0, 0, 0, false, true, 0 FROM snapshots WHERE id = $4 AND node_id = ANY($5::text[])"
    " UNION ALL SELECT s.node_id, 0, 0, 0, 0, false, false, 1 FROM sandboxes s"
    " JOIN unnest($5::text[], $6::timestamptz[]) AS h(node_id, at) ON h.node_id = s.node_id"
    # Spelled out for the planner (implied by the join and the states): the sandboxes_node index, not a scan.
    " WHERE s.node_id = ANY($5::text[]) AND s.state <> 'deleted' AND (s.state IN ('starting', 'resuming')"
    " OR (s.state = 'running' AND s.updated_at > h.at - interval '1 second'))"
    ") l GROUP BY node_id"
)


async def node_loads(conn: asyncpg.Connection, nodes: list[NodeHeartbeat], *, tenant_id: str, template: str,
                     digest: str | None, snapshot_id: str | None) -> list[NodeLoad]:
    """One :class:`NodeLoad` per heartbeat in ``nodes`` (a node with nothing on it gets zeros)."""
    ids = [hb.node_id for hb in nodes]
    measured_at = [hb.memory_measured_at or hb.at for hb in nodes]
    rows = {r["node_id"]: r for r in await conn.fetch(LOAD_SQL, tenant_id, template, digest, snapshot_id,
                                                       ids, measured_at)}
    out = []
    for hb in nodes:
        r = rows.get(hb.node_id)
        if r is None:
            out.append(NodeLoad(hb, 0, 0))
            continue
        out.append(NodeLoad(hb, int(r["mem"] or 0), int(r["cpu"] or 0), tenant_sandboxes=int(r["tenant"] or 0),
                            warm_ready=int(r["warm"] or 0), has_digest=bool(r["tpl"]), holds_snapshot=bool(r["snap"]),
                            inflight=int(r["inflight"] or 0)))
    return out


async def candidate_loads(conn: asyncpg.Connection, nodes: list[NodeHeartbeat], *, keep: Callable[[NodeLoad], bool],
                          k: int, wake: bool, tenant_id: str, template: str, digest: str | None,
                          snapshot_id: str | None, rng: random.Random | None = None) -> list[NodeLoad]:
    """The loads one placement scores: ``k`` nodes drawn uniformly among those of ``nodes`` that are ``ready``
    in ``nodes.state`` and that ``keep`` accepts (placement's filter), plus every such node with an affinity
    (:data:`AFFINE_SQL`). Walks ``nodes`` in a random order, :data:`BATCH` nodes per query at first, so a
    fleet of any size costs about one query of K nodes' sandboxes. Empty when no node is kept (the caller
    then reads every node to say why). ``nodes``: live heartbeats."""
    r = rng or random.Random()
    by_id = {hb.node_id: hb for hb in nodes}
    affine = {row["node_id"] for row in await conn.fetch(AFFINE_SQL, template, snapshot_id, wake)} & by_id.keys()
    order = list(nodes)
    r.shuffle(order)
    picked: dict[str, NodeLoad] = {}
    extra: dict[str, NodeLoad] = {}
    todo = [by_id[i] for i in sorted(affine)]
    start, size = 0, max(BATCH, 4 * k)
    while todo or (start < len(order) and len(picked) < k):
        chunk = order[start:start + size]
        start, size = start + size, size * 2
        in_chunk = {hb.node_id for hb in chunk}
        ask = chunk + [hb for hb in todo if hb.node_id not in in_chunk]
        todo = []
        ready = {row["id"] for row in await conn.fetch(
            "SELECT id FROM nodes WHERE id = ANY($1::text[]) AND state = $2", [hb.node_id for hb in ask],
            NodeState.READY)}
        loads = {n.node_id: n for n in await node_loads(conn, [hb for hb in ask if hb.node_id in ready],
                                                         tenant_id=tenant_id, template=template, digest=digest,
                                                         snapshot_id=snapshot_id)}
        for hb in chunk:  # in the walk's order: the first k kept are a uniform sample of all kept
            n = loads.get(hb.node_id)
            if n is not None and len(picked) < k and keep(n):
                picked[n.node_id] = n
        for node_id in affine:
            n = loads.get(node_id)
            if n is not None and node_id not in extra and keep(n):
                extra[node_id] = n
    return list({**picked, **extra}.values())
