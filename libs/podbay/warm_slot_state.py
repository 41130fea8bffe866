"""The one writer of the ``warm_slots`` table: which step takes a warm slot from which state to which, and the
named statements that take it.

A warm slot (docs/ARCHITECTURE.md, "Create from a warm pool") is a restored, stopped VM a create can claim. Its row is born
``preparing`` on its node (:func:`insert`), becomes ``ready`` once its guest answered, and ``claimed`` when
the API's warm claim takes it (a CTE of that claim's single round trip, services/api/services/warm.py, fenced on
``ready``). A slot that is not claimed ends ``failed`` (its VM died, its node was lost) or ``retired`` (taken
out of service on purpose); a claimed row belongs to its sandbox. The states are closed by a CHECK in the
schema (libs/podbay/db/migrations/0012_warm_retired.sql). :data:`TRANSITIONS` maps ``(state, verb)`` to the
next state. Rows leave the table by :func:`forget_node` (an agent's restart) and the pruning of
podbay-warmpool (:func:`prune_absent_nodes`, :func:`prune_old`), which are removals, not transitions.

Every function takes a connection or a pool (``conn``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Final

from podbay.contracts.states import WarmSlotState
from podbay.transitions import Conn, TransitionTable

__all__ = [
    "WarmSlotVerb", "TRANSITIONS", "BIRTH_STATE", "next_state", "sources", "INSERT_SQL", "insert", "mark_ready",
    "end", "fail_on_lost_node", "forget_node", "prune_absent_nodes", "prune_old",
]

W = WarmSlotState


class WarmSlotVerb(StrEnum):
    """What moves a warm slot."""

    READY = "ready"    # its guest answered; it is stopped and claimable
    CLAIM = "claim"    # a create took it (services/api/services/warm.py)
    FAIL = "fail"      # its VM died or could not be prepared, or its node was lost
    RETIRE = "retire"  # taken out of service on purpose (above target, a changed template)


BIRTH_STATE: Final = W.PREPARING
#: Every state but ``claimed``: a slot no sandbox owns yet.
_UNCLAIMED: Final = frozenset(set(W) - {W.CLAIMED})

#: ``(state, verb)`` -> the next state; a pair that is missing is not a transition.
TRANSITIONS: Final[Mapping[tuple[WarmSlotState, WarmSlotVerb], WarmSlotState]] = {
    (W.PREPARING, WarmSlotVerb.READY): W.READY,
    (W.READY, WarmSlotVerb.CLAIM): W.CLAIMED,
    **{(s, WarmSlotVerb.FAIL): W.FAILED for s in _UNCLAIMED},
    **{(s, WarmSlotVerb.RETIRE): W.RETIRED for s in _UNCLAIMED},
}

# ``state <> 'claimed'`` for the unclaimed states: stable SQL text.
_TABLE: Final = TransitionTable(TRANSITIONS, states=WarmSlotState, refusal="a warm slot that is {state} cannot {verb}",
                                complement_fence=True)


def next_state(state: WarmSlotState | str, verb: WarmSlotVerb) -> WarmSlotState:
    """The state ``verb`` takes a slot in ``state`` to. Raises ``InvalidState`` (409) when it does not apply,
    ``ValueError`` for an unknown state."""
    return _TABLE.next_state(state, verb)


def sources(verb: WarmSlotVerb) -> frozenset[WarmSlotState]:
    """The states ``verb`` leaves."""
    return _TABLE.sources(verb)


#: ``$1`` id, ``$2`` node, ``$3`` template name, ``$4`` its digest, ``$5`` memory MiB, ``$6`` vCPUs.
INSERT_SQL: Final = ("INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state)"
                     f" VALUES ($1,$2,$3,$4,$5,$6,'{BIRTH_STATE.value}')")
_READY_SQL: Final = _TABLE.update_sql("warm_slots", WarmSlotVerb.READY, also="ready_at=now()")
# A slot ends failed or retired (``$3``): both leave the same states.
_END_SQL: Final = _TABLE.update_sql("warm_slots", WarmSlotVerb.FAIL, to="$3", also="reason=$2, failed_at=now()")
_LOST_SQL: Final = _TABLE.update_sql("warm_slots", WarmSlotVerb.FAIL, also="reason=$2, failed_at=now()",
                                     where="node_id=$1", fence={W.PREPARING, W.READY})
_FORGET_NODE_SQL: Final = f"DELETE FROM warm_slots WHERE node_id=$1 AND {_TABLE.fence(_UNCLAIMED)}"
_PRUNE_ABSENT_SQL: Final = (f"DELETE FROM warm_slots WHERE {_TABLE.fence(_UNCLAIMED)}"
                            " AND NOT (node_id = ANY($1::text[]))")
_PRUNE_OLD_SQL: Final = (
    f"DELETE FROM warm_slots WHERE (state='{W.CLAIMED.value}' AND claimed_at < now() - make_interval(secs => $1))"
    f" OR (state IN ('{W.FAILED.value}', '{W.RETIRED.value}') AND failed_at < now() - make_interval(secs => $1))")


async def insert(conn: Conn, slot_id: str, *, node_id: str, template: str, template_digest: str,
                 memory_mib: int, vcpus: int) -> None:
    """Insert a new slot row (``preparing``) of ``template`` at ``template_digest`` on node ``node_id``."""
    await conn.execute(INSERT_SQL, slot_id, node_id, template, template_digest, memory_mib, vcpus)


async def mark_ready(conn: Conn, slot_id: str) -> None:
    """``preparing`` -> ``ready`` (``ready_at`` now): a claim may take it as soon as this commits."""
    await conn.execute(_READY_SQL, slot_id)


async def end(conn: Conn, slot_id: str, reason: str, *, state: WarmSlotState = W.FAILED) -> None:
    """An unclaimed slot -> ``failed`` or ``retired`` (``state``) with ``reason``; a claimed row belongs to its
    sandbox and stays. Raises ``ValueError`` for another ``state``."""
    if state not in (W.FAILED, W.RETIRED):
        raise ValueError(f"a warm slot ends failed or retired, not {state}")
    await conn.execute(_END_SQL, slot_id, reason, WarmSlotState(state).value)


async def fail_on_lost_node(conn: Conn, node_id: str, reason: str) -> None:
    """Every ``preparing`` or ``ready`` slot of lost node ``node_id`` -> ``failed`` with ``reason``."""
    await conn.execute(_LOST_SQL, node_id, reason)


async def forget_node(conn: Conn, node_id: str) -> None:
    """Remove node ``node_id``'s unclaimed slots (an earlier run of its agent); claimed rows stay."""
    await conn.execute(_FORGET_NODE_SQL, node_id)


async def prune_absent_nodes(conn: Conn, live_nodes: Sequence[str]) -> None:
    """Remove the unclaimed slots of every node not in ``live_nodes`` (they have no VM anywhere)."""
    await conn.execute(_PRUNE_ABSENT_SQL, list(live_nodes))


async def prune_old(conn: Conn, window_s: float) -> None:
    """Remove claimed, failed and retired rows older than ``window_s`` seconds (kept that long for the
    pool's counts and the claim's fallback)."""
    await conn.execute(_PRUNE_OLD_SQL, window_s)
