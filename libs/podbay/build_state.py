"""The one writer of the state of template builds: the ``template_builds`` table (podbay's builds) and the
``e2b_template_builds`` table (E2B's build API over them), their transition tables and named statements.

- ``template_builds.state`` (:class:`~podbay.contracts.templates.BuildState`): born ``running`` on the node
  that builds it (:func:`insert_build`, the API's POST /v1/templates/{name}/build; the schema keeps at most
  one running build per name), then ``succeeded`` or ``failed`` (:func:`finish_build`, the node's build
  stream; :func:`fail_build`, the API finding it no longer runs or its stream cut;
  :func:`fail_interrupted_builds`, a node agent restart). Both outcomes are final.
- ``e2b_template_builds.state`` (:class:`~podbay.contracts.states.E2BBuildState`): born ``waiting``
  (:func:`insert_e2b_build`: POST /v3/templates), ``building`` once started (:func:`start_e2b_build`), then
  ``ready`` or ``error`` (:func:`finish_e2b_build`, :func:`fail_e2b_build`). Both outcomes are final.

Both columns are closed by a CHECK in the schema (libs/podbay/db/migrations/0040_build_state_checks.sql).
Every statement is fenced by the states its verb leaves (podbay.transitions), so a move that no longer
applies changes nothing. Every ``INSERT``/``UPDATE``/``DELETE`` of these tables in services/ and libs/ lives
here (tests/unit/test_build_state.py refuses others).

Every function takes a connection or a pool (``conn``): inside the caller's transaction when it passes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, Final

from podbay.contracts.states import E2BBuildState
from podbay.contracts.templates import BuildState
from podbay.transitions import Conn, TransitionTable

__all__ = [
    "BuildVerb", "E2BBuildVerb", "BUILD_TRANSITIONS", "E2B_TRANSITIONS", "next_build_state", "next_e2b_state",
    "insert_build", "finish_build", "fail_build", "fail_interrupted_builds", "insert_e2b_build",
    "start_e2b_build", "finish_e2b_build", "fail_e2b_build", "disown_builds",
]

B = BuildState
E = E2BBuildState


class BuildVerb(StrEnum):
    """What moves a podbay build."""

    FINISH = "finish"  # its outcome: succeeded or failed (the caller names it)


class E2BBuildVerb(StrEnum):
    """What moves an E2B build."""

    START = "start"    # its steps were sent to a node as a podbay build
    FINISH = "finish"  # that build succeeded
    FAIL = "fail"      # it could not start, or its build failed


#: ``(state, verb)`` -> the states it may go to.
BUILD_TRANSITIONS: Final[Mapping[tuple[BuildState, BuildVerb], frozenset[BuildState]]] = {
    (B.RUNNING, BuildVerb.FINISH): frozenset({B.SUCCEEDED, B.FAILED}),
}
#: ``(state, verb)`` -> the next state.
E2B_TRANSITIONS: Final[Mapping[tuple[E2BBuildState, E2BBuildVerb], E2BBuildState]] = {
    (E.WAITING, E2BBuildVerb.START): E.BUILDING,
    (E.BUILDING, E2BBuildVerb.FINISH): E.READY,
    (E.WAITING, E2BBuildVerb.FAIL): E.ERROR,
    (E.BUILDING, E2BBuildVerb.FAIL): E.ERROR,
}

_BUILD: Final = TransitionTable(BUILD_TRANSITIONS, states=BuildState,
                                refusal="a build that is {state} cannot {verb}")
_E2B: Final = TransitionTable(E2B_TRANSITIONS, states=E2BBuildState,
                              refusal="a template build that is {state} cannot {verb}")


def next_build_state(state: BuildState | str, verb: BuildVerb, to: BuildState | str) -> BuildState:
    """The state ``verb`` takes a build in ``state`` to (``to``: the outcome). Raises ``InvalidState`` (409)
    when it does not apply, ``ValueError`` for an unknown state."""
    return _BUILD.next_state(state, verb, to)


def next_e2b_state(state: E2BBuildState | str, verb: E2BBuildVerb) -> E2BBuildState:
    """The state ``verb`` takes an E2B build in ``state`` to. Raises ``InvalidState`` (409) when it does not
    apply, ``ValueError`` for an unknown state."""
    return _E2B.next_state(state, verb)


_INSERT_BUILD_SQL: Final = (
    "INSERT INTO template_builds (id, name, alias, tenant_id, node_id, dockerfile, parent, egress_policy,"
    f" owner_tenant, state) VALUES ($1,$2,$3,$4,$5,$6,$7,$8::jsonb,$9,'{B.RUNNING.value}')")
_FINISH_BUILD_SQL: Final = _BUILD.update_sql("template_builds", BuildVerb.FINISH, to="$2",
                                             also="digest=$3, error=$4::jsonb, finished_at=now()")
_FAIL_BUILD_SQL: Final = _BUILD.update_sql("template_builds", BuildVerb.FINISH, to=f"'{B.FAILED.value}'",
                                           also="error=$2::jsonb, finished_at=now()")
_FAIL_NODE_BUILDS_SQL: Final = _BUILD.update_sql("template_builds", BuildVerb.FINISH, to=f"'{B.FAILED.value}'",
                                                 also="finished_at=now(), error=$2::jsonb", where="node_id=$1")
_INSERT_E2B_SQL: Final = ("INSERT INTO e2b_template_builds (id, template, tenant_id, cpu_count, memory_mb, state)"
                          f" VALUES ($1, $2, $3, $4, $5, '{E.WAITING.value}')")
_START_E2B_SQL: Final = _E2B.update_sql("e2b_template_builds", E2BBuildVerb.START,
                                        also="podbay_build_id=$2, origins=$3")
_FINISH_E2B_SQL: Final = _E2B.update_sql("e2b_template_builds", E2BBuildVerb.FINISH, also="finished_at=now()")
_FAIL_E2B_SQL: Final = _E2B.update_sql("e2b_template_builds", E2BBuildVerb.FAIL,
                                       also="reason=$2::jsonb, finished_at=now()")
_FAIL_E2B_BUILDING_SQL: Final = _E2B.update_sql("e2b_template_builds", E2BBuildVerb.FAIL,
                                                also="reason=$2::jsonb, finished_at=now()", fence={E.BUILDING})


async def insert_build(conn: Conn, build_id: str, *, name: str, alias: str, tenant_id: str, node_id: str,
                       dockerfile: str, parent: str, egress_policy: Any, owner_tenant: str | None) -> None:
    """Insert a new build (``running``) of template key ``name`` (``alias``: the caller's name for it) on
    node ``node_id``; ``parent``: the FROM template's key or the OCI reference as written; ``egress_policy``
    (JSON) or None. Raises ``asyncpg.UniqueViolationError`` while a build of ``name`` runs."""
    await conn.execute(_INSERT_BUILD_SQL, build_id, name, alias, tenant_id, node_id, dockerfile, parent,
                       egress_policy, owner_tenant)


async def finish_build(conn: Conn, build_id: str, state: BuildState, digest: str | None,
                       error: Mapping[str, object] | None) -> str:
    """``running`` -> ``state`` (``succeeded`` with the template's ``digest``, or ``failed`` with ``error``
    as ``{code, message}``); ``finished_at`` now. A build that ended already stays. Returns the command
    status (``UPDATE 1`` when it moved). Raises ``InvalidState`` for a state that is not an outcome."""
    next_build_state(B.RUNNING, BuildVerb.FINISH, state)
    status: str = await conn.execute(_FINISH_BUILD_SQL, build_id, BuildState(state).value, digest, error)
    return status


async def fail_build(conn: Conn, build_id: str, error: Mapping[str, object]) -> bool:
    """``running`` -> ``failed`` with ``error`` (``{code, message}``). Returns whether it moved."""
    status = await conn.execute(_FAIL_BUILD_SQL, build_id, error)
    return bool(status == "UPDATE 1")


async def fail_interrupted_builds(conn: Conn, node_id: str, error: Mapping[str, object]) -> None:
    """Every ``running`` build of node ``node_id`` -> ``failed`` with ``error``: its agent restarted."""
    await conn.execute(_FAIL_NODE_BUILDS_SQL, node_id, error)


async def insert_e2b_build(conn: Conn, build_id: str, *, template: str, tenant_id: str, cpu_count: int | None,
                           memory_mb: int | None) -> None:
    """Insert a requested E2B build (``waiting``) of ``template`` with its resources (None: the defaults)."""
    await conn.execute(_INSERT_E2B_SQL, build_id, template, tenant_id, cpu_count, memory_mb)


async def start_e2b_build(conn: Conn, build_id: str, podbay_build_id: str, origins: Sequence[int]) -> None:
    """``waiting`` -> ``building`` as podbay build ``podbay_build_id``; ``origins``: E2B's step index of each
    podbay step (1-based podbay step n is E2B's ``origins[n-1]``)."""
    await conn.execute(_START_E2B_SQL, build_id, podbay_build_id, list(origins))


async def finish_e2b_build(conn: Conn, build_id: str) -> None:
    """``building`` -> ``ready`` (``finished_at`` now)."""
    await conn.execute(_FINISH_E2B_SQL, build_id)


async def fail_e2b_build(conn: Conn, build_id: str, reason: Mapping[str, object], *,
                         building_only: bool = False) -> None:
    """``waiting`` or ``building`` (only ``building`` with ``building_only``: the build's own failure) ->
    ``error`` with ``reason`` (``{message, step?}``); ``finished_at`` now."""
    await conn.execute(_FAIL_E2B_BUILDING_SQL if building_only else _FAIL_E2B_SQL, build_id, reason)


async def disown_builds(conn: Conn, tenant_id: str) -> None:
    """Tenant ``tenant_id``'s builds lose their owner (``owner_tenant``): not a state change."""
    await conn.execute("UPDATE template_builds SET owner_tenant=NULL WHERE owner_tenant=$1", tenant_id)
