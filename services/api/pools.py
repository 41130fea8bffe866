"""Warm-pool endpoints: set a template's pool bounds and show each node's part (docs/DESIGN.md §5, warm pools).

The bounds live in ``warm_pools``; the warm-pool service turns them and recent demand into per-node
targets (``warm_targets``) and the node agents keep that many slots (``warm_slots``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from podbay.contracts import subjects
from podbay.contracts.api import PoolInfo, PoolList, PoolNode, PoolSet
from podbay.errors import NotFound

from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep, principal_dep
from .sandbox_lookup import audit

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.put("/pools/{template}", response_model=PoolInfo)
async def set_pool(template: str, body: PoolSet, ctx: CtxDep, who: PrincipalDep) -> PoolInfo:
    """Set the pool of ``template``: at least ``size`` warm slots, up to ``max_size`` (default ``size``) when
    recent demand asks for more. Targets follow within ``warm_interval_s``; the nodes are told at once.

    Errors: 404 ``not_found`` (unknown template), 422 ``validation_error`` (``max_size`` below ``size``).
    """
    async with ctx.pool.acquire() as conn, conn.transaction():
        if await conn.fetchval("SELECT 1 FROM templates WHERE name=$1", template) is None:
            raise NotFound(f"template {template!r} does not exist", details={"template": template})
        await conn.execute(
            "INSERT INTO warm_pools (template, min_size, max_size) VALUES ($1,$2,$3) ON CONFLICT (template)"
            " DO UPDATE SET min_size=$2, max_size=$3, updated_at=now()",
            template, body.size, body.max_size if body.max_size is not None else body.size)
        await audit(conn, who, "pool.set", template)
    # The warm-pool service recomputes targets on this notice instead of at its next interval.
    await ctx.bus.nc.publish(subjects.WARM_POOLS_CHANGED, template.encode())
    return (await _pools(ctx, template))[0]


@router.get("/pools", response_model=PoolList)
async def list_pools(ctx: CtxDep, who: PrincipalDep) -> PoolList:
    """Every pool: its bounds, its current target, and per node the target and the slots that are ready,
    preparing, claimed and failing within the recent demand window."""
    return PoolList(pools=await _pools(ctx, None))


async def _pools(ctx: ApiContext, template: str | None) -> list[PoolInfo]:
    pools = await ctx.pool.fetch(
        "SELECT template, min_size, max_size FROM warm_pools WHERE $1::text IS NULL OR template=$1"
        " ORDER BY template", template)
    window = ctx.settings.warm_demand_window_s
    rows = await ctx.pool.fetch(
        "SELECT template, node_id, sum(target)::int AS target, sum(ready)::int AS ready,"
        " sum(preparing)::int AS preparing, sum(claimed)::int AS claimed, sum(failing)::int AS failing FROM ("
        "  SELECT template, node_id, target, 0 AS ready, 0 AS preparing, 0 AS claimed, 0 AS failing"
        "  FROM warm_targets"
        "  UNION ALL SELECT template, node_id, 0, (state='ready')::int, (state='preparing')::int,"
        "  (state='claimed' AND claimed_at > now() - make_interval(secs => $2))::int,"
        "  (state='failed' AND failed_at > now() - make_interval(secs => $2))::int FROM warm_slots"
        " ) x WHERE $1::text IS NULL OR template=$1 GROUP BY template, node_id ORDER BY template, node_id",
        template, window)
    out: list[PoolInfo] = []
    for p in pools:
        nodes = [PoolNode(node_id=r["node_id"], target=r["target"], ready=r["ready"], preparing=r["preparing"],
                          claimed=r["claimed"], failing=r["failing"]) for r in rows if r["template"] == p["template"]]
        out.append(PoolInfo(template=p["template"], size=p["min_size"], max_size=p["max_size"],
                            target=sum(n.target for n in nodes), ready=sum(n.ready for n in nodes), nodes=nodes))
    return out
