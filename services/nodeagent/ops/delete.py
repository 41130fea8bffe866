"""The delete operation: stop and remove a sandbox's VM, its files, network and snapshots, and record it
deleted.

Written against the registry's interface (:class:`services.nodeagent.vm.vmhost.VmHost`). Idempotent: a sandbox
already deleted, unknown, or placed on another node is left alone.
"""

from __future__ import annotations

import asyncio
import logging

from podbay.contracts.events import EventType
from podbay import lifecycle
from podbay.contracts.channel import ExecSpec
from podbay.contracts.messages import DeleteSandboxCmd
from podbay.contracts.states import OperationState
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.telemetry import LIFECYCLE_OPERATIONS

from ..vm.vmhost import HostOps

__all__ = ["DeleteOps"]

log = logging.getLogger("podbay.nodeagent.delete")


class DeleteOps(HostOps):
    """Delete handlers bound to one node's VMs (a ``VmHost``)."""

    async def delete(self, cmd: DeleteSandboxCmd) -> None:
        """Stop and remove the sandbox's VM, then mark it deleted (idempotent)."""
        m = self.m
        async with m.lock(cmd.sandbox_id):
            row = await m.pool.fetchrow(
                "SELECT state, node_id, tenant_id, generation FROM sandboxes WHERE id = $1", cmd.sandbox_id)
            if row is None or row["state"] == "deleted" or row["node_id"] != m.node_id:
                return
            await self._sync_volumes(cmd.sandbox_id)
            await m.stop_vm(cmd.sandbox_id)
            await m.discard_vm_dir(m.store.sandbox_dir(cmd.sandbox_id))
            await m.release_net(cmd.sandbox_id)
            await m.snapshots.discard(cmd.sandbox_id)
            async with m.pool.acquire() as conn, conn.transaction():
                await lifecycle.apply(
                    conn, cmd.sandbox_id, Verb.DELETED, states=lifecycle.sources(Verb.DELETED),
                    operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED, always=True),
                    event=SandboxEvent(EventType.DELETED, node_id=m.node_id, tenant_id=row["tenant_id"],
                                       generation=row["generation"]))
            m.relay.kick()
            LIFECYCLE_OPERATIONS.labels("nodeagent", "delete", "ok").inc()
            m.forget_lock(cmd.sandbox_id)

    async def _sync_volumes(self, sandbox_id: str) -> None:
        """Have a running guest with read-write volumes write its dirty pages back (``sync``) before its VM is
        killed: a volume outlives its sandbox (a later sandbox mounts it), and a kill drops what the guest's
        page cache held. Best effort: a guest that does not answer within 15 s is killed all the same."""
        vm = self.m.vms.get(sandbox_id)
        if vm is None or vm.channel is None or vm.paused_at is not None:
            return
        if not await self.m.pool.fetchval(
                "SELECT true FROM sandbox_volumes WHERE sandbox_id=$1 AND NOT readonly LIMIT 1", sandbox_id):
            return
        try:
            await asyncio.wait_for(vm.channel.run(ExecSpec(argv=["sync"], timeout_s=10)), 15)
        except Exception as exc:  # noqa: BLE001 - the delete goes on; the guest's unsynced writes are lost
            log.warning("sync of %s's volumes before delete failed: %s", sandbox_id, exc)
