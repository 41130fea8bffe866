"""The node agent's sandboxes: the VM registry with the operation modules wired on top of it.

Layers, lowest first (none imports a layer above it):

- vm/vmm.py (the VMM interface, ``Vmm``, and QEMU's implementation) under vm/vmdriver.py (templates,
  ``VmHandle``);
- ops/registry.py: ``VmRegistry``, the VMs this node runs and the one way to register, watch, tear down and discard
  them; it implements vm/vmhost.py's ``VmHost``;
- the operation modules, each written against ``VmHost`` and none importing another: ops/create.py,
  vm/pause.py (pause, resume, hibernate, renew), ops/delete.py, storage/snapshots.py, ops/suspend.py,
  vm/migrate.py, ops/warm.py;
- this module: :class:`SandboxManager`, a ``VmRegistry`` that builds the create, pause, delete, snapshot,
  suspend and migration operations and the template builder on itself (the object store and the templates are
  constructor arguments, from wiring.py) and is what main.py and the node's loops and routes are handed. Its
  methods only dispatch to the operations, except :meth:`SandboxManager.lease_expired`, which picks between
  two of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg

from podbay import lifecycle
from podbay.bus import Bus
from podbay.config import Settings
from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, SandboxOpCmd
from podbay.lifecycle import Verb
from podbay.outbox import Relay, new_id
from podbay import operation_state

from ..build.builder import TemplateBuilder
from .create import CreateOps
from .delete import DeleteOps
from ..vm.migrate import MigrationOps
from ..net.network import SandboxNetwork
from ..vm.pause import PauseOps
from .registry import VmRegistry
from ..storage.snapshots import SnapshotOps
from ..storage.store import NodeStore
from .suspend import SuspendOps
from ..vm.vmdriver import TemplateImage, VmDriver

if TYPE_CHECKING:
    from collections.abc import Callable

    from podbay.objstore import ObjectStore

    from ..vm.vmhost import RunningVm

__all__ = ["SandboxManager"]


class SandboxManager(VmRegistry):
    """The node's ``VmRegistry`` and the operations on it, all built here: ``creates``, ``pauses``,
    ``deletes``, ``snapshots``, ``migrations`` (answers live migrations into this node once started),
    ``builder`` (template builds on this node) and, given the node's object store, ``suspend_ops``."""

    snapshots: SnapshotOps

    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: Bus, relay: Relay, store: NodeStore,
                 driver: VmDriver, net: SandboxNetwork, *, objects: ObjectStore | None = None,
                 templates: dict[str, TemplateImage] | None = None) -> None:
        """Arguments as :class:`VmRegistry`'s. Without ``objects`` (unit tests) there is no ``suspend_ops``:
        suspend and wake move snapshots through object storage."""
        super().__init__(settings, pool, bus, relay, store, driver, net, objects=objects, templates=templates)
        self.snapshots = SnapshotOps(self)
        self.creates = CreateOps(self)
        self.pauses = PauseOps(self)
        self.deletes = DeleteOps(self)
        self.suspend_ops: SuspendOps
        if objects is not None:
            self.suspend_ops = SuspendOps(self, objects)
        self.migrations = MigrationOps(self)
        self.builder = TemplateBuilder(self)

    async def create(self, cmd: CreateSandboxCmd) -> None:
        """``CreateOps.create``: restore the template snapshot as the sandbox and mark it running."""
        await self.creates.create(cmd)

    async def delete(self, cmd: DeleteSandboxCmd) -> None:
        """``DeleteOps.delete``: stop and remove the sandbox's VM, then mark it deleted."""
        await self.deletes.delete(cmd)

    async def pause(self, cmd: SandboxOpCmd) -> None:
        """``PauseOps.pause``: stop the sandbox's vCPUs and record ``paused``."""
        await self.pauses.pause(cmd)

    async def resume(self, cmd: SandboxOpCmd) -> None:
        """``PauseOps.resume``: continue the sandbox, fix its clock and record ``running``."""
        await self.pauses.resume(cmd)

    async def hibernate(self, sandbox_id: str) -> bool:
        """``PauseOps.hibernate``: release a paused sandbox's RAM; True when it was released."""
        return await self.pauses.hibernate(sandbox_id)

    async def renew_vm(self, sandbox_id: str, why: str, *, still: Callable[[RunningVm], bool] | None = None) -> bool:
        """``PauseOps.renew_vm``: move a live VM into a fresh QEMU on a fresh tap; True when renewed."""
        return await self.pauses.renew_vm(sandbox_id, why, still=still)

    async def lease_expired(self, sandbox_id: str, action: str, *, reason: str = "lease expired") -> None:
        """Apply a lease's action to an idle sandbox: pause it, or delete it (an operation of its own); a pause's
        event carries ``reason`` (``memory pressure`` when services/nodeagent/ops/memory.py makes room)."""
        op_id = new_id("op")
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow("SELECT tenant_id, generation, state FROM sandboxes WHERE id=$1 FOR UPDATE",
                                      sandbox_id)
            if row is None or row["state"] != "running":
                return
            await operation_state.insert(conn, op_id, tenant_id=row["tenant_id"], sandbox_id=sandbox_id, kind=action)
            if action == "delete":
                await lifecycle.apply(conn, sandbox_id, Verb.DELETE, states=row["state"])
        if action == "delete":
            await self.deletes.delete(DeleteSandboxCmd(operation_id=op_id, sandbox_id=sandbox_id,
                                                        generation=row["generation"]))
        else:
            after_pause = None
            if reason == "lease expired":  # E2B's filesystem-only auto-pause: its disk snapshot first, the
                # guest's filesystems kept frozen from it until the pause (E2B #1104)
                after_pause = await self.snapshots.filesystem_pause_point(sandbox_id)
            try:
                await self.pauses.pause_resume(SandboxOpCmd(operation_id=op_id, sandbox_id=sandbox_id,
                                                            generation=row["generation"]), pause=True, reason=reason)
            finally:
                if after_pause is not None:
                    await after_pause()

