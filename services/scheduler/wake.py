"""Placement of a suspended sandbox that is resuming (docs/DESIGN.md §5: wake anywhere).

The sandbox row is ``resuming`` with no node; the scheduler chooses a node with room and the sandbox's
template (as for a create), moves it there at a new generation (still ``resuming``) and sends
``podbay.cmd.node.<node>.wake`` with the snapshot it was suspended to. When no node fits, the sandbox goes
back to ``suspended`` (nothing was lost) and the operation fails with ``no_capacity``
(``pending.fail_unplaced``).
"""

from __future__ import annotations

import asyncpg

from podbay.contracts.messages import PlaceSandbox, WakeCmd

__all__ = ["wake_command"]


async def wake_command(conn: asyncpg.Connection, cmd: PlaceSandbox, generation: int) -> WakeCmd:
    """The ``wake`` command for a placed ``resuming`` sandbox at ``generation``."""
    snap = await conn.fetchval("SELECT suspended_snapshot_id FROM sandboxes WHERE id=$1", cmd.sandbox_id)
    return WakeCmd(operation_id=cmd.operation_id, sandbox_id=cmd.sandbox_id, generation=generation,
                   snapshot_id=snap, fallback=cmd.fallback)
