"""Egress policy (docs/DESIGN.md §6): ``GET/PUT /v1/sandboxes/{id}/network`` and ``/v1/templates/{name}/network``.

The policy (:class:`podbay.contracts.egress.EgressPolicy`) is stored in ``sandboxes.egress_policy`` and
``templates.egress_policy``. A sandbox's own policy wins; without one the template's applies; without that,
nothing is allowed. The gateway reads the rows on every new connection and DNS query, so a change here takes
effect on the guest's next connection (open connections keep going). Forks inherit the parent's own policy.

Templates are shared by every tenant: a template's default applies to all sandboxes of it that have no
policy of their own, so only the operator tenant (``PODBAY_OPERATOR_TENANT``) may change it (audited).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from podbay.contracts.access import NetworkInfo
from podbay.contracts.egress import EgressPolicy
from podbay.contracts.states import SandboxState
from podbay.errors import Forbidden, InvalidState, NotFound

from . import template_access
from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep, principal_dep
from .sandbox_lookup import audit

__all__ = ["router", "effective_policy"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


def effective_policy(own: Any, template: Any) -> NetworkInfo:
    """The policy that applies, from a sandbox's own (JSON or None) and its template's (JSON or None)."""
    if own is not None:
        return NetworkInfo(policy=EgressPolicy.model_validate(own), source="sandbox")
    if template is not None:
        return NetworkInfo(policy=EgressPolicy.model_validate(template), source="template")
    return NetworkInfo(policy=EgressPolicy(), source="default")


async def _sandbox_row(conn: Any, tenant_id: str, sandbox_id: str, *, for_update: bool = False) -> Any:
    row = await conn.fetchrow(
        "SELECT s.state, s.egress_policy, t.egress_policy AS template_policy FROM sandboxes s"
        " LEFT JOIN templates t ON t.name = s.template WHERE s.id=$1 AND s.tenant_id=$2"
        + (" FOR UPDATE OF s" if for_update else ""), sandbox_id, tenant_id)
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} does not exist", details={"sandbox_id": sandbox_id})
    return row


@router.get("/sandboxes/{sandbox_id}/network", response_model=NetworkInfo)
async def get_sandbox_network(sandbox_id: str, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """The sandbox's effective egress policy and its source (``sandbox``, ``template`` or ``default``)."""
    row = await _sandbox_row(ctx.pool, who.tenant_id, sandbox_id)
    return effective_policy(row["egress_policy"], row["template_policy"])


@router.put("/sandboxes/{sandbox_id}/network", response_model=NetworkInfo)
async def set_sandbox_network(sandbox_id: str, body: EgressPolicy, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """Replace the sandbox's own egress policy; the gateway applies it from the guest's next connection.
    409 ``invalid_state`` for a deleted sandbox."""
    policy = body.model_dump(mode="json")
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await _sandbox_row(conn, who.tenant_id, sandbox_id, for_update=True)
        if row["state"] in (SandboxState.DELETING, SandboxState.DELETED):
            raise InvalidState(f"sandbox {sandbox_id} is {row['state']}", details={"state": row["state"]})
        await conn.execute("UPDATE sandboxes SET egress_policy=$2, updated_at=now() WHERE id=$1", sandbox_id, policy)
        await audit(conn, who, "sandbox.network", sandbox_id,
                    detail={"allow": len(body.allow), "deny": len(body.deny)})
    ctx.relay.kick()
    return effective_policy(policy, row["template_policy"])


async def _template_policy(conn: Any, name: str, *, for_update: bool = False) -> Any:
    row = await conn.fetchrow("SELECT egress_policy FROM templates WHERE name=$1"
                              + (" FOR UPDATE" if for_update else ""), name)
    if row is None:
        raise NotFound(f"template {name!r} does not exist", details={"template": name})
    return row["egress_policy"]


@router.get("/templates/{name}/network", response_model=NetworkInfo)
async def get_template_network(name: str, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """The template's default egress policy (``source`` ``template``, or ``default``: no egress). 404
    ``not_found`` for an unknown template or another tenant's (services/api/template_access.py)."""
    if await template_access.lookup(ctx.pool, ctx, who, name, route="GET /v1/templates/{name}/network") is None:
        raise NotFound(f"template {name!r} does not exist", details={"template": name})
    return effective_policy(None, await _template_policy(ctx.pool, name))


@router.put("/templates/{name}/network", response_model=NetworkInfo)
async def set_template_network(name: str, body: EgressPolicy, ctx: CtxDep, who: PrincipalDep) -> NetworkInfo:
    """Replace the template's default egress policy: it applies to its sandboxes without a policy of their
    own, from their next connection. 404 ``not_found`` for an unknown template; 403 ``forbidden`` unless the
    caller belongs to the operator tenant (``PODBAY_OPERATOR_TENANT``): templates are shared by every tenant,
    so one tenant must not widen another's egress."""
    policy = body.model_dump(mode="json")
    async with ctx.pool.acquire() as conn, conn.transaction():
        tenant = await conn.fetchval("SELECT name FROM tenants WHERE id=$1", who.tenant_id)
        if tenant != ctx.settings.operator_tenant:
            raise Forbidden("only the operator tenant may change a template's egress policy (it applies to every "
                            "tenant); set a policy on your sandboxes instead", details={"template": name})
        # The operator manages shared templates and its own; a tenant's private one is not its to widen.
        if await template_access.lookup(conn, ctx, who, name, route="PUT /v1/templates/{name}/network") is None:
            raise NotFound(f"template {name!r} does not exist", details={"template": name})
        await _template_policy(conn, name, for_update=True)
        await conn.execute("UPDATE templates SET egress_policy=$2 WHERE name=$1", name, policy)
        await audit(conn, who, "template.network", name, detail={"allow": len(body.allow), "deny": len(body.deny)})
    ctx.relay.kick()
    return effective_policy(None, policy)
