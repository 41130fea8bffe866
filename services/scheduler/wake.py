"""Placement of a suspended sandbox that is resuming (DESIGN.md §5: wake anywhere).

The sandbox row is ``resuming`` with no node; the scheduler chooses a node with room and the sandbox's
template (as for a create), moves it there at a new generation (still ``resuming``) and sends
``podbay.cmd.node.<node>.wake`` with the snapshot it was suspended to. When no node fits, the sandbox goes
back to ``suspended`` (nothing was lost) and the operation fails with ``no_capacity``.
"""

from __future__ import annotations

import asyncpg

from podbay.contracts.messages import PlaceSandbox, WakeCmd
from podbay.outbox import emit_sandbox_event

__all__ = ["wake_command", "wake_unplaceable"]


async def wake_command(conn: asyncpg.Connection, cmd: PlaceSandbox, generation: int) -> WakeCmd:
    """The ``wake`` command for a placed ``resuming`` sandbox at ``generation``."""
    snap = await conn.fetchval("SELECT suspended_snapshot_id FROM sandboxes WHERE id=$1", cmd.sandbox_id)
    return WakeCmd(operation_id=cmd.operation_id, sandbox_id=cmd.sandbox_id, generation=generation,
                   snapshot_id=snap, fallback=cmd.fallback)


async def wake_unplaceable(conn: asyncpg.Connection, cmd: PlaceSandbox, reason: str) -> None:
    """No node has room: back to ``suspended``, the operation failed with ``no_capacity``."""
    await conn.execute("UPDATE sandboxes SET state='suspended', updated_at=now() WHERE id=$1 AND state='resuming'",
                       cmd.sandbox_id)
    await conn.execute("UPDATE operations SET state='failed', error_code='no_capacity', error_message=$2,"
                       " finished_at=now() WHERE id=$1", cmd.operation_id, reason)
    await emit_sandbox_event(conn, cmd.sandbox_id, "suspended", state="suspended", reason=f"resume failed: {reason}",
                             tenant_id=cmd.tenant_id, data={"operation_id": cmd.operation_id})
