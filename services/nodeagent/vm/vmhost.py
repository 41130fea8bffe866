"""The VMs a node agent runs, and what its operation modules may ask of the registry that owns them.

:class:`RunningVm` and :class:`HibernatedVm` are the registry's entries. :class:`VmHost` is the interface the
operation modules (create.py, pause.py, delete.py, migrate.py, snapshots.py, suspend.py, warm.py) are written
against: the node's shared parts and the registry's public methods. :class:`services.nodeagent.ops.registry.VmRegistry`
implements it (services/nodeagent/ops/sandboxes.py wires the operations on top of it); a module that takes a
``VmHost`` imports this module, not the registry's implementation, so the operation modules need none of each
other, and a unit test can hand them a fake.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncpg

    from podbay.bus import Bus
    from podbay.channel.client import GuestChannel
    from podbay.config import Settings
    from podbay.contracts.channel import GuestNet
    from podbay.contracts.egress import NetBinding
    from podbay.contracts.events import EventType
    from podbay.contracts.messages import Resources
    from podbay.outbox import Relay

    from ..net.network import SandboxNetwork
    from ..storage.store import NodeStore
    from .vmdriver import TemplateImage, VmDriver, VmHandle
    from ..storage.volumes import VolumeStore

__all__ = ["RunningVm", "HibernatedVm", "Snapshots", "VmHost", "HostOps"]


@dataclass
class RunningVm:
    """A sandbox VM this agent runs or re-attached to."""

    sandbox_id: str
    generation: int
    resources: Resources
    handle: VmHandle
    channel: GuestChannel | None
    stopping: bool = False
    paused_at: float | None = None
    monitor: asyncio.Task[None] | None = field(default=None, repr=False)
    #: network settings (a new sandbox CA) the guest has not been given yet; sent with the next resume
    net_pending: GuestNet | None = None


@dataclass
class HibernatedVm:
    """A paused sandbox whose QEMU exited after writing its state to ``vm_dir/hib`` (RAM released)."""

    sandbox_id: str
    generation: int
    resources: Resources


class Snapshots(Protocol):
    """What another operation module may ask of the node's snapshot handlers (services/nodeagent/storage/snapshots.py
    implements it); a suspend takes its full snapshot through it, a delete discards them through it."""

    async def take(self, sandbox_id: str, generation: int, snapshot_id: str, kind: str) -> str | None:
        """Take snapshot ``snapshot_id`` (its row ``creating``; the caller holds the sandbox's lock): an error
        message, or None once it is ``ready``."""
        ...

    async def discard(self, sandbox_id: str) -> None:
        """Remove a deleted sandbox's snapshot files and mark its snapshots deleted (pinned promoted ones
        stay)."""
        ...


class VmHost(Protocol):
    """The node's VMs and shared parts, as an operation module sees them (``VmRegistry`` implements it)."""

    settings: Settings
    pool: asyncpg.Pool
    bus: Bus
    relay: Relay
    store: NodeStore
    driver: VmDriver
    net: SandboxNetwork
    #: running (or stopped in memory) VMs by sandbox id
    vms: dict[str, RunningVm]
    #: paused sandboxes whose RAM was released, by sandbox id
    hibernated: dict[str, HibernatedVm]
    #: the current build of each template on this node, by name (what new sandboxes and warm slots start from)
    templates: dict[str, TemplateImage]
    volumes: VolumeStore

    @property
    def snapshots(self) -> Snapshots: ...

    @property
    def node_id(self) -> str: ...

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """The sandbox's lock: every operation on one sandbox holds it."""
        ...

    def forget_lock(self, sandbox_id: str) -> None:
        """Drop the lock of a sandbox that is gone from this node for good (deleted)."""
        ...

    async def template(self, name: str, digest: str) -> TemplateImage:
        """The build ``digest`` of template ``name`` (``NotFound`` when no store holds it)."""
        ...

    def guest_net(self, binding: NetBinding) -> GuestNet:
        """What ``after_restore.net`` tells a guest about its network and CAs."""
        ...

    def adopt(self, sandbox_id: str, generation: int, resources: Resources, handle: VmHandle,
              channel: GuestChannel | None, *, paused_at: float | None = None,
              net_pending: GuestNet | None = None) -> RunningVm:
        """Register a VM that runs on this node and watch it (the one way into ``vms``)."""
        ...

    async def bring_up(self, sandbox_id: str, generation: int, resources: Resources, hostname: str, tenant_id: str,
                       *, template: str, template_digest: str, snapshot_dir: Path | None, operation_id: str,
                       event: EventType, kind: str, boot_disk: Path | None = None, data: dict[str, object] | None = None,
                       from_state: str = "starting", disk_bytes: int | None = None) -> bool:
        """Start the sandbox's VM from a snapshot (or ``boot_disk``), run the after-restore hygiene, record it
        running with ``event`` and adopt it; on failure the sandbox is failed. True when it runs."""
        ...

    async def mark_failed(self, sandbox_id: str, generation: int, reason: str, *, operation_id: str | None = None,
                          from_states: tuple[str, ...] = ("starting", "running", "paused")) -> None:
        """Record the sandbox ``failed`` with ``reason`` (fenced by ``from_states`` and ``generation``)."""
        ...

    async def continue_vm(self, vm: RunningVm) -> None:
        """Let a stopped VM run, connect its channel if it has none, and give the guest the time and any
        pending network settings."""
        ...

    async def wake_hibernated(self, sandbox_id: str) -> None:
        """Restore a hibernated sandbox, still paused, into ``vms`` (caller holds the lock)."""
        ...

    async def stop_vm(self, sandbox_id: str) -> None:
        """Take the sandbox's VM out of the registry and kill it."""
        ...

    async def teardown(self, handle: VmHandle | None, channel: GuestChannel | None, vm_dir: Path | None) -> None:
        """Close a channel, kill a QEMU and discard a VM directory, each when given (best effort)."""
        ...

    async def discard_vm_dir(self, vm_dir: Path) -> None:
        """Kill what still runs for ``vm_dir`` and remove the directory."""
        ...

    async def release_net(self, sandbox_id: str) -> None:
        """Release the sandbox's address, tap, binding and CA files."""
        ...

    async def finish_op(self, operation_id: str, error: str | None) -> None:
        """Record an operation's outcome (``error`` None: succeeded) and send its notice."""
        ...

    async def notify_op(self, operation_id: str, error: str | None) -> None:
        """Send an operation's notice (the row is already written)."""
        ...


class HostOps:
    """The base of an operation module's handlers: ``self.m`` is the node's :class:`VmHost` they act on."""

    def __init__(self, host: VmHost) -> None:
        self.m = host
