"""Nodes as the operator sees them, and their drain (issue 8): the named queries of ``GET /v1/nodes``
(services/api/routes/nodes.py) and the drain and undrain of a node (services/api/routes/drain.py's routes; what
a drain does: that module's docstring). Only the operator tenant (``PODBAY_OPERATOR_TENANT``, by name) may call
them: nodes are shared by every tenant. The scheduler moves a draining node's sandboxes
(services/scheduler/drain.py); operations rows are podbay.operation_state's.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from podbay.config import Settings
from podbay.contracts import subjects
from podbay.contracts.api import DrainStarted, NodeUndrained
from podbay.contracts.messages import DrainNodeCmd
from podbay.contracts.states import NodeState, OperationState, SandboxState, WarmSlotState
from podbay.errors import Forbidden, InvalidState, NotFound
from podbay.outbox import new_id
from podbay import operation_state

from ..core.auth import Principal
from ..core.context import ApiContext
from .sandbox_lookup import audit
from .volume_service import refuse_drain_with_volumes

__all__ = ["tenant_name", "is_operator_tenant", "overview", "drain", "undrain"]

S, W = SandboxState, WarmSlotState

#: Per node: memory of every placed sandbox that is not deleted or failed plus warm slots being prepared or
#: ready (the scheduler's count), vCPUs of those not paused, and the counts by state.
_LOAD = (  # S, W: the sandbox and warm slot states
    "SELECT node_id, sum(mem)::int AS mem, sum(cpu)::int AS cpu, sum(run)::int AS running,"
    " sum(paused)::int AS paused, sum(sbx)::int AS sandboxes, sum(warm)::int AS warm FROM ("
    f" SELECT node_id, memory_mib AS mem, CASE WHEN state <> '{S.PAUSED}' THEN vcpus ELSE 0 END AS cpu,"
    f" (state IN ('{S.RUNNING}', '{S.STARTING}', '{S.RESUMING}'))::int AS run, (state = '{S.PAUSED}')::int AS paused,"
    f" 1 AS sbx, 0 AS warm FROM sandboxes WHERE node_id IS NOT NULL AND state NOT IN ('{S.DELETED}', '{S.FAILED}')"
    f" UNION ALL SELECT node_id, memory_mib, 0, 0, 0, 0, (state = '{W.READY}')::int FROM warm_slots"
    f" WHERE state IN ('{W.PREPARING}', '{W.READY}')"
    ") l GROUP BY node_id")


async def tenant_name(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> str | None:
    """The name of tenant ``tenant_id``, or None when there is no such tenant."""
    name: str | None = await conn.fetchval("SELECT name FROM tenants WHERE id=$1", tenant_id)
    return name


async def is_operator_tenant(conn: asyncpg.Connection | asyncpg.Pool, settings: Settings, tenant_id: str) -> bool:
    """Whether tenant ``tenant_id`` is the operator tenant (``PODBAY_OPERATOR_TENANT``, by name)."""
    return bool(await tenant_name(conn, tenant_id) == settings.operator_tenant)


async def overview(conn: asyncpg.Connection) -> tuple[list[asyncpg.Record], dict[str, Any], dict[str, str]]:
    """``(rows, loads, drains)``: every ``nodes`` row by id; per node id its load (``mem``, ``cpu``, ``running``,
    ``paused``, ``sandboxes``, ``warm``: counted as the scheduler counts); per node id its newest drain
    operation's id, so that a page opened mid-drain can follow its progress."""
    rows = list(await conn.fetch("SELECT * FROM nodes ORDER BY id"))
    loads = {r["node_id"]: r for r in await conn.fetch(_LOAD)}
    drains = {r["node_id"]: r["id"] for r in await conn.fetch(
        "SELECT DISTINCT ON (node_id) node_id, id FROM operations WHERE kind='drain' AND node_id IS NOT NULL"
        " ORDER BY node_id, created_at DESC, id DESC")}
    return rows, loads, drains


_DRAINABLE = (NodeState.READY, NodeState.DRAINING, NodeState.DRAINED)
_RUNNING_DRAIN = ("SELECT id FROM operations WHERE kind='drain' AND node_id=$1"
                  f" AND state IN ('{OperationState.PENDING}','{OperationState.RUNNING}')"
                  " ORDER BY created_at DESC LIMIT 1")


async def _require_operator(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, what: str) -> None:
    """403 ``forbidden`` unless the caller belongs to the operator tenant (``PODBAY_OPERATOR_TENANT``, by name,
    as for template policies): nodes are shared by every tenant."""
    if not await is_operator_tenant(conn, ctx.settings, who.tenant_id):
        raise Forbidden(f"only the operator tenant may {what}")


async def drain(ctx: ApiContext, who: Principal, node_id: str) -> DrainStarted:
    """Start the drain of ``node_id`` (or answer the one in progress). Raises Forbidden (not the operator
    tenant), NotFound, InvalidState (a ``lost`` node), VolumeInUse (read-only volumes on it)."""
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
        await operation_state.insert(conn, op_id, tenant_id=who.tenant_id, kind="drain", node_id=node_id)
        await conn.execute("UPDATE nodes SET state=$2 WHERE id=$1", node_id, NodeState.DRAINING)
        await audit(conn, who, "node.drain", node_id, detail={"operation_id": op_id})
    await ctx.bus.publish_command(subjects.SCHEDULER_DRAIN, DrainNodeCmd(operation_id=op_id, node_id=node_id),
                                  msg_id=op_id)
    return DrainStarted(operation_id=op_id, node_id=node_id, state="draining")


async def undrain(ctx: ApiContext, who: Principal, node_id: str) -> NodeUndrained:
    """Take ``node_id`` back into placement. Raises Forbidden (not the operator tenant), NotFound,
    InvalidState (a ``lost`` node, or one whose drain still runs: ``details.operation_id``)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        await _require_operator(conn, ctx, who, "undrain a node (nodes are shared by every tenant)")
        state = await conn.fetchval("SELECT state FROM nodes WHERE id=$1 FOR UPDATE", node_id)
        if state is None:
            raise NotFound(f"node {node_id} does not exist")
        if state == NodeState.READY:
            return NodeUndrained(node_id=node_id, state="ready", previous="ready")
        if state not in (NodeState.DRAINING, NodeState.DRAINED):
            raise InvalidState(f"node {node_id} is {state}; a lost node becomes ready when its node agent "
                               "returns and is fenced", details={"state": state})
        running = await conn.fetchval(_RUNNING_DRAIN, node_id)
        if running is not None:
            raise InvalidState(f"the drain of node {node_id} still runs (operation {running}); undrain it "
                               "once the drain has ended", details={"state": state, "operation_id": running})
        await conn.execute("UPDATE nodes SET state=$2 WHERE id=$1", node_id, NodeState.READY)
        await audit(conn, who, "node.undrain", node_id, detail={"previous": state})
    return NodeUndrained(node_id=node_id, state="ready", previous=state)
