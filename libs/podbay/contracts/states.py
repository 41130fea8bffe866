"""Sandbox lifecycle: a closed set of states and commands, and one table of what is allowed where.

Source: docs/DESIGN.md §5. The states are metric labels, so the set stays small and closed.
"""

from __future__ import annotations

from enum import StrEnum

from podbay.errors import InvalidState

__all__ = ["SandboxState", "SandboxCommand", "ALLOWED", "TERMINAL", "check_allowed", "OperationState",
           "SnapshotState", "PromotionState",
           "WarmSlotState", "VolumeState", "E2BBuildState", "NodeState"]


class SandboxState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    RESUMING = "resuming"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"


class SandboxCommand(StrEnum):
    CREATE = "create"
    EXEC = "exec"
    FILES = "files"
    PAUSE = "pause"
    RESUME = "resume"
    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    FORK = "fork"
    SUSPEND = "suspend"
    DELETE = "delete"


class OperationState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class SnapshotState(StrEnum):
    """A snapshot's ``state`` (the snapshots table's CHECK; podbay.snapshot_state moves it)."""

    CREATING = "creating"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class PromotionState(StrEnum):
    """A snapshot's ``promotion`` to object storage (the snapshots table's CHECK; podbay.snapshot_state)."""

    LOCAL = "local"
    PROMOTING = "promoting"
    PROMOTED = "promoted"
    FAILED = "failed"


class WarmSlotState(StrEnum):
    """A warm slot's ``state`` (the warm_slots table's CHECK; podbay.warm_slot_state moves it)."""

    PREPARING = "preparing"
    READY = "ready"
    CLAIMED = "claimed"
    FAILED = "failed"
    RETIRED = "retired"


class VolumeState(StrEnum):
    """A volume's ``state`` (the volumes table's CHECK; podbay.volume_state moves it)."""

    AVAILABLE = "available"  # a named volume, listed and attachable
    VIEW = "view"            # a fork child's read-only view of its parent's volume, gone with its sandbox
    DELETING = "deleting"    # its node removes its file, then its row


class E2BBuildState(StrEnum):
    """An E2B template build's ``state`` (the e2b_template_builds table's CHECK; podbay.build_state moves it;
    the values are E2B's, served as they are by its status route)."""

    WAITING = "waiting"
    BUILDING = "building"
    READY = "ready"
    ERROR = "error"


class NodeState(StrEnum):
    """A node's ``state`` (the nodes table's CHECK, libs/podbay/db/migrations/0010_nodes.sql; served as they are
    by ``GET /v1/nodes``: podbay.contracts.api's ``NodeState``)."""

    READY = "ready"          # placements allowed
    DRAINING = "draining"    # an operator empties it (services/scheduler/drain.py); no new placements
    DRAINED = "drained"      # its drain ended; no new placements until undrained
    LOST = "lost"            # its heartbeat stayed absent past the grace (services/scheduler/nodeloss.py)


TERMINAL: frozenset[SandboxState] = frozenset({SandboxState.DELETED})

S = SandboxState
ALLOWED: dict[SandboxCommand, frozenset[SandboxState]] = {
    SandboxCommand.CREATE: frozenset(),  # creation makes a new row; there is no prior state
    SandboxCommand.EXEC: frozenset({S.RUNNING}),
    SandboxCommand.FILES: frozenset({S.RUNNING}),
    SandboxCommand.PAUSE: frozenset({S.RUNNING}),
    SandboxCommand.RESUME: frozenset({S.PAUSED, S.SUSPENDED}),
    SandboxCommand.SNAPSHOT: frozenset({S.RUNNING, S.PAUSED}),
    # A failed sandbox (its QEMU died, or the node's VMs were purged) comes back from one of its snapshots.
    SandboxCommand.RESTORE: frozenset({S.RUNNING, S.PAUSED, S.FAILED}),
    SandboxCommand.FORK: frozenset({S.RUNNING, S.PAUSED}),
    SandboxCommand.SUSPEND: frozenset({S.RUNNING, S.PAUSED}),
    SandboxCommand.DELETE: frozenset(set(S) - {S.DELETED}),
}


#: How a refused command reads in "cannot <phrase> a sandbox that is <state>" (the default is its name).
_PHRASES: dict[SandboxCommand, str] = {SandboxCommand.FILES: "read or write files of"}


def check_allowed(command: SandboxCommand, state: SandboxState | str) -> None:
    """Raise ``InvalidState`` (HTTP 409, ``details.state``) unless ``command`` is allowed in ``state``."""
    st = SandboxState(state)
    if st not in ALLOWED[command]:
        # A paused or suspended sandbox is one call away from serving the command: say which.
        hint = ("; resume it first (POST /v1/sandboxes/{id}/resume, `podbay sandbox resume ID`)"
                if st in (S.PAUSED, S.SUSPENDED) and S.RUNNING in ALLOWED[command] else "")
        raise InvalidState(
            f"cannot {_PHRASES.get(command, command.value)} a sandbox that is {st.value}{hint}",
            details={"state": st.value, "command": command.value},
        )
