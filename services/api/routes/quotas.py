"""Per-tenant quotas (issue 37): ``GET /v1/tenants/{tenant}/quota`` (the operator tenant, or the tenant itself)
and ``PUT`` (the operator tenant only); ``{tenant}`` is a tenant id or name. What the limits mean and where they
are checked: services/api/services/quotas.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from podbay.contracts.quotas import QuotaInfo, QuotaSet
from podbay.errors import Forbidden, NotFound

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import quotas
from ..services.sandbox_lookup import audit
from ..services.template_access import is_operator, refuse

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["tenants"])
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.get("/tenants/{tenant}/quota", response_model=QuotaInfo)
async def get_quota(tenant: str, ctx: CtxDep, who: PrincipalDep) -> QuotaInfo:
    """A tenant's quota: limits in force, its own settings and its use now. The tenant itself or the operator
    tenant; 404 ``not_found`` otherwise (as for any other tenant's object) or when no such tenant."""
    tid = await quotas.tenant_id_of(ctx.pool, tenant)
    if tid != who.tenant_id and not await is_operator(ctx.pool, ctx, who):
        raise NotFound(f"tenant {tenant!r} does not exist", details={"tenant": tenant})
    return await quotas.info(ctx.pool, ctx, tid)


@router.put("/tenants/{tenant}/quota", response_model=QuotaInfo)
async def set_quota(tenant: str, body: QuotaSet, ctx: CtxDep, who: PrincipalDep) -> QuotaInfo:
    """Set a tenant's limits (null: the default); audited as ``quota.set``. Existing sandboxes over a lowered
    limit stay; new ones are refused until use falls below it. 403 ``forbidden`` unless the caller belongs
    to the operator tenant; 404 ``not_found`` (no such tenant)."""
    if not await is_operator(ctx.pool, ctx, who):
        await refuse(ctx, who, tenant, route="PUT /v1/tenants/{tenant}/quota", reason="not_operator")
        raise Forbidden("only the operator tenant may set quotas")
    async with ctx.pool.acquire() as conn, conn.transaction():
        tid = await quotas.tenant_id_of(conn, tenant)
        await quotas.set_limits(conn, tid, body)
        await audit(conn, who, "quota.set", tid, detail=body.model_dump())
        info = await quotas.info(conn, ctx, tid)
    ctx.relay.kick()
    return info
