"""Drain of a node (issue 8): ``POST /v1/nodes/{id}/drain``.

Only the operator tenant (``PODBAY_OPERATOR_TENANT``) may drain a node: it moves every tenant's sandboxes
(403 ``forbidden`` otherwise). In one transaction the node becomes ``draining`` (placement skips it), a
``drain`` operation (``node_id`` set) and the audit record are written; then ``podbay.cmd.scheduler.drain``
is published and the call answers 202 with the operation id. The scheduler moves the sandboxes
(services/scheduler/drain.py) and ``GET /v1/operations/{id}`` shows ``progress``. A drain of a node that is
already draining answers the drain in progress; of a ``drained`` node, a new drain (nothing may be left);
of an unknown node 404; of a ``lost`` node 409 ``invalid_state`` (its sandboxes are rescheduled, not moved);
of a node with sandboxes that have a volume read-only 409 ``volume_in_use`` (such a volume stays on its node;
sandboxes with read-write volumes move by suspend and wake, services/scheduler/drain.py).

``POST /v1/nodes/{id}/undrain`` takes a ``draining`` or ``drained`` node back into placement (``ready``): after
maintenance, or after a drain that ended ``drain_incomplete`` and left the node ``draining``. Refused (409
``invalid_state``) while its drain still runs, and for a ``lost`` node (it comes back by fencing when its node
agent returns); a ``ready`` node is answered as it is. Operator tenant only, audited as ``node.undrain``.
"""

from __future__ import annotations

from typing import Annotated

import asyncpg

from fastapi import APIRouter, Depends

from podbay.contracts import subjects
from podbay.contracts.api import DrainStarted, NodeUndrained
from podbay.contracts.messages import DrainNodeCmd
from podbay.errors import Forbidden, InvalidState, NotFound
from podbay.outbox import new_id

from .auth import Principal
from .context import ApiContext
from .deps import ctx_dep, principal_dep
from .sandbox_lookup import audit
from .volume_service import refuse_drain_with_volumes

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

_DRAINABLE = ("ready", "draining", "drained")
_RUNNING_DRAIN = ("SELECT id FROM operations WHERE kind='drain' AND node_id=$1 AND state IN ('pending','running')"
                  " ORDER BY created_at DESC LIMIT 1")


async def _require_operator(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, what: str) -> None:
    """403 ``forbidden`` unless the caller belongs to the operator tenant (``PODBAY_OPERATOR_TENANT``, by name,
    as for template policies): nodes are shared by every tenant."""
    if await conn.fetchval("SELECT name FROM tenants WHERE id=$1", who.tenant_id) != ctx.settings.operator_tenant:
        raise Forbidden(f"only the operator tenant may {what}")


@router.post("/nodes/{node_id}/drain", status_code=202, response_model=DrainStarted)
async def drain_node(node_id: str, ctx: CtxDep, who: PrincipalDep) -> DrainStarted:
    """Move every sandbox off ``node_id`` (running ones by live migration, paused ones paused; ones with
    read-write volumes by suspend and wake) and mark it ``drained``; see the module docstring. 403 ``forbidden`` unless the caller is the operator tenant."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        await _require_operator(conn, ctx, who, "drain a node (it moves every tenant's sandboxes)")
        state = await conn.fetchval("SELECT state FROM nodes WHERE id=$1 FOR UPDATE", node_id)
        if state is None:
            raise NotFound(f"node {node_id} does not exist")
        if state not in _DRAINABLE:
            raise InvalidState(f"node {node_id} is {state}", details={"state": state})
        running = await conn.fetchval(_RUNNING_DRAIN, node_id)
        if running is not None:
            return DrainStarted(operation_id=running, node_id=node_id, state="draining")
        await refuse_drain_with_volumes(conn, node_id)
        op_id = new_id("op")
        await conn.execute("INSERT INTO operations (id, tenant_id, kind, state, node_id) VALUES"
                           " ($1,$2,'drain','pending',$3)", op_id, who.tenant_id, node_id)
        await conn.execute("UPDATE nodes SET state='draining' WHERE id=$1", node_id)
        await audit(conn, who, "node.drain", node_id, detail={"operation_id": op_id})
    await ctx.bus.publish_command(subjects.SCHEDULER_DRAIN, DrainNodeCmd(operation_id=op_id, node_id=node_id),
                                  msg_id=op_id)
    return DrainStarted(operation_id=op_id, node_id=node_id, state="draining")


@router.post("/nodes/{node_id}/undrain", response_model=NodeUndrained)
async def undrain_node(node_id: str, ctx: CtxDep, who: PrincipalDep) -> NodeUndrained:
    """Take ``node_id`` back into placement -> 200 ``{node_id, state: "ready", previous}``; see the module
    docstring. 403 ``forbidden`` unless the caller is the operator tenant, 404 ``not_found``, 409
    ``invalid_state`` for a ``lost`` node or one whose drain still runs (``details.operation_id``)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        await _require_operator(conn, ctx, who, "undrain a node (nodes are shared by every tenant)")
        state = await conn.fetchval("SELECT state FROM nodes WHERE id=$1 FOR UPDATE", node_id)
        if state is None:
            raise NotFound(f"node {node_id} does not exist")
        if state == "ready":
            return NodeUndrained(node_id=node_id, state="ready", previous="ready")
        if state not in ("draining", "drained"):
            raise InvalidState(f"node {node_id} is {state}; a lost node becomes ready when its node agent "
                               "returns and is fenced", details={"state": state})
        running = await conn.fetchval(_RUNNING_DRAIN, node_id)
        if running is not None:
            raise InvalidState(f"the drain of node {node_id} still runs (operation {running}); undrain it "
                               "once the drain has ended", details={"state": state, "operation_id": running})
        await conn.execute("UPDATE nodes SET state='ready' WHERE id=$1", node_id)
        await audit(conn, who, "node.undrain", node_id, detail={"previous": state})
    return NodeUndrained(node_id=node_id, state="ready", previous=state)
