"""What is committed on each live node, read in one query per placement (no polling, no cache).

Counted from PostgreSQL rather than from heartbeats, so that placements made a moment ago (whose VMs have not
started yet, or whose node has not heartbeated since) count, whichever scheduler replica made them. The
caller holds the placement advisory lock, so no other placement commits between this read and its update.

For a node that measures its memory, what its last measurement cannot have seen counts as in flight
(``NodeLoad.inflight``): its sandboxes still ``starting`` or ``resuming``, those that became ``running``
(or changed otherwise) since a second before the measurement, and its warm slots being prepared.
"""

from __future__ import annotations

import asyncpg

from podbay.contracts.messages import NodeHeartbeat

from .placement import NodeLoad

__all__ = ["LOAD_SQL", "node_loads"]

#: $1 tenant id, $2 template name, $3 template digest, $4 snapshot id a wake restores (or NULL), $5 node ids
#: and $6 the time of each one's memory measurement. One row per node that has anything: memory (sandboxes,
#: paused ones too, and warm slots), vCPUs (non-paused sandboxes), the tenant's sandboxes, ready warm slots of
#: the template, the template at the digest, the snapshot taken there, what is in flight since the measurement.
LOAD_SQL = (
    "SELECT node_id, sum(mem)::int AS mem, sum(cpu)::int AS cpu, sum(tenant)::int AS tenant,"
    " sum(warm)::int AS warm, bool_or(tpl) AS tpl, bool_or(snap) AS snap, sum(fly)::int AS inflight FROM ("
    " SELECT node_id, memory_mib AS mem, CASE WHEN state <> 'paused' THEN vcpus ELSE 0 END AS cpu,"
    " (tenant_id = $1)::int AS tenant, 0 AS warm, false AS tpl, false AS snap, 0 AS fly"
    " FROM sandboxes WHERE node_id IS NOT NULL AND state NOT IN ('deleted', 'failed')"
    " UNION ALL SELECT node_id, memory_mib, 0, 0, (state = 'ready' AND template = $2)::int, false, false,"
    " (state = 'preparing')::int FROM warm_slots WHERE state IN ('preparing', 'ready')"
    " UNION ALL SELECT node_id, 0, 0, 0, 0, true, false, 0 FROM node_templates WHERE template = $2 AND digest = $3"
    " UNION ALL SELECT node_id, 0, 0, 0, 0, false, true, 0 FROM snapshots WHERE id = $4 AND node_id IS NOT NULL"
    " UNION ALL SELECT s.node_id, 0, 0, 0, 0, false, false, 1 FROM sandboxes s"
    " JOIN unnest($5::text[], $6::timestamptz[]) AS h(node_id, at) ON h.node_id = s.node_id"
    " WHERE s.state IN ('starting', 'resuming')"
    " OR (s.state = 'running' AND s.updated_at > h.at - interval '1 second')"
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
