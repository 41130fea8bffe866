"""The one writer of the ``volumes`` table's state: which step takes a volume from which state to which, and
the named statements that take it (docs/volumes.md).

A volume row (:class:`~podbay.contracts.states.VolumeState`) is born ``available`` (a named volume: POST
/v1/volumes, or a fork's copy) or ``view`` (a fork child's read-only view of its parent's volume)
(:func:`insert`). Deleting it marks it ``deleting`` (:func:`mark_deleting`; a view when its sandbox is
deleted, :func:`mark_views_of_deleted_sandboxes`), and its node then removes its file and the row
(:func:`remove_deleted`); a volume never placed on a node has no file and its row goes at once
(:func:`remove_unplaced`). The states are closed by a CHECK in the schema
(libs/podbay/db/migrations/0022_volume_snapshots.sql). Statements are fenced by the states their verb leaves
(podbay.transitions). The other columns its writers change (``node_id``: where its file is; ``snapshot_id``:
the promoted snapshot it is restored from) are written here too, not as state changes: every
``INSERT``/``UPDATE``/``DELETE`` of ``volumes`` in services/ and libs/ lives in this module
(tests/unit/test_volume_state.py refuses others).

Every function takes a connection or a pool (``conn``): inside the caller's transaction when it passes one.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Final

import asyncpg

from podbay.contracts.states import NodeState, VolumeState
from podbay.transitions import Conn, TransitionTable

__all__ = ["VolumeVerb", "TRANSITIONS", "BIRTH_STATES", "next_state", "insert", "mark_deleting",
           "mark_views_of_deleted_sandboxes", "remove_unplaced", "remove_deleted", "place", "place_of_sandbox",
           "place_anywhere", "release", "release_of_lost_node", "record_snapshot", "restore"]

V = VolumeState


class VolumeVerb(StrEnum):
    """What moves a volume."""

    DELETE = "delete"  # a caller's delete, or its view's sandbox was deleted


#: States a volume is born in.
BIRTH_STATES: Final = frozenset({V.AVAILABLE, V.VIEW})

#: ``(state, verb)`` -> the next state; a pair that is missing is not a transition.
TRANSITIONS: Final[Mapping[tuple[VolumeState, VolumeVerb], VolumeState]] = {
    (V.AVAILABLE, VolumeVerb.DELETE): V.DELETING,
    (V.VIEW, VolumeVerb.DELETE): V.DELETING,
}

_TABLE: Final = TransitionTable(TRANSITIONS, states=VolumeState, refusal="a volume that is {state} cannot {verb}")


def next_state(state: VolumeState | str, verb: VolumeVerb) -> VolumeState:
    """The state ``verb`` takes a volume in ``state`` to. Raises ``InvalidState`` (409) when it does not
    apply, ``ValueError`` for an unknown state."""
    return _TABLE.next_state(state, verb)


_INSERT_SQL: Final = ("INSERT INTO volumes (id, tenant_id, name, size_bytes, node_id, origin, owner_sandbox_id,"
                      " state) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)")
_DELETE_SQL: Final = _TABLE.update_sql("volumes", VolumeVerb.DELETE)
# A fork child's view goes with its sandbox (the sandbox's row is read, not written).
_VIEWS_SQL: Final = (f"UPDATE volumes v SET state='{V.DELETING.value}' FROM sandboxes s"
                     f" WHERE s.id = v.owner_sandbox_id AND v.state = '{V.VIEW.value}' AND s.state = 'deleted'"
                     " AND v.node_id = $1")
_REMOVE_UNPLACED_SQL: Final = "DELETE FROM volumes WHERE id=$1 AND node_id IS NULL"
_REMOVE_DELETED_SQL: Final = f"DELETE FROM volumes WHERE id = $1 AND state = '{V.DELETING.value}'"


async def insert(conn: Conn, volume_id: str, *, tenant_id: str, name: str, size_bytes: int,
                 node_id: str | None = None, origin: str | None = None, owner_sandbox_id: str | None = None,
                 state: VolumeState = V.AVAILABLE, returning: str = "") -> asyncpg.Record | None:
    """Insert a volume of ``size_bytes`` named ``name``: ``available``, or a ``view`` owned by sandbox
    ``owner_sandbox_id``; ``node_id``: where its file is (None: made on its first sandbox's node);
    ``origin``: the snapshot file it is made from. Returns the ``returning`` columns (a SQL list) of the new
    row, or None without them. Raises ``ValueError`` for another state, ``asyncpg.UniqueViolationError`` when
    the tenant has an available volume of that name."""
    if state not in BIRTH_STATES:
        raise ValueError(f"a volume is born available or a view, not {state}")
    args = (volume_id, tenant_id, name, size_bytes, node_id, origin, owner_sandbox_id, VolumeState(state).value)
    if returning:
        row: asyncpg.Record | None = await conn.fetchrow(f"{_INSERT_SQL} RETURNING {returning}", *args)
        return row
    await conn.execute(_INSERT_SQL, *args)
    return None


async def mark_deleting(conn: Conn, volume_id: str) -> None:
    """``available`` or ``view`` -> ``deleting``: its node removes the file, then the row."""
    await conn.execute(_DELETE_SQL, volume_id)


async def mark_views_of_deleted_sandboxes(conn: Conn, node_id: str) -> None:
    """Every ``view`` on node ``node_id`` whose sandbox is deleted -> ``deleting``."""
    await conn.execute(_VIEWS_SQL, node_id)


async def remove_unplaced(conn: Conn, volume_id: str) -> None:
    """Remove the row of a volume that was never placed on a node (it has no file)."""
    await conn.execute(_REMOVE_UNPLACED_SQL, volume_id)


async def remove_deleted(conn: Conn, volume_id: str) -> None:
    """Remove a ``deleting`` volume's row once its file is gone."""
    await conn.execute(_REMOVE_DELETED_SQL, volume_id)


async def place(conn: Conn, volume_id: str, node_id: str) -> None:
    """Record that an unplaced volume's file is made on node ``node_id``; a placed one stays where it is."""
    await conn.execute("UPDATE volumes SET node_id=$2 WHERE id=$1 AND node_id IS NULL", volume_id, node_id)


async def place_of_sandbox(conn: Conn, sandbox_id: str, node_id: str) -> None:
    """The unplaced volumes attached to sandbox ``sandbox_id`` live on node ``node_id`` (where it runs)."""
    await conn.execute("UPDATE volumes SET node_id=$2 WHERE node_id IS NULL AND id IN"
                       " (SELECT volume_id FROM sandbox_volumes WHERE sandbox_id=$1)", sandbox_id, node_id)


async def place_anywhere(conn: Conn, volume_id: str) -> str | None:
    """Place an unplaced volume on a ready node chosen at random. Returns that node, or None when the volume
    was placed already (or no node is ready)."""
    node: str | None = await conn.fetchval(
        "UPDATE volumes SET node_id = (SELECT id FROM nodes WHERE state = $2 ORDER BY random() LIMIT 1)"
        " WHERE id = $1 AND node_id IS NULL RETURNING node_id", volume_id, NodeState.READY)
    return node


async def release(conn: Conn, volume_id: str, node_id: str) -> None:
    """Unbind a volume from node ``node_id`` (its file there was removed; ``released_at`` now): its next
    sandbox fetches it from its promoted snapshot wherever it is placed."""
    await conn.execute("UPDATE volumes SET node_id=NULL, released_at=now() WHERE id=$1 AND node_id=$2",
                       volume_id, node_id)


async def release_of_lost_node(conn: Conn, node_id: str) -> None:
    """Unbind every volume of lost node ``node_id`` that has a promoted snapshot (restorable elsewhere)."""
    await conn.execute("UPDATE volumes SET node_id=NULL, released_at=now() WHERE node_id=$1"
                       " AND snapshot_id IS NOT NULL", node_id)


async def record_snapshot(conn: Conn, volume_id: str, snapshot_id: str, taken_at: datetime) -> None:
    """Make ``snapshot_id`` (taken at ``taken_at``) the volume's newest promoted snapshot, unless a newer one
    is recorded or the volume was released or restored after it was taken (its data is no longer the
    volume's)."""
    await conn.execute(
        "UPDATE volumes SET snapshot_id=$2, snapshot_at=$3 WHERE id=$1"
        " AND (snapshot_at IS NULL OR snapshot_at < $3) AND (released_at IS NULL OR released_at < $3)",
        volume_id, snapshot_id, taken_at)


async def restore(conn: Conn, volume_id: str, snapshot_id: str, taken_at: datetime, *,
                  returning: str) -> asyncpg.Record:
    """Point the volume at promoted snapshot ``snapshot_id`` (taken at ``taken_at``; ``released_at`` now:
    its next sandbox starts from that snapshot). Returns the ``returning`` columns (a SQL list); the caller
    holds the row locked (it exists)."""
    row: asyncpg.Record = await conn.fetchrow(
        f"UPDATE volumes SET snapshot_id=$2, snapshot_at=$3, released_at=now() WHERE id=$1 RETURNING {returning}",
        volume_id, snapshot_id, taken_at)
    return row
