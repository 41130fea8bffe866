"""The sandbox lifecycle core: which verb takes a sandbox from which state to which, and the one function that
applies such a transition in the caller's transaction.

Shapes (docs/ARCHITECTURE.md, "Lifecycle"):

- :data:`TRANSITIONS` maps ``(state, verb)`` to the next state. The verbs that answer a client command
  (pause, resume, suspend, restore, delete) take their source states from ``podbay.contracts.states.ALLOWED``,
  so the gate that refuses a command (HTTP 409) and the transition it leads to cannot disagree. The other
  verbs are the services' own steps (the scheduler places, the node reports a start, a node is lost...).
- :func:`apply` writes one transition: a conditional ``UPDATE sandboxes`` fenced by state, and when given,
  generation and node; then, only when the row matched, the operation row (inserted, or its outcome
  recorded), the sandbox event (through the outbox, in the same transaction) and the audit record, in that
  order (so the events reach JetStream in the order they always did). It returns the updated row, or None
  when the fence refused (someone else moved the sandbox first).
- :func:`update_sql` is the UPDATE itself as SQL text over caller-named placeholders, and
  :func:`outcome_sql` the operation's outcome, for the few statements that must stay one round trip (the
  node's warm start, services/nodeagent/ops/warm.py): they compose them rather than copy them.
- :func:`insert` writes a new sandbox row (born ``pending``, ``starting`` or ``suspended``) with its
  operation, ``created`` event and audit record; :func:`insert_sql` is that INSERT as SQL text, which the
  warm claim (services/api/services/warm.py ``CLAIM_SQL``) composes to stay one round trip. Both own what every new
  row shares: the state, ``desired_state`` running, the hostname (podbay.naming) and a lease that runs
  from now.
- Leases (:func:`renew_lease`, :func:`renew_lease_sql` to compose, :func:`set_lease`, :func:`expire_lease`,
  :func:`copy_lease_action`): not state changes, but what makes the node pause or delete an idle sandbox,
  written from several places.

Every ``UPDATE sandboxes`` and ``INSERT INTO sandboxes`` in services/ and libs/ lives here, or on the short
allow-lists of tests/unit/test_lifecycle.py, which say why for each entry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import asyncpg

from podbay.contracts.events import EventType
from podbay.audit import record
from podbay.contracts.states import ALLOWED, OperationState, SandboxCommand, SandboxState
from podbay.errors import Conflict, InvalidState
from podbay.naming import sandbox_hostname_sql
from podbay.outbox import emit_sandbox_event
from podbay import snapshot_state
from podbay import operation_state
from podbay.transitions import TransitionTable

__all__ = [
    "Verb", "TRANSITIONS", "next_state", "sources", "targets", "update_sql", "outcome_sql", "apply", "renew_lease",
    "renew_lease_sql", "renew_leases_sql", "insert_sql", "insert", "BIRTH_STATES", "set_lease", "expire_lease", "copy_lease_action", "forget_suspended_snapshot", "suspend",
    "starting_from_snapshots",
    "LEASE_RENEWAL", "LEASE_CHANNEL", "notify_lease",
    "NewOperation", "OperationOutcome", "SandboxEvent", "AuditRecord", "ANY_NODE", "KEEP",
]

S = SandboxState


class Verb(StrEnum):
    """What moves a sandbox. Client commands share their names with ``SandboxCommand``."""

    PLACE = "place"                    # the scheduler chose a node (a wake stays resuming until it runs)
    REQUEUE = "requeue"                # back to the scheduler without a node (warm fallback, node lost)
    STARTED = "started"                # the node has the guest running (create, restore, wake)
    PAUSE = "pause"
    RESUME = "resume"                  # paused: continue in memory; suspended: wake from object storage
    SUSPEND = "suspend"
    SUSPENDED = "suspended"            # the full snapshot is promoted; the VM is gone
    SUSPEND_FAILED = "suspend_failed"  # the promotion failed: the sandbox stays, paused
    WAKE_FAILED = "wake_failed"        # a wake that could not restore: the snapshot is intact
    RESCHEDULE = "reschedule"          # its node was lost; restore its newest promoted snapshot elsewhere
    RESTORE = "restore"                # roll back to one of its snapshots (a new generation)
    MOVE = "move"                      # live migration to another node: same state, new node and generation
    FENCE = "fence"                    # a new generation, nothing else (a migration given up)
    DELETE = "delete"
    DELETED = "deleted"
    FAIL = "fail"


#: States a sandbox is alive in: it can still fail.
_LIVE: Final = frozenset({S.PENDING, S.STARTING, S.RUNNING, S.PAUSED, S.SUSPENDING, S.RESUMING})


def _table() -> dict[tuple[SandboxState, Verb], SandboxState]:
    def every(states: Iterable[SandboxState], verb: Verb, to: SandboxState | None) -> dict[tuple[S, Verb], S]:
        """``to`` None: the verb keeps the state."""
        return {(s, verb): (s if to is None else to) for s in states}

    resume = ALLOWED[SandboxCommand.RESUME]
    return {
        **every({S.PENDING}, Verb.PLACE, S.STARTING),
        **every({S.RESUMING}, Verb.PLACE, None),
        **every({S.PENDING, S.STARTING}, Verb.REQUEUE, S.PENDING),
        **every({S.STARTING, S.RESUMING}, Verb.STARTED, S.RUNNING),
        **every(ALLOWED[SandboxCommand.PAUSE], Verb.PAUSE, S.PAUSED),
        **every(resume - {S.SUSPENDED}, Verb.RESUME, S.RUNNING),
        **every(resume & {S.SUSPENDED}, Verb.RESUME, S.RESUMING),
        **every(ALLOWED[SandboxCommand.SUSPEND], Verb.SUSPEND, S.SUSPENDING),
        **every({S.SUSPENDING}, Verb.SUSPENDED, S.SUSPENDED),
        **every({S.SUSPENDING}, Verb.SUSPEND_FAILED, S.PAUSED),
        **every({S.RESUMING}, Verb.WAKE_FAILED, S.SUSPENDED),
        **every(_LIVE - {S.SUSPENDING}, Verb.RESCHEDULE, S.RESUMING),
        **every(ALLOWED[SandboxCommand.RESTORE], Verb.RESTORE, S.STARTING),
        **every({S.RUNNING, S.PAUSED}, Verb.MOVE, None),
        **every(set(S) - {S.DELETED}, Verb.FENCE, None),
        **every(ALLOWED[SandboxCommand.DELETE], Verb.DELETE, S.DELETING),
        **every(ALLOWED[SandboxCommand.DELETE], Verb.DELETED, S.DELETED),
        **every(_LIVE, Verb.FAIL, S.FAILED),
    }


#: ``(state, verb)`` -> the next state; a pair that is missing is not a transition.
TRANSITIONS: Final[Mapping[tuple[SandboxState, Verb], SandboxState]] = _table()


_TABLE: Final = TransitionTable(TRANSITIONS, states=SandboxState, refusal="cannot {verb} a sandbox that is {state}")


def next_state(state: SandboxState | str, verb: Verb) -> SandboxState:
    """The state ``verb`` takes a sandbox in ``state`` to. Raises ``InvalidState`` (409) when it does not apply."""
    return _TABLE.next_state(state, verb)


def sources(verb: Verb) -> frozenset[SandboxState]:
    """The states ``verb`` applies in."""
    return _TABLE.sources(verb)


def targets(verb: Verb, states: Iterable[SandboxState | str] | None = None) -> SandboxState | None:
    """The one state ``verb`` takes every one of ``states`` (default: all it applies in) to, or None when it
    keeps each in its own state. Raises ``ValueError`` when the states would go different ways (such an
    UPDATE could not name one new state), ``InvalidState`` when one of them is not a source of ``verb``."""
    froms = sources(verb) if states is None else {SandboxState(s) for s in states}
    if not froms:
        raise ValueError(f"{verb.value}: no source state")
    nexts = {next_state(s, verb) for s in froms}
    if all(next_state(s, verb) == s for s in froms):
        return None
    if len(nexts) != 1:
        raise ValueError(f"{verb.value} takes {sorted(froms)} to different states {sorted(nexts)}")
    return nexts.pop()


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: ``node`` fence: no condition on the node.
ANY_NODE: Final = _Sentinel("ANY_NODE")
#: ``set_node``: the node stays.
KEEP: Final = _Sentinel("KEEP")

#: The SET clause of a lease renewal: the lease runs its whole length again from now.
LEASE_RENEWAL: Final = "lease_expires_at = now() + make_interval(secs => lease_s)"

_COLUMN = re.compile(r"^[a-z_]+$")
#: Columns a transition may set besides state, node and generation (the rest belong to other owners).
_SETTABLE: Final = frozenset({"failure_reason", "desired_state", "suspended_snapshot_id", "event_seq"})


def update_sql(verb: Verb, states: Iterable[SandboxState | str] | None, *, sandbox: str = "$1",
               generation: str | None = None, node: str | None = None, node_is_null: bool = False,
               set_node: str | None = None, new_generation: str | None = None,
               values: Mapping[str, str] | None = None, renew_lease: bool = False,
               returning: str = "id") -> str:
    """The fenced UPDATE of one sandbox row for ``verb`` from ``states``, as SQL text.

    Every argument but ``verb``, ``states`` and the flags is a SQL expression, usually a placeholder the caller
    numbers (``"$2"``): ``sandbox`` the id; fences ``generation``, ``node`` (never NULL: say ``node_is_null``
    for a sandbox without a node); ``states``
    None puts no condition on the state (the caller holds the row locked and checked it). Changes:
    ``set_node`` (``"NULL"`` to clear it), ``new_generation`` (``"generation+1"`` or a placeholder),
    ``values`` (column -> expression; only ``failure_reason``, ``desired_state``, ``suspended_snapshot_id``,
    ``event_seq``), ``renew_lease``. The new state comes from :data:`TRANSITIONS`; entering ``deleting``
    also sets ``desired_state``, entering ``deleted`` sets ``deleted_at``; ``updated_at`` is always now.
    Raises ``ValueError`` for a column it does not own, ``InvalidState`` for a state the verb does not leave.
    """
    froms = None if states is None else sorted({SandboxState(s) for s in states})
    target = targets(verb, froms)
    sets: list[str] = []
    if target is not None:
        sets.append(f"state='{target.value}'")
    if target == S.DELETING:
        sets.append("desired_state='deleted'")
    for col, expr in (values or {}).items():
        if col not in _SETTABLE or not _COLUMN.match(col):
            raise ValueError(f"a transition does not set sandboxes.{col}")
        sets.append(f"{col}={expr}")
    if set_node is not None:
        sets.append(f"node_id={set_node}")
    if new_generation is not None:
        sets.append(f"generation={new_generation}")
    if target == S.DELETED:
        sets.append("deleted_at=now()")
    if renew_lease:
        sets.append(LEASE_RENEWAL)
    sets.append("updated_at=now()")
    where = [f"id={sandbox}"]
    if froms is not None:
        where.append(_TABLE.fence(froms))
    if generation is not None:
        where.append(f"generation={generation}")
    if node_is_null:
        where.append("node_id IS NULL")
    elif node is not None:
        where.append(f"node_id={node}")
    return f"UPDATE sandboxes SET {', '.join(sets)} WHERE {' AND '.join(where)} RETURNING {returning}"


@dataclass(frozen=True)
class NewOperation:
    """An operation row the transition starts (``finished``: it is done already, ``finished_at`` now)."""

    id: str
    tenant_id: str
    kind: str
    state: OperationState = OperationState.PENDING
    finished: bool = False


@dataclass(frozen=True)
class OperationOutcome:
    """What the transition records on an existing operation row.

    ``error_code``/``error_message``: KEEP leaves them, None clears them. ``finished``: True sets
    ``finished_at`` now, False clears it, None leaves it. ``only_from``: only a row in one of these states
    changes. ``unless_succeeded``: a succeeded row stays. ``always``: record it even when the fence refused.
    """

    id: str
    state: OperationState
    error_code: str | None | _Sentinel = KEEP
    error_message: str | None | _Sentinel = KEEP
    finished: bool | None = True
    only_from: tuple[OperationState, ...] = ()
    unless_succeeded: bool = False
    always: bool = False


@dataclass(frozen=True)
class SandboxEvent:
    """The sandbox event the transition emits (podbay.outbox.emit_sandbox_event); its ``state`` is the new
    state. ``new_generation``: the event carries the generation the UPDATE wrote (instead of ``generation``)."""

    type: EventType
    reason: str | None = None
    node_id: str | None = None
    tenant_id: str | None = None
    generation: int | None = None
    new_generation: bool = False
    data: dict[str, Any] | None = None


@dataclass(frozen=True)
class AuditRecord:
    """The audit record of the call that caused the transition (podbay.audit.record), about this sandbox."""

    tenant_id: str
    actor: str
    action: str
    detail: dict[str, Any] | None = None


async def apply(
    conn: asyncpg.Connection,
    sandbox_id: str,
    verb: Verb,
    *,
    states: SandboxState | str | Iterable[SandboxState | str] | None,
    generation: int | None = None,
    node: str | None | _Sentinel = ANY_NODE,
    set_node: str | None | _Sentinel = KEEP,
    bump_generation: bool = False,
    new_generation: int | None = None,
    values: Mapping[str, object] | None = None,
    renew_lease: bool = False,
    operation: NewOperation | OperationOutcome | None = None,
    event: SandboxEvent | None = None,
    audit: AuditRecord | None = None,
) -> asyncpg.Record | None:
    """Apply ``verb`` to sandbox ``sandbox_id`` inside the caller's transaction (``conn`` must be in one).

    Fences: ``states`` (one state, several, or None for no condition when the caller holds the row locked
    after checking it), ``generation``, ``node`` (a node id, or None: it has none; ``ANY_NODE``: no
    condition). Changes: the state :data:`TRANSITIONS` names, ``set_node`` (None clears it),
    ``bump_generation`` or ``new_generation``, ``values`` (``failure_reason``, ``desired_state``,
    ``suspended_snapshot_id``), ``renew_lease``. Then, when the row matched: ``operation``, ``event``,
    ``audit``, in that order (an ``OperationOutcome`` with ``always`` is recorded even when it did not).

    Returns the updated row (``id, tenant_id, state, node_id, generation, updated_at``, new values), or None
    when the fence refused. Raises ``InvalidState`` when ``verb`` does not apply to ``states``. Call
    ``Relay.kick()`` after the commit when an event or audit record was written.
    """
    froms: list[SandboxState] | None
    if states is None:
        froms = None
    elif isinstance(states, str):
        froms = [SandboxState(states)]
    else:
        froms = [SandboxState(s) for s in states]
    args: list[object] = [sandbox_id]

    def param(value: object) -> str:
        args.append(value)
        return f"${len(args)}"

    gen_expr = "generation+1" if bump_generation else (
        None if new_generation is None else param(new_generation) + "::integer")
    sql = update_sql(
        verb, froms, sandbox="$1",
        generation=None if generation is None else param(generation),
        node=None if node is ANY_NODE or node is None else param(node), node_is_null=node is None,
        set_node=None if set_node is KEEP else ("NULL" if set_node is None else param(set_node)),
        new_generation=gen_expr,
        values={col: param(v) for col, v in (values or {}).items()},
        renew_lease=renew_lease,
        returning="id, tenant_id, state, node_id, generation, updated_at")
    row: asyncpg.Record | None = await conn.fetchrow(sql, *args)
    if isinstance(operation, OperationOutcome) and (row is not None or operation.always):
        await _record_outcome(conn, operation)
    if row is None:
        return None
    if isinstance(operation, NewOperation):
        await _start_operation(conn, sandbox_id, operation)
    if event is not None:
        await emit_sandbox_event(
            conn, sandbox_id, event.type, state=row["state"], reason=event.reason, node_id=event.node_id,
            tenant_id=event.tenant_id, generation=row["generation"] if event.new_generation else event.generation,
            data=event.data)
    if audit is not None:
        await record(conn, tenant_id=audit.tenant_id, actor=audit.actor, action=audit.action, target=sandbox_id,
                     sandbox_id=sandbox_id, detail=audit.detail)
    return row


#: States a sandbox row is born in: ``pending`` (a create the scheduler places), ``starting`` (a warm claim
#: or a fork child, already on its node), ``suspended`` (a new sandbox woken from a stored snapshot).
BIRTH_STATES: Final = frozenset({S.PENDING, S.STARTING, S.SUSPENDED})
#: Columns a caller gives a new row; state, desired_state, hostname and lease_expires_at are this module's.
_INSERTABLE: Final = frozenset({
    "id", "tenant_id", "template", "template_digest", "node_id", "generation", "memory_mib", "vcpus", "disk_mib",
    "metadata", "lease_s", "lease_action", "event_seq", "egress_policy", "guest_env", "parent_sandbox_id",
    "source_snapshot_id", "suspended_snapshot_id",
})


def insert_sql(state: SandboxState | str, values: Mapping[str, str], *, select_from: str | None = None,
               returning: str = "id") -> str:
    """The INSERT of one new sandbox row born in ``state`` (one of :data:`BIRTH_STATES`), as SQL text.

    ``values`` maps columns to SQL expressions, usually placeholders the caller numbers (``"$2"``); ``id`` is
    required. Added here: ``state``, ``desired_state`` ``'running'``, ``hostname`` (podbay.naming's rule over
    the ``id`` expression) and, when ``lease_s`` is given, ``lease_expires_at`` (now plus the lease).
    ``select_from``: None inserts ``VALUES``; else the row is ``SELECT``-ed ``FROM`` it (a FROM list and
    conditions, e.g. ``"slot, t"``), and the expressions may name its columns. Raises ``ValueError`` for a
    column it does not take or without ``id``, ``InvalidState`` for a state no sandbox is born in.
    """
    born = SandboxState(state)
    if born not in BIRTH_STATES:
        raise InvalidState(f"no sandbox is born {born.value}", details={"state": born.value})
    if "id" not in values:
        raise ValueError("a new sandbox row needs its id")
    cols: dict[str, str] = {}
    for col, expr in values.items():
        if col not in _INSERTABLE or not _COLUMN.match(col):
            raise ValueError(f"a new sandbox row does not take sandboxes.{col}")
        cols[col] = expr
    cols["state"] = f"'{born.value}'"
    cols["desired_state"] = "'running'"
    cols["hostname"] = sandbox_hostname_sql(values["id"])
    if "lease_s" in values:
        cols["lease_expires_at"] = f"now() + {values['lease_s']}::integer * interval '1 second'"
    head = f"INSERT INTO sandboxes ({', '.join(cols)}) "
    body = (f"VALUES ({', '.join(cols.values())})" if select_from is None
            else f"SELECT {', '.join(cols.values())} FROM {select_from}")
    return head + body + f" RETURNING {returning}"


async def insert(
    conn: asyncpg.Connection,
    state: SandboxState | str,
    values: Mapping[str, object],
    *,
    exprs: Mapping[str, str] | None = None,
    select_from: str | None = None,
    operation: NewOperation | None = None,
    event: SandboxEvent | None = None,
    audit: AuditRecord | None = None,
) -> asyncpg.Record | None:
    """Insert a new sandbox row born in ``state`` inside the caller's transaction, then ``operation`` (about
    this sandbox), ``event`` (its ``state`` is ``state``) and ``audit``, in that order.

    ``values``: column -> Python value, each passed as a parameter. ``exprs``: column -> SQL expression, in
    which ``{column}`` stands for the parameter of that column of ``values`` (e.g. the credential env over
    ``{tenant_id}``, ``{id}``, ``{template}``). ``select_from`` as in :func:`insert_sql`, where ``{column}``
    works too. Returns the row (``id, tenant_id, state, node_id, generation, updated_at``), or None when a
    ``select_from`` selected nothing (nothing else is then written). Raises as :func:`insert_sql`.
    """
    names = {col: f"${i}" for i, col in enumerate(values, start=1)}
    sql_values = dict(names)
    sql_values.update({col: expr.format_map(names) for col, expr in (exprs or {}).items()})
    sql = insert_sql(state, sql_values, select_from=None if select_from is None else select_from.format_map(names),
                     returning="id, tenant_id, state, node_id, generation, updated_at")
    row: asyncpg.Record | None = await conn.fetchrow(sql, *values.values())
    if row is None:
        return None
    sandbox_id = row["id"]
    if operation is not None:
        await _start_operation(conn, sandbox_id, operation)
    if event is not None:
        await emit_sandbox_event(
            conn, sandbox_id, event.type, state=row["state"], reason=event.reason, node_id=event.node_id,
            tenant_id=event.tenant_id, generation=event.generation, data=event.data)
    if audit is not None:
        await record(conn, tenant_id=audit.tenant_id, actor=audit.actor, action=audit.action, target=sandbox_id,
                     sandbox_id=sandbox_id, detail=audit.detail)
    return row


async def _start_operation(conn: asyncpg.Connection, sandbox_id: str, op: NewOperation) -> None:
    await operation_state.insert(conn, op.id, tenant_id=op.tenant_id, sandbox_id=sandbox_id, kind=op.kind,
                                 state=op.state, finished=op.finished)


def outcome_sql(state: OperationState, *, operation: str = "$1", error_code: str | None | _Sentinel = KEEP,
                error_message: str | None | _Sentinel = KEEP, finished: bool | None = True, where: str = "") -> str:
    """The UPDATE that records an operation's outcome, as SQL text: ``operation``, ``error_code`` and
    ``error_message`` are SQL expressions (placeholders) the caller numbers, KEEP leaves a column, None
    clears it; ``finished`` as in :class:`OperationOutcome`; ``where`` adds conditions. For statements that
    stay one round trip (the node's warm start) and for :func:`apply`."""
    sets = [f"state='{OperationState(state).value}'"]
    for col, expr in (("error_code", error_code), ("error_message", error_message)):
        if expr is not KEEP:
            sets.append(f"{col}={'NULL' if expr is None else expr}")
    if finished is not None:
        sets.append("finished_at=now()" if finished else "finished_at=NULL")
    return f"UPDATE operations SET {', '.join(sets)} WHERE id={operation}" + (f" AND {where}" if where else "")


async def _record_outcome(conn: asyncpg.Connection, op: OperationOutcome) -> None:
    args: list[object] = [op.id]

    def param(value: object) -> str:
        args.append(value)
        return f"${len(args)}"

    def column(value: str | None | _Sentinel) -> str | None | _Sentinel:
        return value if value is KEEP or value is None else param(value)

    code, message = column(op.error_code), column(op.error_message)
    conditions = []
    if op.only_from:
        conditions.append(f"state = ANY({param([s.value for s in op.only_from])}::text[])")
    if op.unless_succeeded:
        conditions.append("state <> 'succeeded'")
    await conn.execute(outcome_sql(op.state, error_code=code, error_message=message, finished=op.finished,
                                   where=" AND ".join(conditions)), *args)


def renew_lease_sql(*, where: str = "", returning: str = "") -> str:
    """The lease renewal of sandbox ``$1`` as SQL, for a statement that does more in the same round trip (the
    data plane's lookup, services/api/nodes_client.py): ``where`` adds conditions (``"state='running'"``),
    ``returning`` the RETURNING list."""
    return (f"UPDATE sandboxes SET {LEASE_RENEWAL} WHERE id=$1" + (f" AND {where}" if where else "")
            + (f" RETURNING {returning}" if returning else ""))


def renew_leases_sql() -> str:
    """The lease renewal of every sandbox in ``$1`` (a text array of ids) that is still running, as one
    statement: the batched renewals of the data plane's calls (:mod:`podbay.renewals`)."""
    return (f"UPDATE sandboxes SET {LEASE_RENEWAL} WHERE id = ANY($1::text[])"
            f" AND state = '{SandboxState.RUNNING.value}'")


async def suspend(
    conn: asyncpg.Connection,
    sandbox_id: str,
    *,
    tenant_id: str,
    state: SandboxState | str,
    node_id: str,
    generation: int,
    operation_id: str,
    snapshot_id: str,
    actor: str,
    fence: bool = False,
    event_data: Mapping[str, object] | None = None,
    audit_detail: Mapping[str, object] | None = None,
) -> asyncpg.Record | None:
    """Record a suspend in the caller's transaction: the full snapshot ``snapshot_id`` (``creating``, its parent
    the sandbox's newest ready snapshot, on ``node_id`` at ``generation``) that the node will take and promote,
    then :data:`Verb.SUSPEND` from ``state`` with ``suspended_snapshot_id`` naming it, the ``suspend``
    operation, the ``suspending`` event (``data``: operation and snapshot ids, plus ``event_data``) and the
    ``sandbox.suspend`` audit record by ``actor``. ``fence``: also require ``generation`` and ``node_id`` (a
    caller that read the row without checking them). Returns :func:`apply`'s row, or None when the fence
    refused (the snapshot row is then not written). Raises ``InvalidState`` as :func:`apply` does, and
    ``Conflict`` (nothing written) while a sandbox is starting from one of this sandbox's snapshots (a fork
    child whose command a node agent restart left to be redelivered): the suspend drops the node-local
    snapshot files and rows, which that start still reads. The caller holds the sandbox's row lock, which a
    fork takes too before it inserts its children, so none can appear between this check and the commit."""
    starting = await starting_from_snapshots(conn, sandbox_id)
    if starting is not None:
        raise Conflict(f"sandbox {starting} is still starting from a snapshot of sandbox {sandbox_id}; "
                       "retry the suspend shortly", details={"sandbox_id": sandbox_id, "starting_sandbox_id": starting})
    parent = await conn.fetchval("SELECT id FROM snapshots WHERE sandbox_id=$1 AND state='ready'"
                                 " ORDER BY created_at DESC LIMIT 1", sandbox_id)
    await snapshot_state.insert(conn, snapshot_id, tenant_id=tenant_id, sandbox_id=sandbox_id, node_id=node_id,
                                kind="full", parent_id=parent, generation=generation)
    row = await apply(
        conn, sandbox_id, Verb.SUSPEND, states=state, generation=generation if fence else None,
        node=node_id if fence else ANY_NODE, values={"suspended_snapshot_id": snapshot_id},
        operation=NewOperation(operation_id, tenant_id, "suspend"),
        event=SandboxEvent(EventType.SUSPENDING, tenant_id=tenant_id, node_id=node_id, generation=generation,
                           data={"operation_id": operation_id, "snapshot_id": snapshot_id, **(event_data or {})}),
        audit=AuditRecord(tenant_id, actor, "sandbox.suspend", detail=dict(audit_detail) if audit_detail else None))
    if row is None:  # someone moved the sandbox first: no snapshot will be taken
        await snapshot_state.forget(conn, snapshot_id)
    return row


async def starting_from_snapshots(conn: asyncpg.Connection | asyncpg.Pool, sandbox_id: str) -> str | None:
    """The id of a sandbox (pending, starting or resuming) that starts from one of ``sandbox_id``'s snapshots,
    or None. Such a snapshot must outlive that start: the same states refuse deleting a snapshot in use
    (services/api/e2b/snapshots.py)."""
    found: str | None = await conn.fetchval(
        "SELECT c.id FROM snapshots s JOIN sandboxes c ON c.source_snapshot_id = s.id WHERE s.sandbox_id=$1"
        " AND c.state IN ('pending', 'starting', 'resuming') ORDER BY c.id LIMIT 1", sandbox_id)
    return found


async def forget_suspended_snapshot(conn: asyncpg.Connection | asyncpg.Pool, sandbox_id: str) -> None:
    """Drop a woken sandbox's ``suspended_snapshot_id`` (it runs again; its snapshot is history, not a state)."""
    await conn.execute("UPDATE sandboxes SET suspended_snapshot_id=NULL WHERE id=$1", sandbox_id)


async def renew_lease(conn: asyncpg.Connection | asyncpg.Pool, sandbox_id: str, *,
                      only_running: bool = False) -> None:
    """Renew a sandbox's lease from now (its whole ``lease_s``); ``only_running``: only while it runs."""
    await conn.execute(renew_lease_sql(where="state='running'" if only_running else ""), sandbox_id)


async def set_lease(conn: asyncpg.Connection | asyncpg.Pool, sandbox_id: str, lease_s: int, *,
                    action: str | None = None, only_extend: bool = False) -> bool:
    """Give a sandbox a lease of ``lease_s`` seconds from now (also its length from then on) and, when given,
    the ``action`` (``pause``, ``delete``) taken when it runs out. ``only_extend``: a lease that already ends
    later stays as it is. Returns whether the row changed. The sandbox's node is told
    (:data:`LEASE_CHANNEL`), so a shorter lease runs out on time, not at the node's next periodic pass."""
    changed = await conn.fetchrow(
        "UPDATE sandboxes SET lease_s=$2, lease_action=COALESCE($3, lease_action),"
        " lease_expires_at = now() + $2::integer * interval '1 second', updated_at=now()"
        " WHERE id=$1 AND NOT ($4 AND lease_expires_at >= now() + $2::integer * interval '1 second')"
        " RETURNING node_id", sandbox_id, lease_s, action, only_extend)
    if changed is not None and changed["node_id"]:
        await notify_lease(conn, changed["node_id"])
    return changed is not None


#: The PostgreSQL NOTIFY channel on which a node hears that a lease of one of its sandboxes changed (payload:
#: the node id): its lease loop (services/nodeagent/ops/lease.py) then sleeps until the new nearest deadline.
LEASE_CHANNEL = "podbay_lease"


async def notify_lease(conn: asyncpg.Connection | asyncpg.Pool, node_id: str) -> None:
    """Tell ``node_id`` that a lease of one of its sandboxes changed (delivered when the caller's transaction
    commits, at once outside one)."""
    await conn.execute("SELECT pg_notify($1, $2)", LEASE_CHANNEL, node_id)


async def expire_lease(conn: asyncpg.Connection | asyncpg.Pool, sandbox_id: str, action: str) -> None:
    """End a sandbox's lease now with ``action``: the node's lease loop applies it at once, told through
    :data:`LEASE_CHANNEL` (the way to delete a sandbox in a state a delete is refused in)."""
    node_id = await conn.fetchval("UPDATE sandboxes SET lease_action=$2, lease_expires_at=now() WHERE id=$1"
                                  " RETURNING node_id", sandbox_id, action)
    if node_id:
        await notify_lease(conn, node_id)


async def copy_lease_action(conn: asyncpg.Connection | asyncpg.Pool, parent: str, children: list[str]) -> None:
    """Children take their parent's lease action (a fork)."""
    await conn.execute("UPDATE sandboxes c SET lease_action = p.lease_action FROM sandboxes p WHERE p.id = $1"
                       " AND c.id = ANY($2::text[])", parent, children)
