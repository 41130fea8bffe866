"""The one writer of the ``operations`` table: which step takes an operation from which state to which, and the
named statements that take it.

An operation row (``GET /v1/operations/{id}``) is born ``pending`` (a command sent), ``running`` (a warm claim, a
drain's migration) or already finished; its ``state`` (:class:`~podbay.contracts.states.OperationState`) is
closed by a CHECK in the schema (libs/podbay/db/migrations/0039_operations_state_check.sql).
:data:`TRANSITIONS` maps ``(state, verb)`` to the next state: ``succeeded`` is final; a failed operation may
still succeed or fail again (a command JetStream redelivers), and one that has not succeeded may go back to
``pending`` (a create the scheduler places again after a warm fallback or a lost node).

The named statements below are fenced in SQL by the states their step leaves. podbay.lifecycle
(``outcome_sql``, ``OperationOutcome``) records a sandbox operation's outcome with the sandbox's transition, in
the same statement order; its callers choose its fences. Every ``INSERT``/``UPDATE`` of ``operations`` in services/ and libs/ lives here or on the short
allow-list of tests/unit/test_operation_state.py.

Every function takes a connection or a pool (``conn``): inside the caller's transaction when it passes one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Final

import asyncpg

from podbay.contracts.states import OperationState
from podbay.transitions import Conn, TransitionTable

__all__ = [
    "OperationVerb", "TRANSITIONS", "next_state", "sources", "INSERT_SQL", "insert", "start",
    "succeed", "fail", "fail_in_flight", "fail_in_flight_of", "set_progress",
]

Op = OperationState


class OperationVerb(StrEnum):
    """What moves an operation."""

    START = "start"      # a worker took it up (the scheduler placed it, a drain began)
    REQUEUE = "requeue"  # back to the scheduler (a warm claim fell back, its node was lost)
    SUCCEED = "succeed"
    FAIL = "fail"


_UNFINISHED: Final = frozenset({Op.PENDING, Op.RUNNING, Op.FAILED})

#: ``(state, verb)`` -> the next state; a pair that is missing is not a transition.
TRANSITIONS: Final[Mapping[tuple[OperationState, OperationVerb], OperationState]] = {
    (Op.PENDING, OperationVerb.START): Op.RUNNING,
    **{(s, OperationVerb.REQUEUE): Op.PENDING for s in _UNFINISHED},
    **{(s, OperationVerb.SUCCEED): Op.SUCCEEDED for s in _UNFINISHED},
    **{(s, OperationVerb.FAIL): Op.FAILED for s in _UNFINISHED},
}

_TABLE: Final = TransitionTable(TRANSITIONS, states=OperationState, refusal="an operation that {state} cannot {verb}")


def next_state(state: OperationState | str, verb: OperationVerb) -> OperationState:
    """The state ``verb`` takes an operation in ``state`` to. Raises ``InvalidState`` (409) when it does not
    apply, ``ValueError`` for an unknown state."""
    return _TABLE.next_state(state, verb)


def sources(verb: OperationVerb) -> frozenset[OperationState]:
    """The states ``verb`` leaves."""
    return _TABLE.sources(verb)


#: The INSERT of a new operation: ``$1`` id, ``$2`` tenant, ``$3`` sandbox (or None), ``$4`` kind, ``$5``
#: state, ``$6`` node (or None), ``$7`` finished (``finished_at`` now when true).
INSERT_SQL: Final = ("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state, node_id, finished_at)"
                     " VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $7::boolean THEN now() END)")
_START_SQL: Final = _TABLE.update_sql("operations", OperationVerb.START)
_SUCCEED_SQL: Final = _TABLE.update_sql("operations", OperationVerb.SUCCEED, also="finished_at=now()")
_SUCCEED_DATA_SQL: Final = _TABLE.update_sql("operations", OperationVerb.SUCCEED, also="finished_at=now(), data=$2")
_FAILED: Final = "error_code=$3, error_message=$2, finished_at=now()"
_FAIL_SQL: Final = _TABLE.update_sql("operations", OperationVerb.FAIL, also=_FAILED)
_IN_FLIGHT: Final = frozenset({Op.PENDING, Op.RUNNING})
_FAIL_IN_FLIGHT_SQL: Final = _TABLE.update_sql("operations", OperationVerb.FAIL, also=_FAILED,
                                               where="sandbox_id=$1", fence=_IN_FLIGHT)
_FAIL_IN_FLIGHT_OF_SQL: Final = _TABLE.update_sql("operations", OperationVerb.FAIL, also=_FAILED, where="kind=$4",
                                                  fence=_IN_FLIGHT, then="sandbox_id = ANY($1::text[])",
                                                  returning="id")


async def insert(conn: Conn, operation_id: str, *, tenant_id: str, kind: str, sandbox_id: str | None = None,
                 state: OperationState = Op.PENDING, node_id: str | None = None, finished: bool = False) -> None:
    """Insert a new operation row (``kind``: the command, e.g. ``pause``, ``drain``) in ``state``; ``finished``:
    it is done already (``finished_at`` now)."""
    await conn.execute(INSERT_SQL, operation_id, tenant_id, sandbox_id, kind, OperationState(state).value, node_id,
                       finished)


async def start(conn: Conn, operation_id: str) -> None:
    """``pending`` -> ``running``; an operation in any other state stays."""
    await conn.execute(_START_SQL, operation_id)


async def succeed(conn: Conn, operation_id: str, *, data: Mapping[str, Any] | None = None) -> None:
    """-> ``succeeded`` (``finished_at`` now; ``data``: the outcome's figures, when given); a succeeded
    operation stays as it is."""
    if data is None:
        await conn.execute(_SUCCEED_SQL, operation_id)
    else:
        await conn.execute(_SUCCEED_DATA_SQL, operation_id, data)


async def fail(conn: Conn, operation_id: str, error_code: str, error_message: str) -> None:
    """-> ``failed`` with ``error_code`` (machine-readable) and ``error_message`` (``finished_at`` now); a
    succeeded operation stays succeeded."""
    await conn.execute(_FAIL_SQL, operation_id, error_message, error_code)


async def fail_in_flight(conn: Conn, sandbox_id: str, error_code: str, error_message: str) -> None:
    """Every ``pending`` or ``running`` operation of sandbox ``sandbox_id`` -> ``failed`` (its node was lost:
    what was in flight there will not finish)."""
    await conn.execute(_FAIL_IN_FLIGHT_SQL, sandbox_id, error_message, error_code)


async def fail_in_flight_of(conn: Conn, sandbox_ids: Sequence[str] | Iterable[str], kind: str, error_code: str,
                            error_message: str) -> list[asyncpg.Record]:
    """Every ``pending`` or ``running`` operation of ``kind`` of these sandboxes -> ``failed``. Returns their
    rows (``id``)."""
    rows: list[asyncpg.Record] = await conn.fetch(_FAIL_IN_FLIGHT_OF_SQL, list(sandbox_ids), error_message,
                                                  error_code, kind)
    return rows


async def set_progress(conn: Conn, operation_id: str, progress: Mapping[str, Any] | str) -> None:
    """Record a long operation's progress (a drain's counts, as JSON). Not a state change."""
    await conn.execute("UPDATE operations SET progress=$2 WHERE id=$1", operation_id, progress)
