"""Sandbox lifecycle: a closed set of states and commands, and one table of what is allowed where.

Source: docs/DESIGN.md §5. The states are metric labels, so the set stays small and closed.
"""

from __future__ import annotations

from enum import StrEnum

from podbay.errors import InvalidState

__all__ = ["SandboxState", "SandboxCommand", "ALLOWED", "TERMINAL", "check_allowed", "OperationState"]


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
