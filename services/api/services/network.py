"""Egress policy as a service (docs/DESIGN.md §6, docs/egress.md): a sandbox's own policy
(``sandboxes.egress_policy``) over its template's (``templates.egress_policy``) over the default (no egress);
the gateway enforces it. ``/v1/sandboxes/{id}/network`` and ``/v1/templates/{name}/network``
(services/api/routes/network.py) and E2B's network options (services/api/e2b/network.py) call it.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from podbay import template_state
from podbay.contracts.access import NetworkInfo
from podbay.contracts.egress import EgressPolicy
from podbay.contracts.states import SandboxState
from podbay.errors import InvalidState, NotFound

from ..core.auth import Principal
from ..core.context import ApiContext
from .sandbox_lookup import audit

__all__ = ["effective_policy", "sandbox_policy", "set_sandbox_policy", "template_policy", "set_template_policy"]


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


async def sandbox_policy(pool: asyncpg.Pool, tenant_id: str, sandbox_id: str) -> NetworkInfo:
    """The tenant's sandbox's effective policy and its source. NotFound (none, or another tenant's)."""
    row = await _sandbox_row(pool, tenant_id, sandbox_id)
    return effective_policy(row["egress_policy"], row["template_policy"])


async def set_sandbox_policy(ctx: ApiContext, who: Principal, sandbox_id: str, body: EgressPolicy) -> NetworkInfo:
    """Replace the caller's sandbox's own policy (audited ``sandbox.network``); the effective policy after.
    NotFound (none, or another tenant's), InvalidState (deleting or deleted)."""
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


async def template_policy(conn: Any, name: str, *, for_update: bool = False) -> Any:
    """Template key ``name``'s own policy (JSON or None); ``for_update`` locks its row. NotFound when absent."""
    row = await conn.fetchrow("SELECT egress_policy FROM templates WHERE name=$1"
                              + (" FOR UPDATE" if for_update else ""), name)
    if row is None:
        raise NotFound(f"template {name!r} does not exist", details={"template": name})
    return row["egress_policy"]


async def set_template_policy(conn: asyncpg.Connection, name: str, policy: Any) -> None:
    """Replace template key ``name``'s default policy (JSON), its row locked first. NotFound when absent."""
    await template_policy(conn, name, for_update=True)
    await template_state.set_egress_policy(conn, name, policy)
