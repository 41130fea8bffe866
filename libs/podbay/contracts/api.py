"""HTTP API bodies (``/v1``). The OpenAPI document in docs/openapi.json is generated from these.

Sizes are bytes, durations carry their unit in the name. Every error body is
``{"error": {"code", "message", "details"?}}`` (see ``podbay.errors``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, model_validator

from .egress import EgressPolicy
from .templates import TEMPLATE_REF_RE
from .volumes import MAX_VOLUMES_PER_SANDBOX, VolumeMount

__all__ = [
    "PortInfo",
    "PortList",
    "PortAccessUpdate",
    "PortAccess",
    "PortUrl",
    "NodeResources",
    "NodeInfo",
    "NodeList",
    "SandboxCreate",
    "SandboxInfo",
    "SandboxList",
    "OperationInfo",
    "DrainStarted",
    "NodeUndrained",
    "ExecRequest",
    "ExecResult",
    "ExecEvent",
    "FileInfo",
    "FileList",
    "ErrorBody",
    "TemplateInfo",
    "SnapshotCreate",
    "LeaseUpdate",
    "SnapshotInfo",
    "SnapshotList",
    "RestoreRequest",
    "ForkRequest",
    "ForkChildResult",
    "ForkResult",
    "SnapshotDiffEntry",
    "SnapshotDiff",
    "PoolSet",
    "PoolNode",
    "PoolInfo",
    "PoolList",
]

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"


MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
MetadataValue = Annotated[str, StringConstraints(max_length=1024)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxCreate(_In):
    """``POST /v1/sandboxes``."""

    template: str = Field(pattern=TEMPLATE_REF_RE, description="Template name, e.g. 'base' (its current build), "
                          "or name:tag, e.g. 'web:v2' (the build the tag names).")
    memory_mib: int | None = Field(None, ge=128, le=16384, description="Must match the template's snapshot.")
    vcpus: int | None = Field(None, ge=1, le=16)
    disk_mib: int | None = Field(
        None, ge=1, description="Root disk size in MiB, at least the template's; the filesystem grows to fill it. "
        "Absent: the template's. At most the server's SANDBOX_MAX_DISK_MIB (422 invalid_disk_size otherwise). "
        "Not from a warm slot: such a create restores.")
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict, max_length=64, description="Up to 64 labels: keys 1-128 characters, values up to 1,024.")
    lease_s: int | None = Field(None, ge=10, le=30 * 86400, description="Lease in seconds; default from the server.")
    on_lease_expiry: Literal["pause", "delete"] | None = Field(
        None, description="What happens when the lease runs out and the guest is idle (default: pause).")
    network: EgressPolicy | None = Field(
        None, description="Egress policy of this sandbox; absent: the template's (whose default is no egress).")
    volumes: list[VolumeMount] | None = Field(
        None, max_length=MAX_VOLUMES_PER_SANDBOX,
        description="Volumes to mount (``/v1/volumes``); the sandbox is placed on their node. Not from a warm slot.")


class LeaseUpdate(_In):
    """``POST /v1/sandboxes/{id}/timeout``: renew the lease for ``lease_s`` seconds from now."""

    lease_s: int = Field(ge=10, le=30 * 86400)
    on_lease_expiry: Literal["pause", "delete"] | None = None


class SandboxInfo(BaseModel):
    id: str
    template: str
    template_digest: str | None = Field(None, description="The template build the sandbox was created from (its "
                                        "content digest, as ``GET /v1/templates`` lists it, tags included): a later "
                                        "rebuild of the template does not change it.")
    state: str
    desired_state: str = Field(description="What the sandbox should become: ``running`` while it is wanted, whatever "
                               "its state (a paused or suspended sandbox is wanted; it runs again when resumed), "
                               "``deleted`` once its deletion was asked. ``state`` is where it is now.")
    node_id: str | None = None
    generation: int
    memory_mib: int
    vcpus: int
    disk_mib: int | None = Field(None, description="Root disk size in MiB when the create asked for one; "
                                 "null: the template's.")
    hostname: str
    failure_reason: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    lease_s: int | None = None
    lease_expires_at: datetime | None = None
    on_lease_expiry: str | None = None
    created_at: datetime
    updated_at: datetime
    parent_id: str | None = Field(None, description="For a fork child: the sandbox it was forked from (it may be "
                                  "deleted since); null for a sandbox created from a template.")
    operation_id: str | None = Field(None, description="The operation that this call started, if any.")


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class OperationInfo(BaseModel):
    """``GET /v1/operations/{id}``."""

    id: str
    kind: str
    sandbox_id: str | None
    state: Literal["pending", "running", "succeeded", "failed"]
    error: dict[str, str] | None = None
    created_at: datetime
    finished_at: datetime | None = None
    node_id: str | None = Field(None, description="The node a drain (or a migration) is about.")
    progress: dict[str, Any] | None = Field(None, description="A drain's progress: total, moved, failed "
                                            "[{sandbox_id, reason}], moves [{sandbox_id, destination, "
                                            "downtime_ms, total_ms, how}] (how: migrate, or suspend for a "
                                            "sandbox with volumes).")
    data: dict[str, Any] | None = Field(None, description="A migration's figures: source, destination, "
                                        "downtime_ms, total_ms.")


class DrainStarted(BaseModel):
    """``POST /v1/nodes/{id}/drain`` (202): the node is ``draining``; follow ``GET /v1/operations/{id}``."""

    operation_id: str
    node_id: str
    state: Literal["draining", "drained"]


class NodeUndrained(BaseModel):
    """``POST /v1/nodes/{id}/undrain`` (200): the node takes new sandboxes again; ``previous`` was its state
    (``draining``, ``drained``, or ``ready`` when it already was)."""

    node_id: str
    state: Literal["ready"]
    previous: Literal["ready", "draining", "drained"]


#: Longest argument or environment string execve(2) takes, NUL included: Linux's MAX_ARG_STRLEN (32 pages of
#: 4 KiB, include/uapi/linux/binfmts.h).
EXEC_ARG_MAX_BYTES = 32 * 4096
#: Arguments and environment together: a quarter of the default 8 MiB stack limit (execve(2), "Limits on size
#: of arguments and environment"); the guest adds a few entries of its own.
EXEC_ARGS_TOTAL_MAX_BYTES = 2 << 20


class ExecRequest(_In):
    """``POST /v1/sandboxes/{id}/exec`` (and ``/exec/stream``).

    Give ``argv`` or ``shell`` (run by ``/bin/sh -c``), not both. ``stdin`` is UTF-8 text
    (binary stdin lands later); at most 16 MiB.
    """

    argv: list[str] | None = Field(None, min_length=1, max_length=4096)
    shell: str | None = Field(None, max_length=1 << 20)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = Field(None, description="User name or uid; default root.")
    stdin: str | None = Field(None, max_length=16 << 20)
    timeout_s: float | None = Field(None, gt=0, le=86400)

    @model_validator(mode="after")
    def _one_command(self) -> ExecRequest:
        if (self.argv is None) == (self.shell is None):
            raise ValueError("give exactly one of argv or shell")
        # What execve(2) refuses with E2BIG, refused here as the client's error rather than the guest's.
        strings = [*(self.argv or ["/bin/sh", "-c", self.shell or ""]), *(f"{k}={v}" for k, v in self.env.items())]
        sizes = [len(x.encode()) + 1 for x in strings]
        if (longest := max(sizes)) > EXEC_ARG_MAX_BYTES:
            raise ValueError(f"an argument or environment entry of {longest - 1} bytes is longer than the "
                             f"{EXEC_ARG_MAX_BYTES - 1} a Linux process accepts (MAX_ARG_STRLEN); pass large data "
                             "as stdin or a file")
        if sum(sizes) > EXEC_ARGS_TOTAL_MAX_BYTES:
            raise ValueError(f"arguments and environment of {sum(sizes)} bytes in all exceed the "
                             f"{EXEC_ARGS_TOTAL_MAX_BYTES} a Linux process accepts with the default 8 MiB stack "
                             "(ARG_MAX); pass large data as stdin or a file")
        return self


class ExecResult(BaseModel):
    stdout: str
    stderr: str
    exit_code: int = Field(description="The process's exit code; -N when killed by signal N.")
    duration_ms: float
    timed_out: bool = False
    output_truncated: bool = Field(False, description="stdout or stderr went past the 16 MiB each that a run "
                                   "to completion keeps; the rest was read and dropped (``/exec/stream`` has all).")


class ExecEvent(BaseModel):
    """One NDJSON line of ``/exec/stream``: ``stdout``/``stderr`` carry ``data``; ``exit`` ends the stream."""

    type: Literal["start", "stdout", "stderr", "exit", "error"]
    data: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    timed_out: bool | None = None
    error: dict[str, str] | None = None


class FileInfo(BaseModel):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class FileList(BaseModel):
    entries: list[FileInfo]


class PortInfo(BaseModel):
    """One guest port: a listening socket (from the guest's /proc/net/tcp{,6}) and/or a port's access setting."""

    port: int = Field(ge=1, le=65535)
    listening: bool = Field(description="A socket listens on it in the guest now.")
    addresses: list[str] = Field(default_factory=list, description="Addresses it listens on (0.0.0.0, ::, ...).")
    reachable: bool = Field(description="The edge can reach it: it listens on a wildcard address or the "
                            "guest's own, not only on loopback.")
    public: bool = Field(description="Open without a token (still rate-limited and logged).")


class PortList(BaseModel):
    """``GET /v1/sandboxes/{id}/ports``: listening ports and ports with a setting, sorted by port."""

    ports: list[PortInfo]


class PortAccessUpdate(_In):
    """``PUT /v1/sandboxes/{id}/ports/{port}``."""

    # Strict: a JSON true or false only ("yes" or 1 is a mistake to report, not a value to guess).
    public: StrictBool = Field(description="true: anyone with the URL reaches the port; false: it needs the sandbox's "
                         "traffic token or an API key of its tenant (the default).")


class PortAccess(BaseModel):
    port: int
    public: bool


class PortUrl(BaseModel):
    """``GET /v1/sandboxes/{id}/ports/{port}/url``: where a guest port answers, and how to open it."""

    port: int
    url: str = Field(description="Host form: {port}-{sandbox id with '-' for '_'}.{ports_domain}.")
    path_url: str = Field(description="Path form on the API itself, for places without wildcard DNS.")
    token: str = Field(description="The sandbox's traffic token: send it in X-Podbay-Access-Token, or once "
                       "as ?podbay_token= (exchanged for a cookie).")
    header: str = Field("X-Podbay-Access-Token")
    public: bool


class TemplateInfo(BaseModel):
    name: str
    digest: str
    memory_mib: int
    vcpus: int
    created_at: datetime


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: dict[str, object] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class SnapshotCreate(_In):
    """``POST /v1/sandboxes/{id}/snapshots``: ``disk`` (filesystems frozen for a reflink of the disk) or
    ``full`` (memory, device state and disk; the guest is paused meanwhile)."""

    kind: Literal["disk", "full"] = "full"


class SnapshotInfo(BaseModel):
    id: str
    sandbox_id: str
    kind: Literal["disk", "full"]
    state: Literal["creating", "ready", "failed", "deleted"]
    parent_id: str | None = None
    size_bytes: int | None = Field(None, description="Bytes on the node's disk (allocated, before sharing).")
    paused_ms: float | None = Field(None, description="Time the guest was held (paused or frozen), in ms.")
    error: str | None = None
    created_at: datetime
    ready_at: datetime | None = None
    promotion: Literal["local", "promoting", "promoted", "failed"] = Field(
        "local", description="Object storage: only on the node, being promoted, promoted (restorable on any "
        "node), or failed (``promotion_error``).")
    promoted_at: datetime | None = None
    promotion_error: str | None = None
    uploaded_bytes: int | None = Field(None, description="Bytes this promotion uploaded (before compression; "
                                       "chunks already stored are not sent again).")
    stored_bytes: int | None = Field(None, description="Bytes this promotion sent (compressed).")
    operation_id: str | None = None


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class RestoreRequest(_In):
    """``POST /v1/sandboxes/{id}/restore``: roll back to one of this sandbox's ready snapshots."""

    snapshot_id: str = Field(min_length=1, max_length=64)
    volumes: bool = Field(False, description="Roll the sandbox's read-write volumes back too, to their copies "
                          "in the full snapshot (taken while the guest was stopped). Volumes are not rolled back "
                          "with their sandbox unless asked, and a full snapshot of a sandbox with a read-write "
                          "volume is refused without it (its memory's mount would not match the volume); a disk "
                          "snapshot holds no volume copy.")


class ForkRequest(_In):
    """``POST /v1/sandboxes/{id}/fork``: ``count`` children from a new full snapshot, or from ``snapshot_id``."""

    count: int = Field(1, ge=1, le=100)
    snapshot_id: str | None = Field(None, min_length=1, max_length=64)
    schedules: bool = Field(False, description="Give each child a copy of the parent's schedules that have a "
                            "fire time left; by default a child has none.")
    volumes: Literal["readonly", "copy"] = Field(
        "readonly", description="What each child gets of the parent's read-write volumes, at the same paths: "
        "'readonly', a read-only view of the volume as it was at the fork's snapshot (removed with the child); "
        "'copy', its own read-write volume, a reflink copy named '<volume>-<12 hex of the child id>' that "
        "outlives the child. Read-only volumes stay attached read-only either way.")


class ForkChildResult(BaseModel):
    sandbox_id: str
    state: str
    failure_reason: str | None = None


class ForkResult(BaseModel):
    snapshot_id: str
    operation_id: str
    children: list[ForkChildResult]


class SnapshotDiffEntry(BaseModel):
    """One path that differs between two snapshots, as seen in the guest (``/etc/hostname``)."""

    path: str
    change: Literal["added", "changed", "removed"]
    kind: Literal["file", "dir", "symlink", "other"] = Field(
        description="The kind in the later snapshot (in the earlier one when removed).")
    size: int = Field(description="Bytes in the later snapshot (in the earlier one when removed).")


class SnapshotDiff(BaseModel):
    """``GET /v1/sandboxes/{id}/snapshots/{a}/diff/{b}``: what changed from snapshot ``a`` to ``b``.

    ``entries`` are sorted by path and capped (``truncated`` says so); the totals count every change,
    also those left out of ``entries``.
    """

    sandbox_id: str
    from_snapshot_id: str
    to_snapshot_id: str
    entries: list[SnapshotDiffEntry]
    added: int = Field(description="Paths only in the later snapshot.")
    changed: int = Field(description="Paths in both whose kind, content, mode or owner differ.")
    removed: int = Field(description="Paths only in the earlier snapshot.")
    truncated: bool = False


class PoolSet(_In):
    """``PUT /v1/pools/{template}``: keep at least ``size`` warm slots of the template, and up to ``max_size``
    when recent demand asks for more (default: exactly ``size``). ``size`` 0 with no ``max_size`` ends the
    pool. Slots are spread over the nodes that carry the template and bounded by each node's memory."""

    # Strict: a JSON integer only (not true, "3" or 3.0).
    size: int = Field(ge=0, le=1000, strict=True, description="Slots kept whatever the demand (the operator's "
                      "floor).")
    max_size: int | None = Field(None, ge=0, le=1000, strict=True, description="Upper bound when following demand.")

    @model_validator(mode="after")
    def _bounds(self) -> PoolSet:
        if self.max_size is not None and self.max_size < self.size:
            raise ValueError("max_size must be at least size")
        return self


class PoolNode(BaseModel):
    """One node's part of a pool. ``claimed``: slots handed to creates in the recent demand window;
    ``failing``: slots that failed in that window (a failed health check, a VM that died, a refused claim);
    slots retired on purpose (a pool that shrank, a template that changed) are not counted."""

    node_id: str
    target: int
    ready: int
    preparing: int
    claimed: int
    failing: int


class PoolInfo(BaseModel):
    template: str
    size: int
    max_size: int
    target: int = Field(description="Sum of the nodes' targets: the bounds applied to recent demand.")
    ready: int
    nodes: list[PoolNode]
    hits: int = Field(0, description="The caller's creates of this template in the last hour served from a warm "
                      "slot (a slot the node then refused, restored instead, still counts here).")
    misses: int = Field(0, description="The caller's creates of this template in the last hour that took the "
                        "restore path (no ready slot, a tag, volumes, a larger disk, or wait=false).")
    hit_rate: float | None = Field(None, description="hits / (hits + misses); null without creates in the hour.")


class PoolList(BaseModel):
    pools: list[PoolInfo]


NodeState = Literal["ready", "draining", "drained", "lost"]


class NodeResources(BaseModel):
    """Memory (MiB) and vCPUs."""

    memory_mib: int
    vcpus: int


class NodeMemory(BaseModel):
    """What a node measured of its memory (MiB; docs/ARCHITECTURE.md "Placement"), as its heartbeat carries it
    and placement admits by it. ``available_mib``: the host's MemAvailable less mapped guest RAM;
    ``sandboxes_mib``: what its VMs (and warm slots) cost, a paused sandbox whose RAM was released 0;
    ``reclaimable_mib``: what releasing its paused and idle pausable sandboxes would free;
    ``sandbox_cost_mib``: the median cost of its running sandboxes (null before one runs);
    ``limit_mib``: ``PODBAY_NODE_MEMORY_MIB`` when set; ``headroom_mib``: what it keeps free;
    ``room_mib``: what new sandboxes may still use, counting what it could release (may be negative)."""

    available_mib: int
    sandboxes_mib: int
    reclaimable_mib: int
    sandbox_cost_mib: int | None
    limit_mib: int | None
    headroom_mib: int
    room_mib: int
    measured_at: datetime | None


class NodeInfo(BaseModel):
    """``GET /v1/nodes`` item: one node as the control plane sees it.

    ``capacity``: what the node offers sandboxes (``PODBAY_NODE_MEMORY_MIB``/``PODBAY_NODE_VCPUS``);
    ``used``: what its placed sandboxes (and warm slots) take according to PostgreSQL (paused sandboxes keep
    their memory and use no vCPU); ``free`` = capacity - used. ``heartbeat_age_s``: seconds since its last
    heartbeat, ``null`` when its heartbeat key has expired (``live`` false). ``schedulable``: the scheduler
    places new sandboxes here (live, state ``ready``, and the node says it takes work). ``memory``: what the
    node measured (:class:`NodeMemory`), which is what admission uses; ``capacity``/``used``/``free`` are
    nominal."""

    id: str
    state: NodeState
    live: bool
    schedulable: bool
    accel: str
    dataplane_url: str
    capacity: NodeResources
    used: NodeResources
    free: NodeResources
    running: int = Field(description="Sandboxes running (or starting, resuming) on the node.")
    paused: int
    sandboxes: int = Field(description="Every sandbox placed on the node that is not deleted or failed.")
    warm_slots: int = Field(description="Warm slots ready to be claimed on the node.")
    heartbeat_age_s: float | None
    memory: NodeMemory | None = Field(None, description="Measured memory from the node's last heartbeat; null "
                                      "when it is not live or does not measure.")
    started_at: datetime
    state_changed_at: datetime | None = None
    lost_at: datetime | None = None
    drain_operation_id: str | None = Field(None, description="The node's newest drain (running or ended); follow "
                                           "its progress at ``GET /v1/operations/{id}``. null: never drained.")


class NodeList(BaseModel):
    """``GET /v1/nodes``: every node known to the control plane, by id."""

    nodes: list[NodeInfo]
