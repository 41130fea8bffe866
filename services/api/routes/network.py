"""Egress policy (docs/DESIGN.md §6): ``GET/PUT /v1/sandboxes/{id}/network`` and ``/v1/templates/{name}/network``.

The policy (:class:`podbay.contracts.egress.EgressPolicy`) is stored in ``sandboxes.egress_policy`` and
``templates.egress_policy``. A sandbox's own policy wins; without one the template's applies; without that,
nothing is allowed. The gateway reads the rows on every new connection and DNS query, so a change here takes
effect on the guest's next connection (open connections keep going). Forks inherit the parent's own policy.

Templates are shared by every tenant: a template's default applies to all sandboxes of it that have no
policy of their own, so only the operator tenant (``PODBAY_OPERATOR_TENANT``) may change it (audited).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from podbay.contracts.access import NetworkInfo
from podbay.contracts.egress import EgressPolicy
from podbay.errors import Forbidden, NotFound

from ..services import template_access
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import network
from ..services.nodes import is_operator_tenant
from ..services.sandbox_lookup import audit

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.get("/sandboxes/{sandbox_id}/network", response_model=NetworkInfo)
async def get_sandbox_network(sandbox_id: str, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """The sandbox's effective egress policy and its source (``sandbox``, ``template`` or ``default``)."""
    return await network.sandbox_policy(ctx.pool, who.tenant_id, sandbox_id)


@router.put("/sandboxes/{sandbox_id}/network", response_model=NetworkInfo)
async def set_sandbox_network(sandbox_id: str, body: EgressPolicy, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """Replace the sandbox's own egress policy; the gateway applies it from the guest's next connection.
    409 ``invalid_state`` for a deleted sandbox."""
    return await network.set_sandbox_policy(ctx, who, sandbox_id, body)


@router.get("/templates/{name}/network", response_model=NetworkInfo)
async def get_template_network(name: str, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """The template's default egress policy (``source`` ``template``, or ``default``: no egress). 404
    ``not_found`` for an unknown template or another tenant's (services/api/template_access.py)."""
    row = await template_access.lookup(ctx.pool, ctx, who, name, route="GET /v1/templates/{name}/network")
    if row is None:
        raise NotFound(f"template {name!r} does not exist", details={"template": name})
    return network.effective_policy(None, await network.template_policy(ctx.pool, row["name"]))


@router.put("/templates/{name}/network", response_model=NetworkInfo)
async def set_template_network(name: str, body: EgressPolicy, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """Replace the template's default egress policy: it applies to its sandboxes without a policy of their
    own, from their next connection. 404 ``not_found`` for an unknown template; 403 ``forbidden`` unless the
    caller belongs to the operator tenant (``PODBAY_OPERATOR_TENANT``): templates are shared by every tenant,
    so one tenant must not widen another's egress."""
    policy = body.model_dump(mode="json")
    async with ctx.pool.acquire() as conn, conn.transaction():
        if not await is_operator_tenant(conn, ctx.settings, who.tenant_id):
            raise Forbidden("only the operator tenant may change a template's egress policy (it applies to every "
                            "tenant); set a policy on your sandboxes instead", details={"template": name})
        # The operator manages shared templates and its own; a tenant's private one is not its to widen.
        row = await template_access.lookup(conn, ctx, who, name, route="PUT /v1/templates/{name}/network")
        if row is None:
            raise NotFound(f"template {name!r} does not exist", details={"template": name})
        await network.set_template_policy(conn, row["name"], policy)
        await audit(conn, who, "template.network", name, detail={"allow": len(body.allow), "deny": len(body.deny)})
    ctx.relay.kick()
    return network.effective_policy(None, policy)
