"""A state table's transitions, shared by the modules that own one table's state column each
(podbay.snapshot_state, operation_state, warm_slot_state, schedule_run_state, build_state, volume_state).

A :class:`TransitionTable` holds the legal moves of one column as ``(state, verb) -> next state`` (or a set of
next states, when the caller names the outcome, as a schedule run's finish does), and derives from it:

- :meth:`~TransitionTable.next_state`: the move, or ``InvalidState`` (HTTP 409, code ``invalid_state``) for
  a pair that is not in the table and ``ValueError`` for a state the enum does not name;
- :meth:`~TransitionTable.sources` / :meth:`~TransitionTable.target`: what a verb leaves and where it goes;
- :meth:`~TransitionTable.fence` / :meth:`~TransitionTable.update_sql`: the guarded statement of a move, as
  SQL text: ``UPDATE t SET state='to', ... WHERE <key> AND state IN (<the verb's sources>) [RETURNING ...]``.
  The fence makes a move that no longer applies change nothing (a row another writer moved first is not
  overwritten); the state names in the text come from the enum, sorted, so the text is stable.

The owners keep their statements as module constants built here once, at import; the schema's CHECK on the
column (one per table, libs/podbay/db/migrations/) refuses a state the enum does not name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Generic, TypeAlias, TypeVar

import asyncpg

from podbay.errors import InvalidState

__all__ = ["Conn", "TransitionTable", "in_sql"]

#: A connection (the caller's transaction) or a pool: what every owner's statement runs on.
Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool

St = TypeVar("St", bound=StrEnum)
V = TypeVar("V", bound=StrEnum)


def in_sql(column: str, states: Iterable[StrEnum | str]) -> str:
    """``column='a'`` or ``column IN ('a', 'b')`` (values sorted: stable SQL text). Raises ``ValueError`` for
    no states. The values are enum members' (never a caller's input)."""
    values = sorted({str(s) for s in states})
    if not values:
        raise ValueError(f"{column}: no states to fence on")
    if len(values) == 1:
        return f"{column}='{values[0]}'"
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


class TransitionTable(Generic[St, V]):
    """The legal moves of one state column.

    ``moves``: ``(state, verb) -> next state`` or ``-> frozenset of next states`` (the caller names the one);
    a missing pair is not a move. ``states``: the column's enum. ``refusal``: the message of a refused move,
    with ``{state}`` and ``{verb}`` in it (``"a snapshot that is {state} cannot {verb}"``); a refused named
    outcome adds `` to <outcome>``.
    ``column``: the state column (and the key of ``details`` in a refusal). ``complement_fence``: fence a set
    that is every state but one as ``column <> 'x'`` (a shorter text for the same rows: the column is NOT NULL).
    """

    def __init__(self, moves: Mapping[tuple[St, V], St | frozenset[St]], *, states: type[St], refusal: str,
                 column: str = "state", complement_fence: bool = False) -> None:
        self.moves = moves
        self.states = states
        self.refusal = refusal
        self.column = column
        self.complement_fence = complement_fence

    def targets(self, state: St, verb: V) -> frozenset[St]:
        """Where ``verb`` may take a row in ``state`` (empty: nowhere)."""
        to = self.moves.get((state, verb))
        if to is None:
            return frozenset()
        return to if isinstance(to, frozenset) else frozenset({to})

    def next_state(self, state: St | str, verb: V, to: St | str | None = None) -> St:
        """The state ``verb`` takes a row in ``state`` to (``to``: the one the caller names, where the verb may
        go to several). Raises ``InvalidState`` (409) when it does not apply, ``ValueError`` for an unknown
        state."""
        st = self.states(state)
        targets = self.targets(st, verb)
        target = self.states(to) if to is not None else (next(iter(targets)) if len(targets) == 1 else None)
        if target is None or target not in targets:
            raise InvalidState(self.refusal.format(state=st.value, verb=verb.value)
                               + (f" to {target.value}" if target is not None else ""),
                               details={self.column: st.value, "verb": verb.value})
        return target

    def sources(self, verb: V) -> frozenset[St]:
        """The states ``verb`` leaves."""
        return frozenset(s for (s, v) in self.moves if v == verb)

    def target(self, verb: V) -> St:
        """The one state ``verb`` takes every source to. Raises ``ValueError`` when it goes to several (the
        caller names the outcome: set the column from a placeholder instead)."""
        found: set[St] = set()
        for (_, v), to in self.moves.items():
            if v == verb:
                found |= to if isinstance(to, frozenset) else {to}
        if len(found) != 1:
            raise ValueError(f"{verb.value} goes to {sorted(found)}, not one state")
        return next(iter(found))

    def fence(self, states: Iterable[St]) -> str:
        """The WHERE condition ``states`` make on the column (see :func:`in_sql`, ``complement_fence``)."""
        chosen = frozenset(states)
        rest = set(self.states) - chosen
        if self.complement_fence and len(chosen) > 1 and len(rest) == 1:
            return f"{self.column} <> '{next(iter(rest)).value}'"
        return in_sql(self.column, chosen)

    def set_to(self, verb: V) -> str:
        """``column='target'``: the SET of ``verb``'s one target."""
        return f"{self.column}='{self.target(verb).value}'"

    def update_sql(self, table: str, verb: V, *, where: str = "id=$1", also: str = "", then: str = "",
                   to: str | None = None, fence: Iterable[St] | None = None, returning: str = "") -> str:
        """The guarded UPDATE of ``table`` for ``verb``, as SQL text:
        ``UPDATE table SET column=<to>[, also] WHERE where AND <fence>[ AND then][ RETURNING returning]``.

        ``to``: a SQL expression for the new state (a placeholder, where the caller names the outcome);
        default the verb's one target, as a literal. ``fence``: the states it leaves (default: the verb's
        sources). ``also``: more of the SET clause; ``then``: more conditions after the fence. Every argument
        is SQL text the owner writes (never a caller's input)."""
        sets = self.set_to(verb) if to is None else f"{self.column}={to}"
        if also:
            sets += f", {also}"
        cond = f"{where} AND {self.fence(self.sources(verb) if fence is None else fence)}"
        if then:
            cond += f" AND {then}"
        return f"UPDATE {table} SET {sets} WHERE {cond}" + (f" RETURNING {returning}" if returning else "")
