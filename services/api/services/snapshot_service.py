"""The snapshot service layer: take a snapshot, roll a sandbox back to one, fork it, and the lookups of
snapshot rows (with those of E2B's protocol over snapshots: the usable ones, their names in
``e2b_snapshot_names``, their listing and delete, which services/api/e2b/snapshots.py calls).

No FastAPI types: podbay's routes (services/api/routes/snapshots.py) and E2B's (services/api/e2b/sandboxes.py) call it. Each
call records an operation and waits (bounded by ``create_timeout_s``) for the node's ``podbay.ops.<id>``
notice, and returns ``(info, finished)``: ``finished`` False means the bound ran out or ``wait`` was False,
and the caller answers 202 with ``operation_id``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg

from podbay.contracts.events import EventType
from podbay.contracts import subjects
from podbay.contracts.api import (
    ForkChildResult,
    ForkRequest,
    ForkResult,
    RestoreRequest,
    SandboxInfo,
    SnapshotCreate,
    SnapshotInfo,
)
from podbay.contracts.messages import ForkChild, ForkCmd, RestoreCmd, SnapshotCmd
from podbay.contracts.states import PromotionState, SandboxCommand, SandboxState, SnapshotState, check_allowed
from podbay import lifecycle
from podbay.errors import Conflict, InvalidRequest, NotFound
from podbay.lifecycle import AuditRecord, NewOperation, SandboxEvent, Verb
from podbay.logs import bind_log_context
from podbay.naming import sandbox_hostname
from podbay.outbox import new_id
from podbay import snapshot_state
from podbay import operation_state

from . import quotas
from ..core.auth import Principal
from ..core.context import ApiContext
from .sandbox_lookup import GUEST_ENV_SQL, audit, await_operation, load_sandbox, sandbox_info
from ..schedules.fork import copy_schedules
from .volume_service import fork_volumes, refuse_with_volumes

__all__ = ["SNAPSHOT_COLS", "snapshot_info", "ready_snapshots", "snapshot_nodes", "latest_ready", "ready_snapshot", "take", "restore", "fork",
           "USABLE_SQL", "snapshot_of_name", "name_snapshot", "usable_snapshot", "promotion_of", "usable_page",
           "starting_from", "delete_named"]

#: The columns :func:`snapshot_info` reads.
SNAPSHOT_COLS = ("id, sandbox_id, kind, state, parent_id, size_bytes, paused_ms, error, created_at, ready_at,"
                 " promotion, promoted_at, promotion_error, uploaded_bytes, stored_bytes")


def snapshot_info(row: asyncpg.Record, operation_id: str | None = None) -> SnapshotInfo:
    """The API shape of a ``snapshots`` row (:data:`SNAPSHOT_COLS`)."""
    return SnapshotInfo(**dict(row), operation_id=operation_id)


async def latest_ready(conn: asyncpg.Connection, sandbox_id: str) -> str | None:
    """The sandbox's newest ready snapshot's id (the parent of the next one), or None."""
    return await conn.fetchval(  # type: ignore[no-any-return]  # asyncpg is untyped: fetchval returns Any
        "SELECT id FROM snapshots WHERE sandbox_id=$1 AND state='ready' ORDER BY created_at DESC LIMIT 1", sandbox_id)


async def ready_snapshot(conn: asyncpg.Connection, sandbox_id: str, snapshot_id: str) -> asyncpg.Record:
    """The sandbox's snapshot ``snapshot_id`` (id, kind, state); ``NotFound``, or ``Conflict`` unless ready."""
    snap = await conn.fetchrow("SELECT id, kind, state FROM snapshots WHERE id=$1 AND sandbox_id=$2",
                               snapshot_id, sandbox_id)
    if snap is None:
        raise NotFound(f"snapshot {snapshot_id} of sandbox {sandbox_id} does not exist")
    if snap["state"] != "ready":
        raise Conflict(f"snapshot {snapshot_id} is {snap['state']}", details={"state": snap["state"]})
    return snap


async def ready_snapshots(pool: asyncpg.Pool | asyncpg.Connection, sandbox_id: str) -> list[asyncpg.Record]:
    """The sandbox's ``ready`` snapshot rows (:data:`SNAPSHOT_COLS`), newest first."""
    return list(await pool.fetch(
        f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE sandbox_id=$1 AND state='{SnapshotState.READY}'"
        " ORDER BY created_at DESC", sandbox_id))


async def snapshot_nodes(conn: asyncpg.Pool | asyncpg.Connection, snapshot_ids: list[str]) -> list[asyncpg.Record]:
    """The distinct nodes holding these snapshots' files (``node_id``, ``dataplane_url``: None when the node
    row is gone)."""
    return list(await conn.fetch(
        "SELECT DISTINCT s.node_id, n.dataplane_url FROM snapshots s LEFT JOIN nodes n ON n.id = s.node_id"
        " WHERE s.id = ANY($1::text[])", snapshot_ids))


async def take(ctx: ApiContext, who: Principal, sandbox_id: str, body: SnapshotCreate, *,
               wait: bool) -> tuple[SnapshotInfo, bool]:
    """Take a disk or full snapshot now. Raises ``NotFound``, ``InvalidState`` unless running or paused,
    ``Conflict`` (the node failed it; ``details.operation_id``)."""
    op_id, snap_id = new_id("op"), new_id("snap")
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.SNAPSHOT, row["state"])
        await snapshot_state.insert(conn, snap_id, tenant_id=who.tenant_id, sandbox_id=sandbox_id,
                                    node_id=row["node_id"], kind=body.kind,
                                    parent_id=await latest_ready(conn, sandbox_id), generation=row["generation"])
        await operation_state.insert(conn, op_id, tenant_id=who.tenant_id, sandbox_id=sandbox_id, kind="snapshot")
        await audit(conn, who, "sandbox.snapshot", sandbox_id)
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(subjects.node_cmd(row["node_id"], "snapshot"), SnapshotCmd(
        operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"], snapshot_id=snap_id,
        kind=body.kind), msg_id=op_id)
    finished, outcome = await await_operation(ctx, fut)
    snap = await ctx.pool.fetchrow(f"SELECT {SNAPSHOT_COLS} FROM snapshots WHERE id=$1", snap_id)
    if finished and outcome.get("state") == "failed":
        raise Conflict(f"snapshot of {sandbox_id} failed: {outcome.get('error')}", details={"operation_id": op_id})
    return snapshot_info(snap, op_id), finished


async def restore(ctx: ApiContext, who: Principal, sandbox_id: str, body: RestoreRequest, *,
                  wait: bool) -> tuple[SandboxInfo, bool]:
    """Roll back to a snapshot, keeping the id; the generation goes up by one (older calls are fenced off).

    Allowed from ``running``, ``paused`` and ``failed``. Raises ``NotFound`` (sandbox or snapshot),
    ``InvalidState``, ``Conflict`` (snapshot not ready; or a full snapshot of a sandbox with a read-write
    volume without ``body.volumes``: services/api/services/volume_service.py), ``InvalidRequest`` (``volumes`` with a disk
    snapshot, which holds no volume copy)."""
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.RESTORE, row["state"])
        snap = await ready_snapshot(conn, sandbox_id, body.snapshot_id)
        if body.volumes and snap["kind"] != "full":
            raise InvalidRequest("only a full snapshot holds copies of the sandbox's volumes to roll back",
                                 details={"kind": snap["kind"]})
        if snap["kind"] == "full" and not body.volumes:
            await refuse_with_volumes(conn, sandbox_id, "a rollback to a full snapshot without its volumes (ask "
                                      "for volumes: true to roll them back with it, or use a disk snapshot: the "
                                      "guest boots and mounts the volume as it is now)", writable_only=True)
        moved = await lifecycle.apply(conn, sandbox_id, Verb.RESTORE, states=row["state"], bump_generation=True,
                                      operation=NewOperation(op_id, who.tenant_id, "restore"),
                                      audit=AuditRecord(who.tenant_id, who.key_id, "sandbox.restore"))
        assert moved is not None  # the row is locked and its state checked
        gen = moved["generation"]
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(subjects.node_cmd(row["node_id"], "restore"), RestoreCmd(
        operation_id=op_id, sandbox_id=sandbox_id, generation=int(gen), snapshot_id=body.snapshot_id,
        volumes=body.volumes), msg_id=op_id)
    finished, _ = await await_operation(ctx, fut)
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id), finished


async def fork(ctx: ApiContext, who: Principal, sandbox_id: str, body: ForkRequest, *,
               wait: bool) -> tuple[ForkResult, bool]:
    """Start ``body.count`` children (1..100) from a new full snapshot or ``body.snapshot_id`` (a full one);
    each child's outcome is in the result, and a child that fails does not fail the others. Raises
    ``NotFound``, ``InvalidState`` unless running or paused, ``InvalidRequest`` (not a full snapshot),
    ``Conflict`` (snapshot not ready), ``QuotaExceeded`` (403 ``quota_exceeded``: the children would pass
    one of the tenant's quotas), the volume errors of services/api/services/volume_service.py."""
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    children = [new_id("sbx") for _ in range(body.count)]
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.FORK, row["state"])
        take = body.snapshot_id is None
        if body.snapshot_id is not None:
            snap = await ready_snapshot(conn, sandbox_id, body.snapshot_id)
            if snap["kind"] != "full":
                raise InvalidRequest("fork needs a full snapshot (memory and disk)", details={"kind": snap["kind"]})
            snap_id = body.snapshot_id
        else:
            snap_id = new_id("snap")
            await snapshot_state.insert(conn, snap_id, tenant_id=who.tenant_id, sandbox_id=sandbox_id,
                                        node_id=row["node_id"], kind="full",
                                        parent_id=await latest_ready(conn, sandbox_id), generation=row["generation"])
        tpl = await conn.fetchval("SELECT template_digest FROM sandboxes WHERE id=$1", sandbox_id)
        # The children count against the tenant's quotas as any new sandbox (under the tenant's lock).
        await quotas.check_sandbox(conn, ctx, who, vcpus=row["vcpus"], memory_mib=row["memory_mib"],
                                   disk_mib=await quotas.sandbox_disk_mib(conn, sandbox_id), count=len(children),
                                   route="fork sandbox", target=sandbox_id)
        for cid in children:
            # A child inherits the parent's own egress policy; its credential placeholders are those in scope
            # for it now (scoped by its own id and template), never copied from the parent.
            await lifecycle.insert(
                conn, SandboxState.STARTING,
                {"id": cid, "tenant_id": who.tenant_id, "template": row["template"], "template_digest": tpl,
                 "node_id": row["node_id"], "generation": 1, "memory_mib": row["memory_mib"],
                 "vcpus": row["vcpus"], "metadata": row["metadata"] or {}, "parent_sandbox_id": sandbox_id,
                 "source_snapshot_id": snap_id},
                exprs={"egress_policy": "(SELECT egress_policy FROM sandboxes WHERE id={parent_sandbox_id})",
                       "disk_mib": "(SELECT disk_mib FROM sandboxes WHERE id={parent_sandbox_id})",
                       "guest_env": GUEST_ENV_SQL.format(tenant="{tenant_id}", sandbox="{id}", template="{template}")},
                event=SandboxEvent(EventType.CREATED, tenant_id=who.tenant_id,
                                   data={"parent": sandbox_id, "snapshot_id": snap_id, "operation_id": op_id}))
        await fork_volumes(conn, who.tenant_id, sandbox_id, children, snap_id, body.volumes)
        if body.schedules:  # asked for: each child gets its own copies (own ids, own run history)
            await copy_schedules(conn, sandbox_id, children)
        await operation_state.insert(conn, op_id, tenant_id=who.tenant_id, sandbox_id=sandbox_id, kind="fork")
        await audit(conn, who, "sandbox.fork", sandbox_id, detail={"children": children, "snapshot_id": snap_id})
    ctx.relay.kick()
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(subjects.node_cmd(row["node_id"], "fork"), ForkCmd(
        operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"], snapshot_id=snap_id,
        take_snapshot=take, children=[ForkChild(sandbox_id=c, hostname=sandbox_hostname(c)) for c in children]),
        msg_id=op_id)
    finished, _ = await await_operation(ctx, fut)
    rows = {r["id"]: r for r in await ctx.pool.fetch(
        "SELECT id, state, failure_reason FROM sandboxes WHERE id = ANY($1::text[])", children)}
    return ForkResult(snapshot_id=snap_id, operation_id=op_id, children=[
        ForkChildResult(sandbox_id=c, state=rows[c]["state"], failure_reason=rows[c]["failure_reason"])
        for c in children]), finished


# E2B's protocol over snapshots (services/api/e2b/snapshots.py).

#: A snapshot E2B can use (``n``: the snapshot, ``s``: its sandbox): ready, and its source still there (local
#: files) or it pinned and in object storage.
USABLE_SQL = (f"n.state='{SnapshotState.READY}' AND (s.state IN ('{SandboxState.RUNNING}', '{SandboxState.PAUSED}')"
              f" OR (s.state NOT IN ('{SandboxState.DELETING}', '{SandboxState.DELETED}')"
              f" AND n.promotion='{PromotionState.PROMOTED}')"
              f" OR (n.pinned AND n.promotion='{PromotionState.PROMOTED}'))")
#: The sandbox states of a start from a snapshot that has not finished (an SQL list).
_STARTING = ", ".join(f"'{s}'" for s in (SandboxState.PENDING, SandboxState.STARTING, SandboxState.RESUMING))


async def snapshot_of_name(pool: Any, tenant_id: str, name: str) -> str | None:
    """The id of the tenant's snapshot named ``name`` (``e2b_snapshot_names``), or None."""
    snapshot_id: str | None = await pool.fetchval(
        "SELECT snapshot_id FROM e2b_snapshot_names WHERE tenant_id=$1 AND name=$2", tenant_id, name)
    return snapshot_id


async def name_snapshot(pool: Any, tenant_id: str, name: str, snapshot_id: str) -> None:
    """Snapshot ``snapshot_id`` takes the tenant's name ``name`` (from another snapshot that had it)."""
    await pool.execute(
        "INSERT INTO e2b_snapshot_names (tenant_id, name, snapshot_id) VALUES ($1, $2, $3)"
        " ON CONFLICT (tenant_id, name) DO UPDATE SET snapshot_id = EXCLUDED.snapshot_id",
        tenant_id, name, snapshot_id)


async def usable_snapshot(pool: Any, tenant_id: str, snapshot_id: str) -> asyncpg.Record | None:
    """The tenant's snapshot ``snapshot_id`` if E2B can use it (:data:`USABLE_SQL`): ``id``, ``sandbox_id``,
    ``kind``, ``promotion``, ``source_state`` (its sandbox's state); None otherwise."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT n.id, n.sandbox_id, n.kind, n.promotion, s.state AS source_state FROM snapshots n"
        f" JOIN sandboxes s ON s.id = n.sandbox_id WHERE n.id=$1 AND n.tenant_id=$2 AND {USABLE_SQL}",
        snapshot_id, tenant_id)
    return row


async def promotion_of(pool: Any, snapshot_id: str) -> asyncpg.Record | None:
    """The snapshot's ``promotion`` and ``promotion_error``, or None when there is no such row."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT promotion, promotion_error FROM snapshots WHERE id=$1", snapshot_id)
    return row


async def usable_page(pool: Any, tenant_id: str, *, sandbox_id: str | None, name: str | None, limit: int,
                      cursor: tuple[datetime, str] | None) -> list[asyncpg.Record]:
    """Up to ``limit`` of the tenant's usable snapshots (:data:`USABLE_SQL`), newest first, after ``cursor``
    ((created_at, id) of the previous page's last row; None: from the newest); ``sandbox_id`` keeps those of
    one sandbox, ``name`` the one whose id or E2B name it is. Rows: ``id``, ``created_at``, ``name`` (its
    first E2B name, or None)."""
    sql = ("SELECT n.id, n.created_at, (SELECT m.name FROM e2b_snapshot_names m WHERE m.snapshot_id = n.id"
           " ORDER BY m.name LIMIT 1) AS name FROM snapshots n JOIN sandboxes s ON s.id = n.sandbox_id"
           f" WHERE n.tenant_id=$1 AND {USABLE_SQL} AND ($2::text IS NULL OR n.sandbox_id = $2)"
           " AND ($4::text IS NULL OR n.id = $4 OR EXISTS (SELECT 1 FROM e2b_snapshot_names m"
           " WHERE m.snapshot_id = n.id AND m.tenant_id = $1 AND m.name = $4))")
    args: list[Any] = [tenant_id, sandbox_id, limit, name]
    if cursor is not None:
        sql += " AND (n.created_at, n.id) < ($5, $6)"
        args += [cursor[0], cursor[1]]
    return list(await pool.fetch(sql + " ORDER BY n.created_at DESC, n.id DESC LIMIT $3", *args))


async def starting_from(pool: Any, snapshot_id: str) -> bool:
    """Whether a sandbox is being started from the snapshot (its start has not finished)."""
    return bool(await pool.fetchval(
        f"SELECT true FROM sandboxes WHERE source_snapshot_id=$1 AND state IN ({_STARTING})", snapshot_id))


async def delete_named(pool: asyncpg.Pool, snapshot_id: str) -> None:
    """Delete the snapshot (:func:`podbay.snapshot_state.delete`) and its E2B names, in one transaction."""
    async with pool.acquire() as conn, conn.transaction():
        await snapshot_state.delete(conn, [snapshot_id])
        await conn.execute("DELETE FROM e2b_snapshot_names WHERE snapshot_id=$1", snapshot_id)
