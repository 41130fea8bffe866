"""The one writer of the ``snapshots`` table: which step takes a snapshot from which state to which, and the
named statements that take it.

A snapshot row has two state columns, each closed by a CHECK in the schema
(libs/podbay/db/migrations/0002_snapshots.sql, 0004_promotion.sql):

- ``state`` (:class:`~podbay.contracts.states.SnapshotState`): born ``creating`` (:func:`insert`: the API's
  snapshot and fork, a suspend, a cadence snapshot), then ``ready`` (the node wrote its files) or ``failed``;
  any of those ends ``deleted`` (retention, the sandbox's deletion or suspend, E2B's snapshot delete).
  :data:`TRANSITIONS` maps ``(state, verb)`` to the next state.
- ``promotion`` (:class:`~podbay.contracts.states.PromotionState`): ``local`` until the snapshotter starts an
  upload (``promoting``), which ends ``promoted`` or ``failed``; a failed or interrupted one may start again.
  :data:`PROMOTION_TRANSITIONS` maps ``(promotion, verb)`` to the next one.

Each function below is one statement, fenced in SQL by the states its verb leaves (the table's sources), so a
step that does not apply changes nothing (a row another writer moved first is not overwritten). State names
in the SQL text come from the enums. The other columns a writer changes (``node_id`` when a suspended
sandbox wakes elsewhere, ``pinned``) are written here too: every ``INSERT``/``UPDATE``/``DELETE`` of
``snapshots`` in services/ and libs/ lives in this module (tests/unit/test_snapshot_state.py refuses others).

Every function takes a connection or a pool (``conn``): inside the caller's transaction when it passes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, Final

import asyncpg

from podbay.contracts.states import PromotionState, SnapshotState
from podbay.transitions import Conn, TransitionTable

__all__ = [
    "SnapshotVerb", "PromotionVerb", "TRANSITIONS", "PROMOTION_TRANSITIONS", "BIRTH_STATE", "next_state",
    "next_promotion", "sources", "promotion_sources", "INSERT_SQL", "insert", "forget", "mark_ready", "fail",
    "fail_interrupted", "delete", "delete_of_deleted_sandbox", "delete_local_of_sandbox", "move_to_node", "pin",
    "unpin", "start_promotion", "mark_promoted", "fail_promotion",
]

S = SnapshotState
P = PromotionState


class SnapshotVerb(StrEnum):
    """What moves a snapshot's ``state``."""

    READY = "ready"    # the node wrote the snapshot's files
    FAIL = "fail"      # the node could not take it, or a node agent restart interrupted it
    DELETE = "delete"  # retention, its sandbox's deletion or suspend, a caller's delete


class PromotionVerb(StrEnum):
    """What moves a snapshot's ``promotion``."""

    START = "start"        # the snapshotter wrote the manifest and starts the upload (a ready snapshot only)
    PROMOTED = "promoted"  # every chunk is in object storage, verified
    FAIL = "fail"          # the upload failed; a later promote command may start it again


#: The state every snapshot row is born in.
BIRTH_STATE: Final = S.CREATING

#: ``(state, verb)`` -> the next state; a pair that is missing is not a transition.
TRANSITIONS: Final[Mapping[tuple[SnapshotState, SnapshotVerb], SnapshotState]] = {
    (S.CREATING, SnapshotVerb.READY): S.READY,
    (S.CREATING, SnapshotVerb.FAIL): S.FAILED,
    (S.CREATING, SnapshotVerb.DELETE): S.DELETED,
    (S.READY, SnapshotVerb.DELETE): S.DELETED,
    (S.FAILED, SnapshotVerb.DELETE): S.DELETED,
}

#: ``(promotion, verb)`` -> the next promotion state.
PROMOTION_TRANSITIONS: Final[Mapping[tuple[PromotionState, PromotionVerb], PromotionState]] = {
    **{(p, PromotionVerb.START): P.PROMOTING for p in (P.LOCAL, P.PROMOTING, P.FAILED)},
    (P.PROMOTING, PromotionVerb.PROMOTED): P.PROMOTED,
    **{(p, PromotionVerb.FAIL): P.FAILED for p in (P.LOCAL, P.PROMOTING, P.FAILED)},
}

_STATE: Final = TransitionTable(TRANSITIONS, states=SnapshotState, refusal="a snapshot that is {state} cannot {verb}")
_PROMOTION: Final = TransitionTable(PROMOTION_TRANSITIONS, states=PromotionState, column="promotion",
                                    refusal="a snapshot whose promotion is {state} cannot {verb}")


def next_state(state: SnapshotState | str, verb: SnapshotVerb) -> SnapshotState:
    """The state ``verb`` takes a snapshot in ``state`` to. Raises ``InvalidState`` (409) when it does not
    apply, ``ValueError`` for an unknown state."""
    return _STATE.next_state(state, verb)


def next_promotion(promotion: PromotionState | str, verb: PromotionVerb) -> PromotionState:
    """The promotion state ``verb`` takes a snapshot in ``promotion`` to. Raises ``InvalidState`` (409) when it
    does not apply, ``ValueError`` for an unknown state."""
    return _PROMOTION.next_state(promotion, verb)


def sources(verb: SnapshotVerb) -> frozenset[SnapshotState]:
    """The states ``verb`` leaves."""
    return _STATE.sources(verb)


def promotion_sources(verb: PromotionVerb) -> frozenset[PromotionState]:
    """The promotion states ``verb`` leaves."""
    return _PROMOTION.sources(verb)


_NOT_PROMOTED: Final = f"promotion <> '{P.PROMOTED.value}'"

#: The INSERT of a new snapshot row, born :data:`BIRTH_STATE`: ``$1`` id, ``$2`` tenant, ``$3`` sandbox,
#: ``$4`` node (None: not on a node yet), ``$5`` kind (``disk``/``full``), ``$6`` parent (the sandbox's
#: newest ready snapshot, or None), ``$7`` the sandbox's generation.
INSERT_SQL: Final = ("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, parent_id, generation)"
                     f" VALUES ($1,$2,$3,$4,$5,'{BIRTH_STATE.value}',$6,$7)")
_FORGET_SQL: Final = f"DELETE FROM snapshots WHERE id=$1 AND state='{BIRTH_STATE.value}'"
_READY_SQL: Final = _STATE.update_sql("snapshots", SnapshotVerb.READY,
                                      also="size_bytes=$2, paused_ms=$3, ready_at=now()")
_FAIL_SQL: Final = _STATE.update_sql("snapshots", SnapshotVerb.FAIL, also="error=$2")
_FAIL_NODE_SQL: Final = _STATE.update_sql("snapshots", SnapshotVerb.FAIL, also="error=$2", where="node_id=$1",
                                          returning="id, sandbox_id")
_DELETE_IDS_SQL: Final = _STATE.update_sql("snapshots", SnapshotVerb.DELETE, where="id = ANY($1::text[])")
_DELETE_OF_SANDBOX: Final = _STATE.update_sql("snapshots", SnapshotVerb.DELETE, where="sandbox_id=$1")
_DELETE_OF_DELETED_SQL: Final = (_DELETE_OF_SANDBOX
                                 + f" AND NOT (pinned AND promotion = '{P.PROMOTED.value}')")
_DELETE_LOCAL_SQL: Final = _DELETE_OF_SANDBOX + f" AND {_NOT_PROMOTED}"
_START_PROMOTION_SQL: Final = _PROMOTION.update_sql("snapshots", PromotionVerb.START,
                                                    also="manifest=$2, promotion_error=NULL",
                                                    then=f"state='{S.READY.value}'", returning="id")
_PROMOTED_SQL: Final = _PROMOTION.update_sql(
    "snapshots", PromotionVerb.PROMOTED, also="promoted_at=now(), uploaded_bytes=$2, stored_bytes=$3",
    returning="id")
_FAIL_PROMOTION_SQL: Final = _PROMOTION.update_sql("snapshots", PromotionVerb.FAIL, also="promotion_error=$2")


async def insert(conn: Conn, snapshot_id: str, *, tenant_id: str, sandbox_id: str, node_id: str | None,
                 kind: str, parent_id: str | None, generation: int) -> None:
    """Insert a new snapshot row (``creating``); the node that takes it moves it on. ``kind``: ``disk`` or
    ``full`` (the schema's CHECK); ``parent_id``: the sandbox's newest ready snapshot, or None."""
    await conn.execute(INSERT_SQL, snapshot_id, tenant_id, sandbox_id, node_id, kind, parent_id, generation)


async def forget(conn: Conn, snapshot_id: str) -> None:
    """Remove a row just inserted (still ``creating``) that nothing will take: the transition it was made for
    was refused, in the same transaction."""
    await conn.execute(_FORGET_SQL, snapshot_id)


async def mark_ready(conn: Conn, snapshot_id: str, *, size_bytes: int, paused_ms: float) -> None:
    """``creating`` -> ``ready``: its files are complete (``size_bytes`` allocated on disk, the guest held
    ``paused_ms`` milliseconds); ``ready_at`` now. A row another writer moved first stays as it is."""
    await conn.execute(_READY_SQL, snapshot_id, size_bytes, paused_ms)


async def fail(conn: Conn, snapshot_id: str, error: str) -> None:
    """``creating`` -> ``failed`` with ``error`` (why, for the caller); a row in any other state stays."""
    await conn.execute(_FAIL_SQL, snapshot_id, error)


async def fail_interrupted(conn: Conn, node_id: str, error: str) -> list[asyncpg.Record]:
    """Every snapshot of node ``node_id`` still ``creating`` -> ``failed`` with ``error`` (a node agent
    restart interrupted it). Returns their rows (``id``, ``sandbox_id``)."""
    rows: list[asyncpg.Record] = await conn.fetch(_FAIL_NODE_SQL, node_id, error)
    return rows


async def delete(conn: Conn, snapshot_ids: Sequence[str]) -> None:
    """These snapshots -> ``deleted`` (no longer listed nor usable; their files and chunks go separately)."""
    await conn.execute(_DELETE_IDS_SQL, list(snapshot_ids))


async def delete_of_deleted_sandbox(conn: Conn, sandbox_id: str) -> None:
    """Every snapshot of a deleted sandbox -> ``deleted``, except pinned promoted ones: they stay ready,
    restorable from object storage (E2B's create_snapshot outlives its source)."""
    await conn.execute(_DELETE_OF_DELETED_SQL, sandbox_id)


async def delete_local_of_sandbox(conn: Conn, sandbox_id: str) -> None:
    """Every snapshot of a suspended sandbox that is not promoted -> ``deleted``: its files went with the
    node's; promoted ones stay restorable from object storage."""
    await conn.execute(_DELETE_LOCAL_SQL, sandbox_id)


async def move_to_node(conn: Conn, snapshot_id: str, node_id: str) -> str | None:
    """Record that snapshot ``snapshot_id``'s files are now on node ``node_id`` (a wake fetched them there).
    Returns its kind, or None when there is no such snapshot. Not a state change."""
    kind: str | None = await conn.fetchval("UPDATE snapshots SET node_id=$2 WHERE id=$1 RETURNING kind",
                                           snapshot_id, node_id)
    return kind


async def pin(conn: Conn, snapshot_id: str) -> Any:
    """Pin snapshot ``snapshot_id`` (retention and its sandbox's deletion keep it once promoted). Returns the
    node that holds its files, or None. Not a state change."""
    return await conn.fetchval("UPDATE snapshots SET pinned=true WHERE id=$1 RETURNING node_id", snapshot_id)


async def unpin(conn: Conn, snapshot_id: str) -> None:
    """Take a pin back: the snapshot serves while its source lives, as any other."""
    await conn.execute("UPDATE snapshots SET pinned=false WHERE id=$1", snapshot_id)


async def start_promotion(conn: Conn, snapshot_id: str, manifest: Mapping[str, Any]) -> str | None:
    """A ready snapshot not yet promoted -> ``promoting`` with its ``manifest`` (podbay.chunks); clears the
    last promotion error. Returns its id, or None when it is not ready or already promoted."""
    updated: str | None = await conn.fetchval(_START_PROMOTION_SQL, snapshot_id, manifest)
    return updated


async def mark_promoted(conn: Conn, snapshot_id: str, *, uploaded_bytes: int, stored_bytes: int) -> str | None:
    """``promoting`` -> ``promoted`` (``promoted_at`` now; bytes uploaded by this promotion, bytes stored for
    it). Returns its id, or None when it was not promoting."""
    marked: str | None = await conn.fetchval(_PROMOTED_SQL, snapshot_id, uploaded_bytes, stored_bytes)
    return marked


async def fail_promotion(conn: Conn, snapshot_id: str, error: str) -> None:
    """A promotion that did not finish -> ``failed`` with ``error``; a promoted snapshot stays promoted."""
    await conn.execute(_FAIL_PROMOTION_SQL, snapshot_id, error)
