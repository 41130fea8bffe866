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

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import pools, quotas, template_access
from ..services.sandbox_lookup import audit

__all__ = ["router"]

router = APIRouter(prefix="/v1")

#: The hit and miss counts of ``GET /v1/pools`` cover the caller's creates of this last stretch (seconds).
HIT_WINDOW_S = 3600.0

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
        key = row["name"]  # pools, slots and targets are by the template's key
        if row["owner_tenant"] is not None:
            # Warm slots hold VMs on shared nodes: a tenant's pools, all together, stay within its sandboxes
            # quota (the operator's pools of shared templates are the operator's business).
            await quotas.check_pool(conn, ctx, who, key, max_size, route=route)
        await pools.set_bounds(conn, key, body.size, max_size)
        await audit(conn, who, "pool.set", template, detail={"key": key})
    # The warm-pool service recomputes targets on this notice instead of at its next interval.
    await ctx.bus.nc.publish(subjects.WARM_POOLS_CHANGED, key.encode())
    return (await _pools(ctx, who, key))[0]


@router.get("/pools", response_model=PoolList)
async def list_pools(ctx: CtxDep, who: PrincipalDep) -> PoolList:
    """The pools of the templates the caller may see (shared ones and its own): bounds, current target, and
    per node the target and the slots that are ready, preparing, claimed and failing within the recent demand
    window; and the caller's warm hits and misses of the last hour (:data:`HIT_WINDOW_S`)."""
    return PoolList(pools=await _pools(ctx, who, None))


async def _pools(ctx: ApiContext, who: Principal, template: str | None) -> list[PoolInfo]:
    """The pools of template key ``template`` (None: every one the caller may see), shown by the names their
    owners gave (``alias``)."""
    rows_of = await pools.visible_pools(ctx.pool, who.tenant_id, template)
    rows = await pools.slot_counts(ctx.pool, template, ctx.settings.warm_demand_window_s)
    # Hit and miss counts from the caller's own create audit rows (a warm create's detail says "warm"): another
    # tenant's creates of a shared template are not the caller's to count.
    counts = await pools.warm_hits(ctx.pool, who.tenant_id, [p["alias"] for p in rows_of], HIT_WINDOW_S)
    out: list[PoolInfo] = []
    for p in rows_of:
        hits, misses = counts.get(p["alias"], (0, 0))
        nodes = [PoolNode(node_id=r["node_id"], target=r["target"], ready=r["ready"], preparing=r["preparing"],
                          claimed=r["claimed"], failing=r["failing"]) for r in rows if r["template"] == p["template"]]
        out.append(PoolInfo(template=p["alias"], size=p["min_size"], max_size=p["max_size"],
                            target=sum(n.target for n in nodes), ready=sum(n.ready for n in nodes), nodes=nodes,
                            hits=hits, misses=misses,
                            hit_rate=round(hits / (hits + misses), 4) if hits + misses else None))
    return out
