"""The create operation: restore a new sandbox from its template's snapshot and record it running.

Written against the registry's interface (:class:`services.nodeagent.vm.vmhost.VmHost`): the registry's
``bring_up`` starts and adopts the VM, fails the sandbox with the reason when a step fails, and records it
running. Idempotent and fenced by generation: a command for another generation or node, or for a sandbox no
longer ``starting``, does nothing.
"""

from __future__ import annotations

import logging

from podbay.contracts.events import EventType
from podbay.contracts.messages import CreateSandboxCmd

from ..vm.vmhost import HostOps

__all__ = ["CreateOps"]

log = logging.getLogger("podbay.nodeagent.create")


class CreateOps(HostOps):
    """Create handlers bound to one node's VMs (a ``VmHost``)."""

    async def create(self, cmd: CreateSandboxCmd) -> None:
        """Restore the template snapshot as sandbox ``cmd.sandbox_id`` and mark it running."""
        m = self.m
        async with m.lock(cmd.sandbox_id):
            row = await m.pool.fetchrow(
                "SELECT state, generation, node_id, disk_mib FROM sandboxes WHERE id = $1", cmd.sandbox_id)
            if row is None or row["node_id"] != m.node_id or row["generation"] != cmd.generation:
                log.info("create %s: stale or unknown (generation %s), skipping", cmd.sandbox_id, cmd.generation)
                return
            if row["state"] != "starting":
                log.info("create %s: already %s, nothing to do", cmd.sandbox_id, row["state"])
                return
            await self.create_locked(cmd, disk_mib=row["disk_mib"])

    async def create_locked(self, cmd: CreateSandboxCmd, *, disk_mib: int | None = None) -> None:
        """The create itself, for a caller that holds the sandbox's lock and found its row ``starting`` at
        ``cmd.generation`` on this node (``create``; reconcile.py for a start a restart interrupted).
        ``disk_mib``: the root disk's size when it is larger than the template's."""
        # ``bring_up`` resolves the build and fails the sandbox with the reason when it is missing.
        await self.m.bring_up(cmd.sandbox_id, cmd.generation, cmd.resources, cmd.hostname, cmd.tenant_id,
                              template=cmd.template, template_digest=cmd.template_digest, snapshot_dir=None,
                              operation_id=cmd.operation_id, event=EventType.STARTED, kind="create",
                              disk_bytes=disk_mib << 20 if disk_mib else None)
