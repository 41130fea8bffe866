"""Fencing on the node side: a VM whose sandbox has moved on is stopped, never resumed (docs/ARCHITECTURE.md
"Nodes, loss and fencing").

When this node was declared lost (its heartbeat stayed away past ``PODBAY_NODE_LOST_GRACE_S``), the scheduler
cleared its sandboxes' node and raised their generation, and restored them elsewhere. This node may still run
their old QEMUs: after a partition (the agent ran on) or after a restart (the QEMUs outlived the agent). Its
copies must go. At start, :func:`services.nodeagent.ops.reconcile.reconcile` already removes every VM directory
that no row on this node claims (killing its QEMU); while running, :func:`fence_sweep` checks every VM it
holds every ``PODBAY_NODE_FENCE_CHECK_S`` seconds. :func:`rejoin` marks a ``lost`` node ``ready`` again, only
after such a sweep.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from podbay.contracts.states import NodeState
from podbay.service import run_every

if TYPE_CHECKING:
    from .sandboxes import SandboxManager

__all__ = ["fence_sweep", "rejoin", "fence_loop"]

log = logging.getLogger("podbay.nodeagent.fence")


def stale(node_id: str, generation: int, row_node: str | None, row_generation: int | None) -> bool:
    """Whether a VM this node holds at ``generation`` is no longer its own: the row is gone, names another
    node (or none), or carries a higher generation."""
    return row_node != node_id or row_generation is None or row_generation > generation


async def fence_sweep(mgr: SandboxManager) -> list[str]:
    """Stop and remove every VM (running or hibernated) of this node whose sandbox row says it is stale
    (:func:`stale`); returns their ids. Each is checked again under its lock, so an operation in flight on
    it finishes first."""
    held = {**{s: v.generation for s, v in mgr.hibernated.items()}, **{s: v.generation for s, v in mgr.vms.items()}}
    if not held:
        return []
    rows = {r["id"]: r for r in await mgr.pool.fetch(
        "SELECT id, node_id, generation FROM sandboxes WHERE id = ANY($1::text[])", list(held))}
    stopped = []
    for sid, gen in held.items():
        r = rows.get(sid)
        if not stale(mgr.node_id, gen, r["node_id"] if r else None, r["generation"] if r else None):
            continue
        async with mgr.lock(sid):
            vm = mgr.vms.get(sid) or mgr.hibernated.get(sid)
            if vm is None:
                continue
            r = await mgr.pool.fetchrow("SELECT node_id, generation FROM sandboxes WHERE id=$1", sid)
            if not stale(mgr.node_id, vm.generation, r["node_id"] if r else None, r["generation"] if r else None):
                continue
            log.warning("sandbox %s moved on (now node %s, generation %s; ours %s): stopping our copy", sid,
                        r["node_id"] if r else None, r["generation"] if r else None, vm.generation)
            await mgr.stop_vm(sid)
            await mgr.discard_vm_dir(mgr.store.sandbox_dir(sid))
            await mgr.release_net(sid)
            stopped.append(sid)
    return stopped


async def rejoin(mgr: SandboxManager) -> bool:
    """If this node is ``lost``: sweep (:func:`fence_sweep`), then mark it ``ready``; returns True when it did."""
    state = await mgr.pool.fetchval("SELECT state FROM nodes WHERE id=$1", mgr.node_id)
    if state != NodeState.LOST:
        return False
    await fence_sweep(mgr)
    done = await mgr.pool.fetchval(
        "UPDATE nodes SET state=$2, lost_at=NULL, state_changed_at=now() WHERE id=$1 AND state=$3"
        " RETURNING id", mgr.node_id, NodeState.READY, NodeState.LOST)
    if done:
        log.warning("node %s was declared lost; its stale VMs are gone and it is ready again", mgr.node_id)
    return bool(done)


async def fence_loop(mgr: SandboxManager, stop: asyncio.Event) -> None:
    """:func:`fence_sweep` and :func:`rejoin` every ``node_fence_check_s`` until ``stop``."""

    async def step() -> None:
        await fence_sweep(mgr)
        await rejoin(mgr)

    await run_every(stop, mgr.settings.node_fence_check_s, step, log, "fence sweep failed; retrying")
