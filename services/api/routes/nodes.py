"""Node endpoints: the operator's view of the nodes (docs/ARCHITECTURE.md "Nodes, loss and fencing").

``GET /v1/nodes`` joins three sources: the ``nodes`` rows (state, capacity, accelerator), the live heartbeats
in the ``podbay_nodes`` KV bucket (liveness, age), and the sandboxes and warm slots placed on each node in
PostgreSQL (used and free resources, counts), counted the way the scheduler counts them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends

from podbay.contracts.api import NodeInfo, NodeList, NodeMemory, NodeResources
from podbay.contracts.messages import NodeHeartbeat
from podbay.contracts.states import NodeState
from podbay.errors import Forbidden

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import nodes as nodes_service

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

def _memory(hb: NodeHeartbeat | None) -> NodeMemory | None:
    """The measured memory a live node's heartbeat carries (None when absent or not measured)."""
    room = hb.memory_room_mib() if hb is not None else None
    if hb is None or room is None or hb.memory_available_mib is None or hb.memory_sandboxes_mib is None:
        return None
    return NodeMemory(available_mib=hb.memory_available_mib, sandboxes_mib=hb.memory_sandboxes_mib,
                      reclaimable_mib=hb.memory_reclaimable_mib, sandbox_cost_mib=hb.memory_sandbox_cost_mib,
                      limit_mib=hb.memory_limit_mib, headroom_mib=hb.memory_headroom_mib, room_mib=room,
                      measured_at=hb.memory_measured_at)


@router.get("/nodes", response_model=NodeList)
async def list_nodes(ctx: CtxDep, who: PrincipalDep) -> NodeList:
    """Every node: state (``ready``, ``draining``, ``drained``, ``lost``), liveness and heartbeat age,
    nominal capacity, used and free resources, measured memory (``memory``), running and paused sandboxes, ready warm slots, and whether the
    scheduler places new sandboxes there. 403 ``forbidden`` unless the caller belongs to the operator tenant
    (``PODBAY_OPERATOR_TENANT``): nodes are shared by every tenant."""
    if not await nodes_service.is_operator_tenant(ctx.pool, ctx.settings, who.tenant_id):
        raise Forbidden("only the operator tenant may list nodes (they are shared by every tenant)")
    heartbeats = {hb.node_id: hb for hb in await ctx.bus.live_nodes()}
    async with ctx.pool.acquire() as conn:
        rows, loads, drains = await nodes_service.overview(conn)
    now = datetime.now(UTC)
    nodes = []
    for r in rows:
        hb = heartbeats.get(r["id"])
        load = loads.get(r["id"])
        mem_used, cpu_used = (int(load["mem"]), int(load["cpu"])) if load else (0, 0)
        live = hb is not None
        nodes.append(NodeInfo(
            id=r["id"], state=r["state"], live=live,
            schedulable=live and r["state"] == NodeState.READY and bool(hb and hb.schedulable),
            accel=r["accel"], dataplane_url=r["dataplane_url"],
            capacity=NodeResources(memory_mib=r["memory_mib"], vcpus=r["vcpus"]),
            used=NodeResources(memory_mib=mem_used, vcpus=cpu_used),
            free=NodeResources(memory_mib=r["memory_mib"] - mem_used, vcpus=r["vcpus"] - cpu_used),
            running=int(load["running"]) if load else 0, paused=int(load["paused"]) if load else 0,
            sandboxes=int(load["sandboxes"]) if load else 0, warm_slots=int(load["warm"]) if load else 0,
            heartbeat_age_s=round(max(0.0, (now - hb.at).total_seconds()), 3) if hb else None,
            memory=_memory(hb),
            started_at=r["started_at"], state_changed_at=r.get("state_changed_at"), lost_at=r.get("lost_at"),
            drain_operation_id=drains.get(r["id"])))
    return NodeList(nodes=nodes)
