"""JetStream command and event payloads (docs/DESIGN.md §4).

Every id a command carries (sandbox, snapshot, operation, tenant, node, template build digest) is a
:data:`~podbay.naming.SafeId`: nodes and the snapshotter join them into host paths and object keys, so a
message with ``..`` or a slash in one is refused when it is read.

Commands travel on the ``PODBAY_CMD`` work-queue stream with the operation id as ``Nats-Msg-Id``, so a
duplicate publish is dropped by the server and a redelivery is recognised by the handler.
Events travel on ``PODBAY_EVT``; each is written to the outbox in the transaction of its state change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Literal, TypedDict, cast, get_args

from pydantic import BaseModel, ConfigDict, Field

from podbay.contracts.ids import SafeId
from podbay.contracts.events import EventType  # re-exported: the one list of sandbox event types

__all__ = [
    "PlaceSandbox",
    "CreateSandboxCmd",
    "DeleteSandboxCmd",
    "SandboxOpCmd",
    "OperationDone",
    "SnapshotCmd",
    "RestoreCmd",
    "ForkChild",
    "ForkCmd",
    "NodeHeartbeat",
    "PromoteCmd",
    "WakeCmd",
    "WarmClaim",
    "WarmClaimReply",
    "Event",
    "EventType",
    "DrainNodeCmd",
    "MigrateOutCmd",
    "MigratePrepare",
    "MigratePrepareReply",
    "MigrateFinish",
    "MigrateFinishReply",
    "NodeVerb",
    "NodeCommand",
    "NODE_COMMANDS",
    "NodeHandlers",
    "UnknownNodeCommand",
    "dispatch_node_command",
]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Msg):
    memory_mib: int = Field(ge=64, le=65536)
    vcpus: int = Field(ge=1, le=64)


class PlaceSandbox(_Msg):
    """``podbay.cmd.scheduler.place``: choose a node for a pending sandbox and hand it over."""

    operation_id: SafeId
    sandbox_id: SafeId
    tenant_id: SafeId
    template: str
    resources: Resources
    wake: bool = False
    """True: the sandbox is ``resuming`` from its promoted snapshot (send ``wake``, not ``create``)."""
    fallback: bool = False


class CreateSandboxCmd(_Msg):
    """``podbay.cmd.node.<node>.create``: restore the template snapshot as this sandbox."""

    operation_id: SafeId
    sandbox_id: SafeId
    tenant_id: SafeId
    template: str
    template_digest: SafeId
    generation: int = Field(ge=1)
    resources: Resources
    hostname: str


class DeleteSandboxCmd(_Msg):
    """``podbay.cmd.node.<node>.delete``: stop the VM and remove its files."""

    operation_id: SafeId
    sandbox_id: SafeId
    generation: int = Field(ge=0)


class SandboxOpCmd(_Msg):
    """``podbay.cmd.node.<node>.<verb>`` for ``pause`` and ``resume``: act on the sandbox at ``generation``."""

    operation_id: SafeId
    sandbox_id: SafeId
    generation: int = Field(ge=1)


class _SnapshotOp(_Msg):
    """What a command about one snapshot of a sandbox carries first: the operation, the sandbox at
    ``generation``, the snapshot."""

    operation_id: SafeId
    sandbox_id: SafeId
    generation: int = Field(ge=1)
    snapshot_id: SafeId


class SnapshotCmd(_SnapshotOp):
    """``podbay.cmd.node.<node>.snapshot``: take snapshot ``snapshot_id`` (its row exists, ``creating``)."""

    kind: Literal["disk", "full"]


class RestoreCmd(_SnapshotOp):
    """``podbay.cmd.node.<node>.restore``: roll the sandbox back to ``snapshot_id`` at the new ``generation``;
    with ``volumes`` its read-write volumes too, to their copies in that full snapshot."""

    volumes: bool = False


class ForkChild(_Msg):
    sandbox_id: SafeId
    hostname: str


class ForkCmd(_SnapshotOp):
    """``podbay.cmd.node.<node>.fork``: take ``snapshot_id`` first when ``take_snapshot``, then start each child
    from it (each child row exists, ``starting``, generation 1)."""

    take_snapshot: bool
    children: list[ForkChild] = Field(min_length=1, max_length=100)


class PromoteCmd(_Msg):
    """``podbay.cmd.snapshotter.<node>.promote``: promote ready snapshot ``snapshot_id`` (files on that node).

    ``Nats-Msg-Id`` is ``promote.<snapshot id>``; the outcome is the row's ``promotion`` column."""

    snapshot_id: SafeId
    sandbox_id: SafeId
    reason: Literal["suspend", "cadence", "request"] = "request"


class WakeCmd(_SnapshotOp):
    """``podbay.cmd.node.<node>.wake``: fetch promoted ``snapshot_id`` and restore the ``resuming`` sandbox
    from it at ``generation``; with ``fallback``, an older intact promoted full snapshot when it is corrupt."""

    fallback: bool = False


class OperationDone(_Msg):
    """Body of the ``podbay.ops.<id>`` notice."""

    operation_id: SafeId
    state: Literal["succeeded", "failed"]
    error: str | None = None


class WarmClaim(_Msg):
    """Request on ``podbay.warm.<node>.claim``: the API claimed warm slot ``sandbox_id`` (slot id = sandbox
    id) and recorded the sandbox ``starting`` at ``generation``; the node resumes the slot, runs the
    after-restore hygiene and records it ``running``."""

    operation_id: SafeId
    sandbox_id: SafeId
    tenant_id: SafeId
    generation: int = Field(ge=1)
    hostname: str


class WarmClaimReply(_Msg):
    """Answer to ``WarmClaim``. ``ok`` False: the slot was not usable (gone, failed its health check, or the
    sandbox moved on); it is discarded and the caller falls back to a restore. ``hops_ms``: time per hop
    on the node (``qemu_cont``, ``guest_hygiene``, ``db``), for logs and the benchmark's breakdown."""

    ok: bool
    error: str | None = None
    hops_ms: dict[str, float] = Field(default_factory=dict)
    #: ``updated_at`` of the sandbox row after the node's commit (so the API need not read it back).
    updated_at: datetime | None = None


class NodeHeartbeat(_Msg):
    """Value of a node's key in the ``podbay_nodes`` KV bucket; refreshed every ``node_heartbeat_s``."""

    node_id: SafeId
    dataplane_url: str
    memory_mib: int
    memory_used_mib: int
    vcpus: int
    vcpus_used: int
    sandboxes: int
    templates: list[str]
    accel: str
    schedulable: bool = True
    at: datetime
    # Measured memory (libs/podbay/vmmem.py), MiB; None from nodes that do not measure (placement then falls
    # back to the nominal rule). ``memory_available_mib``: the host's MemAvailable less mapped file pages
    # (touched guest RAM, which MemAvailable counts as cache). ``memory_sandboxes_mib``: what its sandbox VMs
    # (and warm slots) cost, a released paused sandbox 0.
    # ``memory_reclaimable_mib``: what releasing its paused sandboxes and its idle running ones that may be
    # paused would free. ``memory_sandbox_cost_mib``: the median cost of its running sandboxes (None before
    # one runs). ``memory_limit_mib``: NODE_MEMORY_MIB when set (a cap on ``memory_sandboxes_mib``).
    # ``memory_headroom_mib``: what it keeps free. ``memory_measured_at``: when the figures were taken.
    memory_available_mib: int | None = None
    memory_sandboxes_mib: int | None = None
    memory_reclaimable_mib: int = 0
    memory_sandbox_cost_mib: int | None = None
    memory_limit_mib: int | None = None
    memory_headroom_mib: int = 0
    memory_measured_at: datetime | None = None
    # CPU pressure (/proc/pressure/cpu ``some avg10``, percent; None without PSI) and whether the node is above
    # its ``node_cpu_pressure_max`` (10 s and 60 s figures both): placement then passes it by.
    cpu_pressure: float | None = None
    cpu_saturated: bool = False

    @property
    def measures_memory(self) -> bool:
        """Whether this heartbeat carries measured memory (placement then admits by it)."""
        return self.memory_available_mib is not None and self.memory_sandboxes_mib is not None

    def memory_room_mib(self, *, with_reclaimable: bool = True) -> int | None:
        """Room for new sandboxes, MiB: available less headroom (and, under a limit, the limit less what the
        sandboxes use), plus what the node could release when ``with_reclaimable``. May be negative; None when
        the node does not measure. The one rule placement (services/scheduler/placement.py) and
        ``GET /v1/nodes`` use."""
        if self.memory_available_mib is None or self.memory_sandboxes_mib is None:
            return None
        room = self.memory_available_mib - self.memory_headroom_mib
        if self.memory_limit_mib is not None:
            room = min(room, self.memory_limit_mib - self.memory_sandboxes_mib)
        return room + (self.memory_reclaimable_mib if with_reclaimable else 0)


class Event(_Msg):
    """A lifecycle event on ``podbay.evt.sandbox.<id>.<type>``; ``seq`` orders one sandbox's events."""

    id: str
    type: str
    sandbox_id: str | None = None
    node_id: str | None = None
    tenant_id: str | None = None
    generation: int | None = None
    state: str | None = None
    reason: str | None = None
    at: datetime
    data: dict[str, Any] = Field(default_factory=dict)


# ------------------------------------------------------------------------------------ drain and migration


class DrainNodeCmd(_Msg):
    """``podbay.cmd.scheduler.drain``: move every sandbox off ``node_id`` (already ``draining``), then mark it
    ``drained``; progress and outcome go to operation ``operation_id``."""

    operation_id: SafeId
    node_id: SafeId


class MigrateOutCmd(_Msg):
    """``podbay.cmd.node.<source>.migrate_out``: live-migrate sandbox ``sandbox_id`` (at ``generation`` on the
    source) to node ``dest_node``; the outcome is operation ``operation_id`` (``data``: downtime and times)."""

    operation_id: SafeId
    sandbox_id: SafeId
    generation: int = Field(ge=1)
    dest_node: SafeId


class MigratePrepare(_Msg):
    """Request on ``podbay.migrate.<dest>.prepare`` (core NATS, from the source node agent): start a QEMU
    waiting for the sandbox's migration stream and listen for one connection. The destination takes the
    sandbox at ``generation + 1`` once the stream arrived and the source confirmed (``MigrateFinish``)."""

    operation_id: SafeId
    sandbox_id: SafeId
    tenant_id: SafeId
    source_node: SafeId
    generation: int = Field(ge=1)
    template: str
    template_digest: SafeId
    resources: Resources
    hostname: str
    disk_size: int = Field(gt=0, description="Bytes of the source's disk.img.")


class MigratePrepareReply(_Msg):
    """Answer to ``MigratePrepare``: connect to ``host``:``port`` and send ``token`` (32 bytes, hex) first."""

    ok: bool
    error: str | None = None
    host: str = ""
    port: int = 0
    token: str = ""


class MigrateFinish(_Msg):
    """Request on ``podbay.migrate.<dest>.finish``: the source's outgoing migration ended (``ok``) with these
    figures; the destination waits for its side, runs the after-arrival hygiene and commits the move
    (``node_id`` = dest, generation + 1, event ``migrated``). ``ok`` False: tear the destination down."""

    operation_id: SafeId
    sandbox_id: SafeId
    generation: int = Field(ge=1)
    ok: bool
    downtime_ms: float = 0.0
    total_ms: float = 0.0
    was_running: bool = True


class MigrateFinishReply(_Msg):
    """Answer to ``MigrateFinish``: ``committed`` True once the row names the destination."""

    committed: bool
    error: str | None = None
    generation: int | None = None


# ------------------------------------------------------------------------------------ node commands, one union

#: The verbs of ``podbay.cmd.node.<node>.<verb>``: the subject's last token is the discriminator (the body
#: carries no kind, so the wire format is the model's fields alone).
NodeVerb = Literal["create", "delete", "snapshot", "restore", "fork", "pause", "resume", "suspend", "wake",
                   "migrate_out"]

#: Every body a node command carries.
NodeCommand = (CreateSandboxCmd | DeleteSandboxCmd | SnapshotCmd | RestoreCmd | ForkCmd | SandboxOpCmd | WakeCmd
               | MigrateOutCmd)

#: The body model of each verb (``pause``, ``resume`` and ``suspend`` share ``SandboxOpCmd``).
NODE_COMMANDS: dict[str, type[NodeCommand]] = {
    "create": CreateSandboxCmd,
    "delete": DeleteSandboxCmd,
    "snapshot": SnapshotCmd,
    "restore": RestoreCmd,
    "fork": ForkCmd,
    "pause": SandboxOpCmd,
    "resume": SandboxOpCmd,
    "suspend": SandboxOpCmd,
    "wake": WakeCmd,
    "migrate_out": MigrateOutCmd,
}


class NodeHandlers(TypedDict):
    """A node agent's handler for every verb, each taking its verb's body: a table missing a verb, or with a
    handler of another body, is a type error (mypy), so the dispatch is exhaustive."""

    create: Callable[[CreateSandboxCmd], Awaitable[None]]
    delete: Callable[[DeleteSandboxCmd], Awaitable[None]]
    snapshot: Callable[[SnapshotCmd], Awaitable[None]]
    restore: Callable[[RestoreCmd], Awaitable[None]]
    fork: Callable[[ForkCmd], Awaitable[None]]
    pause: Callable[[SandboxOpCmd], Awaitable[None]]
    resume: Callable[[SandboxOpCmd], Awaitable[None]]
    suspend: Callable[[SandboxOpCmd], Awaitable[None]]
    wake: Callable[[WakeCmd], Awaitable[None]]
    migrate_out: Callable[[MigrateOutCmd], Awaitable[None]]


class UnknownNodeCommand(ValueError):
    """A ``podbay.cmd.node.<node>.<verb>`` whose verb is not a ``NodeVerb``."""


async def dispatch_node_command(handlers: NodeHandlers, verb: str, data: bytes | str) -> None:
    """Parse ``data`` (the message body, JSON) as ``verb``'s model and await its handler.

    Raises ``UnknownNodeCommand`` for a verb outside ``NodeVerb`` and ``pydantic.ValidationError`` (a
    ``ValueError`` too) for a malformed body, both before any handler runs; the handler's own errors pass.
    """
    if verb not in get_args(NodeVerb):
        raise UnknownNodeCommand(f"unknown node command {verb!r}")
    cmd = NODE_COMMANDS[verb].model_validate_json(data)
    handler: Callable[[Any], Awaitable[None]] = handlers[cast(NodeVerb, verb)]  # checked above
    await handler(cmd)
