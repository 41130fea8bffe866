"""Warm pools' named queries (tables ``warm_pools``, ``warm_targets``, ``warm_slots``; docs/DESIGN.md §5): a
template's pool bounds, the pools a tenant may see, each pool's slots per node and a tenant's warm hits.
``/v1/pools`` (services/api/routes/pools.py) calls them; slots' states are podbay.warm_slot_state's."""

from __future__ import annotations

import asyncpg

from podbay.contracts.states import WarmSlotState

from .template_access import VISIBLE_SQL

__all__ = ["set_bounds", "visible_pools", "slot_counts", "warm_hits"]


async def set_bounds(conn: asyncpg.Connection, key: str, min_size: int, max_size: int) -> None:
    """Set the pool of template key ``key`` to at least ``min_size`` and at most ``max_size`` warm slots."""
    await conn.execute(
        "INSERT INTO warm_pools (template, min_size, max_size) VALUES ($1,$2,$3) ON CONFLICT (template)"
        " DO UPDATE SET min_size=$2, max_size=$3, updated_at=now()",
        key, min_size, max_size)


async def visible_pools(pool: asyncpg.Pool, tenant_id: str, template: str | None) -> list[asyncpg.Record]:
    """The pools (``template`` key, ``alias``, ``min_size``, ``max_size``) of template key ``template`` (None:
    every one) that tenant ``tenant_id`` may see, by alias."""
    return list(await pool.fetch(
        "SELECT p.template, t.alias, p.min_size, p.max_size FROM warm_pools p JOIN templates t ON t.name = p.template"
        " WHERE ($1::text IS NULL OR p.template=$1) AND " + VISIBLE_SQL.format(tenant="$2")
        # A shared template the caller has a name of its own for is not the caller's ``name`` (as in lists).
        + " AND NOT (t.owner_tenant IS NULL AND EXISTS (SELECT 1 FROM templates o WHERE o.alias = t.alias"
        " AND o.owner_tenant = $2 AND o.deleted_at IS NULL)) ORDER BY t.alias", template, tenant_id))


async def slot_counts(pool: asyncpg.Pool, template: str | None, window_s: float) -> list[asyncpg.Record]:
    """Per template key and node (``template``, ``node_id``): the ``target`` and the slots ``ready``,
    ``preparing``, and ``claimed`` or ``failing`` within the last ``window_s`` seconds."""
    return list(await pool.fetch(
        "SELECT template, node_id, sum(target)::int AS target, sum(ready)::int AS ready,"
        " sum(preparing)::int AS preparing, sum(claimed)::int AS claimed, sum(failing)::int AS failing FROM ("
        "  SELECT template, node_id, target, 0 AS ready, 0 AS preparing, 0 AS claimed, 0 AS failing"
        "  FROM warm_targets"
        f"  UNION ALL SELECT template, node_id, 0, (state='{WarmSlotState.READY}')::int,"
        f"  (state='{WarmSlotState.PREPARING}')::int,"
        f"  (state='{WarmSlotState.CLAIMED}' AND claimed_at > now() - make_interval(secs => $2))::int,"
        f"  (state='{WarmSlotState.FAILED}' AND failed_at > now() - make_interval(secs => $2))::int FROM warm_slots"
        " ) x WHERE $1::text IS NULL OR template=$1 GROUP BY template, node_id ORDER BY template, node_id",
        template, window_s))


async def warm_hits(pool: asyncpg.Pool, tenant_id: str, aliases: list[str], window_s: float
                    ) -> dict[str, tuple[int, int]]:
    """``{alias: (hits, misses)}``: tenant ``tenant_id``'s creates of these templates in the last ``window_s``
    seconds that took a warm slot, and those that did not (from its ``sandbox.create`` audit rows)."""
    return {r["template"]: (r["hits"], r["misses"]) for r in await pool.fetch(
        "SELECT detail->>'template' AS template, count(*) FILTER (WHERE detail->>'warm' = 'true')::int AS hits,"
        " count(*) FILTER (WHERE detail->>'warm' IS DISTINCT FROM 'true')::int AS misses FROM audit_log"
        " WHERE tenant_id=$1 AND action='sandbox.create' AND at > now() - make_interval(secs => $2)"
        " AND detail->>'template' = ANY($3::text[]) GROUP BY 1",
        tenant_id, window_s, aliases)}
