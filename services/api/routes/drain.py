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

from fastapi import APIRouter, Depends

from podbay.contracts.api import DrainStarted, NodeUndrained

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import nodes

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.post("/nodes/{node_id}/drain", status_code=202, response_model=DrainStarted)
async def drain_node(node_id: str, ctx: CtxDep, who: PrincipalDep) -> DrainStarted:
    """Move every sandbox off ``node_id`` (running ones by live migration, paused ones paused; ones with
    read-write volumes by suspend and wake) and mark it ``drained``; see the module docstring. 403 ``forbidden`` unless the caller is the operator tenant."""
    return await nodes.drain(ctx, who, node_id)


@router.post("/nodes/{node_id}/undrain", response_model=NodeUndrained)
async def undrain_node(node_id: str, ctx: CtxDep, who: PrincipalDep) -> NodeUndrained:
    """Take ``node_id`` back into placement -> 200 ``{node_id, state: "ready", previous}``; see the module
    docstring. 403 ``forbidden`` unless the caller is the operator tenant, 404 ``not_found``, 409
    ``invalid_state`` for a ``lost`` node or one whose drain still runs (``details.operation_id``)."""
    return await nodes.undrain(ctx, who, node_id)
