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
from . import quotas, template_access
from .sandbox_lookup import audit
from .template_access import VISIBLE_SQL

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.put("/pools/{template}", response_model=PoolInfo)
async def set_pool(template: str, body: PoolSet, ctx: CtxDep, who: PrincipalDep) -> PoolInfo:
    """Set the pool of ``template``: at least ``size`` warm slots, up to ``max_size`` (default ``size``) when
    recent demand asks for more. Targets follow within ``warm_interval_s``; the nodes are told at once.

    Only the template's owner sets its pool; a shared template's, only the operator tenant
    (services/api/template_access.py).

    Errors: 404 ``not_found`` (unknown template, or another tenant's), 403 ``forbidden`` (a shared template and
    the caller is not the operator tenant), 403 ``quota_exceeded`` (the ``max_size`` of the tenant's pools
    together would pass its sandboxes quota), 422 ``validation_error`` (``max_size`` below ``size``).
    """
    max_size = body.max_size if body.max_size is not None else body.size
    route = "PUT /v1/pools/{template}"
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await template_access.lookup(conn, ctx, who, template, route=route, write=True, lock="FOR SHARE")
        if row is None:
            raise NotFound(f"template {template!r} does not exist", details={"template": template})
        if row["owner_tenant"] is not None:
            # Warm slots hold VMs on shared nodes: a tenant's pools, all together, stay within its sandboxes
            # quota (the operator's pools of shared templates are the operator's business).
            await quotas.check_pool(conn, ctx, who, template, max_size, route=route)
        await conn.execute(
            "INSERT INTO warm_pools (template, min_size, max_size) VALUES ($1,$2,$3) ON CONFLICT (template)"
            " DO UPDATE SET min_size=$2, max_size=$3, updated_at=now()",
            template, body.size, max_size)
        await audit(conn, who, "pool.set", template)
    # The warm-pool service recomputes targets on this notice instead of at its next interval.
    await ctx.bus.nc.publish(subjects.WARM_POOLS_CHANGED, template.encode())
    return (await _pools(ctx, who, template))[0]


@router.get("/pools", response_model=PoolList)
async def list_pools(ctx: CtxDep, who: PrincipalDep) -> PoolList:
    """The pools of the templates the caller may see (shared ones and its own): bounds, current target, and
    per node the target and the slots that are ready, preparing, claimed and failing within the recent demand
    window."""
    return PoolList(pools=await _pools(ctx, who, None))


async def _pools(ctx: ApiContext, who: Principal, template: str | None) -> list[PoolInfo]:
    pools = await ctx.pool.fetch(
        "SELECT p.template, p.min_size, p.max_size FROM warm_pools p JOIN templates t ON t.name = p.template"
        " WHERE ($1::text IS NULL OR p.template=$1) AND " + VISIBLE_SQL.format(tenant="$2")
        + " ORDER BY p.template", template, who.tenant_id)
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
