"""The sandbox service layer: create, delete, pause, resume, suspend and the auto-resume of a data-plane call.

Each state change commits in one transaction with its outbox event (docs/DESIGN.md §4) and then puts a command
on JetStream (or, for a warm create, one NATS request: services/api/services/warm.py). With ``wait`` a call waits for
the outcome, bounded by ``create_timeout_s`` (suspend and a wake from object storage: ``suspend_timeout_s``).
Every function returns ``(SandboxInfo, finished)``: ``finished`` False means the bound ran out or ``wait`` was
False, and the caller answers 202 with ``operation_id``.

No FastAPI types: the native routes (services/api/routes/sandboxes.py, suspend.py), E2B's (services/api/e2b/sandboxes*.py),
schedules and the port edge all call these functions, and no route calls another route.

Suspend and resume from object storage (docs/ARCHITECTURE.md "Suspend and resume"):

- :func:`suspend` (running or paused): in one transaction insert the full snapshot row (``creating``), set
  the sandbox ``suspending`` with that snapshot, record the operation and emit ``suspending``; then send
  ``podbay.cmd.node.<node>.suspend``. The node snapshots, has the snapshotter promote, and frees the VM; a
  failed promotion leaves the sandbox ``paused`` with the error on the operation (``SuspendFailed``).
- :func:`resume_suspended`: set ``resuming`` and ask the scheduler to place it (``PlaceSandbox`` with
  ``wake``); the chosen node fetches, verifies and restores it. A corrupt snapshot raises ``SnapshotCorrupt``
  and the sandbox stays ``suspended``; ``fallback`` restores the newest older intact promoted full snapshot.
- :func:`auto_resume`: exec and file calls with ``?auto_resume=true`` on a suspended (or paused) sandbox
  resume it first.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from podbay.contracts.events import EventType
from podbay.contracts import subjects
from podbay.contracts.api import SandboxCreate, SandboxInfo
from podbay.contracts.messages import DeleteSandboxCmd, PlaceSandbox, Resources, SandboxOpCmd
from podbay import lifecycle
from podbay.contracts.states import OperationState, SandboxCommand, SandboxState, check_allowed
from podbay.errors import (
    InvalidRequest,
    InvalidState,
    NoCapacity,
    NotFound,
    PodbayError,
    SandboxFailed,
    SnapshotCorrupt,
    SuspendFailed,
    Unavailable,
    Unprocessable,
)
from podbay.faults import fault_point
from podbay.lifecycle import AuditRecord, NewOperation, SandboxEvent, Verb
from podbay.logs import bind_log_context
from podbay.outbox import new_id
from podbay import template_versions
from podbay.contracts.templates import split_template_ref
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS
from podbay import snapshot_state
from podbay import operation_state

from ..core.auth import Principal
from . import idempotency, quotas, template_access
from ..core.context import ApiContext
from .idempotency import IdempotencyKey
from .sandbox_lookup import GUEST_ENV_SQL, audit, await_operation, finish, load_sandbox, sandbox_info
from .volume_service import attach_volumes
from .warm import warm_create

__all__ = ["republish_unfinished", "create", "delete", "pause", "resume", "resume_suspended", "suspend", "auto_resume", "InvalidDiskSize",
           "check_disk_mib"]

_MIB = 1 << 20


class InvalidDiskSize(Unprocessable):
    """A create's ``disk_mib`` is below its template's disk or above ``SANDBOX_MAX_DISK_MIB``
    (``details``: ``disk_mib``, ``template_disk_mib`` or ``max_disk_mib``)."""

    code = "invalid_disk_size"


def check_disk_mib(disk_mib: int, template_size_bytes: int | None, max_mib: int) -> None:
    """Raise :class:`InvalidDiskSize` unless ``disk_mib`` (MiB) is at least the template's disk
    (``template_size_bytes``, bytes; None: not known here, the node checks) and at most ``max_mib``."""
    if disk_mib > max_mib:
        raise InvalidDiskSize(f"disk_mib {disk_mib} is over this server's limit of {max_mib} MiB",
                              details={"disk_mib": disk_mib, "max_disk_mib": max_mib})
    if template_size_bytes is not None and disk_mib * _MIB < template_size_bytes:
        have = -(-template_size_bytes // _MIB)
        raise InvalidDiskSize(f"disk_mib {disk_mib} is smaller than the template's disk ({have} MiB); a disk "
                              "can only be made larger", details={"disk_mib": disk_mib, "template_disk_mib": have})


async def create(ctx: ApiContext, who: Principal, body: SandboxCreate, *, wait: bool,
                 idem: IdempotencyKey | None = None) -> tuple[SandboxInfo, bool]:
    """Create a sandbox from a template: from a warm slot when the template's pool has one ready (a claim
    and a resume), else by restoring the template's snapshot on a node with room.

    ``idem`` (an ``Idempotency-Key`` and its request's hash, services/api/services/idempotency.py) is recorded with
    the sandbox; a create whose key made a sandbox within ``idempotency_key_ttl_s`` makes none and answers
    with that sandbox as it is now (with ``wait``, once its start finished, like the first create), or raises
    ``IdempotencyKeyReused`` (422) when the key came with another body.

    ``body.template`` is a template's name (its current build) or ``name:tag`` (the build the tag names; the
    sandbox's ``template`` is the name). Raises ``NotFound`` (unknown template or volume, or another tenant's
    template), ``QuotaExceeded`` (403 ``quota_exceeded``: services/api/services/quotas.py), ``TagNotFound``
    (the template has no such tag), ``InvalidRequest`` (resources the template's snapshot
    cannot restore with), ``InvalidDiskSize`` (``disk_mib`` below the template's disk or over the limit), the
    volume errors of services/api/services/volume_service.py, ``NoCapacity`` (no node had room
    within the scheduler's retry window; the sandbox is ``failed``), ``SandboxFailed`` (with the reason),
    ``Unavailable``. Without ``wait`` the same outcomes show on the operation (``error.code``) and the
    sandbox (``failed``, ``failure_reason``).
    """
    t0 = time.perf_counter()
    name, tag = split_template_ref(body.template)  # the pattern was checked at the boundary
    # A warm claim looks the template up in its own statement; the checks below answer when it cannot. A warm
    # slot was restored without volumes and its node may not hold them: a create with volumes restores. Warm
    # slots hold a template's current build, so a create of name:tag (a build a tag names) restores.
    # A warm slot's disk is the template's: a create asking for a larger one restores and grows it there.
    if body.disk_mib is not None:
        check_disk_mib(body.disk_mib, None, ctx.settings.sandbox_max_disk_mib)
    if wait and not body.volumes and tag is None and body.disk_mib is None and (
            warm := await warm_create(ctx, who, body, t0, idem)) is not None:
        return warm, True
    # The warm claim checked the key in its own statement; the restore path asks here, one more query.
    if idem is not None and (prior := await idempotency.lookup(ctx.pool, who.tenant_id, idem.key,
                                                               ctx.settings.idempotency_key_ttl_s)) is not None:
        return await _replay(ctx, who, idem, prior, wait=wait, t0=t0)
    # The name means the caller's own template, else the shared one; another tenant's is answered as missing
    # (services/api/services/template_access.py). The sandbox records the template's key.
    visible = await template_access.lookup(ctx.pool, ctx, who, name, route="create sandbox")
    tpl = await template_versions.resolve(ctx.pool, visible["name"], tag, shown=name) if visible is not None else None
    if tpl is None:
        raise NotFound(f"template {body.template!r} does not exist", details={"template": body.template})
    if body.memory_mib is not None and body.memory_mib != tpl["memory_mib"]:
        raise InvalidRequest(
            f"template {body.template!r} is snapshotted with {tpl['memory_mib']} MiB; memory_mib must match",
            details={"template_memory_mib": tpl["memory_mib"]},
        )
    if body.vcpus is not None and body.vcpus != tpl["vcpus"]:
        raise InvalidRequest(
            f"template {body.template!r} is snapshotted with {tpl['vcpus']} vCPUs; vcpus must match",
            details={"template_vcpus": tpl["vcpus"]},
        )
    if body.disk_mib is not None:
        check_disk_mib(body.disk_mib, tpl["size_bytes"], ctx.settings.sandbox_max_disk_mib)
    sandbox_id = new_id("sbx")
    bind_log_context(sandbox_id=sandbox_id)
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    t_db = time.perf_counter()
    # The guard comes first, so a KeyTaken rolls the transaction back before the guard stops it.
    async with idempotency.TakenGuard() as guard, ctx.pool.acquire() as conn, conn.transaction():
        # Under the tenant's lock: two creates of one tenant cannot both take its last unit of a quota.
        await quotas.check_sandbox(conn, ctx, who, vcpus=tpl["vcpus"], memory_mib=tpl["memory_mib"],
                                   disk_mib=quotas.disk_mib_of(body.disk_mib, tpl["size_bytes"]),
                                   route="create sandbox", target=name)
        # The volumes are checked and recorded last: they write no event, so the outbox order is unchanged.
        await lifecycle.insert(
            conn, SandboxState.PENDING,
            {"id": sandbox_id, "tenant_id": who.tenant_id, "template": tpl["name"], "template_digest": tpl["digest"],
             "memory_mib": tpl["memory_mib"], "vcpus": tpl["vcpus"], "disk_mib": body.disk_mib,
             "metadata": body.metadata,
             "lease_s": body.lease_s or ctx.settings.lease_s,
             "lease_action": body.on_lease_expiry or ctx.settings.lease_action,
             "egress_policy": body.network.model_dump(mode="json") if body.network is not None else None},
            exprs={"guest_env": GUEST_ENV_SQL.format(tenant="{tenant_id}", sandbox="{id}", template="{template}")},
            operation=NewOperation(op_id, who.tenant_id, "create"),
            event=SandboxEvent(EventType.CREATED, tenant_id=who.tenant_id, data={"template": name, "operation_id": op_id}),
            audit=AuditRecord(who.tenant_id, who.key_id, "sandbox.create",
                              {"template": name, "network": body.network is not None,
                               **({"volumes": [v.model_dump() for v in body.volumes]} if body.volumes else {})}))
        await attach_volumes(conn, who.tenant_id, sandbox_id, body.volumes or [])
        if idem is not None and not await idempotency.record(conn, who.tenant_id, idem, sandbox_id, op_id,
                                                             ctx.settings.idempotency_key_ttl_s):
            raise idempotency.KeyTaken(idem.key)
    if guard.taken and idem is not None:
        # A concurrent create with this key committed first (this one's rows are rolled back): answer as its retry.
        prior = await idempotency.lookup(ctx.pool, who.tenant_id, idem.key, ctx.settings.idempotency_key_ttl_s)
        if prior is None:  # it expired in between: the key is free again
            return await create(ctx, who, body, wait=wait, idem=idem)
        return await _replay(ctx, who, idem, prior, wait=wait, t0=t0)
    HOP_SECONDS.labels("api", "db").observe(time.perf_counter() - t_db)
    ctx.relay.kick()
    fut = ctx.waiter.expect(sandbox_id, {"started", "failed"}) if wait else None
    t_bus = time.perf_counter()
    await ctx.bus.publish_command(
        subjects.SCHEDULER_PLACE,
        PlaceSandbox(operation_id=op_id, sandbox_id=sandbox_id, tenant_id=who.tenant_id, template=tpl["name"],
                     resources=Resources(memory_mib=tpl["memory_mib"], vcpus=tpl["vcpus"])),
        msg_id=op_id,
    )
    HOP_SECONDS.labels("api", "bus").observe(time.perf_counter() - t_bus)
    info, finished = await finish(ctx, who.tenant_id, sandbox_id, op_id, fut, "create", t0)
    await _raise_if_failed(ctx, info, sandbox_id, op_id)
    return info, finished


async def _replay(ctx: ApiContext, who: Principal, idem: IdempotencyKey, prior: idempotency.Prior, *, wait: bool,
                  t0: float) -> tuple[SandboxInfo, bool]:
    """Answer a create whose key made ``prior``'s sandbox: that sandbox as it is now; with ``wait``, once its
    create operation finished (bounded like a create). Raises ``IdempotencyKeyReused`` when ``idem`` came
    with another body, and the first create's error when its sandbox failed to start."""
    idempotency.check(prior, idem)
    sandbox_id, op_id = prior.sandbox_id, prior.operation_id
    bind_log_context(sandbox_id=sandbox_id, operation_id=op_id)
    starting = (SandboxState.PENDING, SandboxState.STARTING)
    # Expect the outcome before reading the row, so a start between the two is not missed.
    fut = ctx.waiter.expect(sandbox_id, {"started", "failed"}) if wait else None
    row = await load_sandbox(ctx.pool, who.tenant_id, sandbox_id)
    if row["state"] == SandboxState.PENDING and row["node_id"] is None and row["generation"] == 0:
        # Never placed: the first request may have died between its commit and its publish (its API was
        # killed, or NATS refused the command). Publish the place command again under the same operation id:
        # JetStream drops it as a duplicate if the first one went out, and placement is fenced anyway.
        await ctx.bus.publish_command(subjects.SCHEDULER_PLACE, PlaceSandbox(
            operation_id=op_id, sandbox_id=sandbox_id, tenant_id=who.tenant_id, template=row["template"],
            resources=Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"])), msg_id=op_id)
    if row["state"] in starting and fut is not None:
        info, finished = await finish(ctx, who.tenant_id, sandbox_id, op_id, fut, "create_replay", t0)
    else:
        if fut is not None:
            fut.cancel()
        info, finished = sandbox_info(row, op_id), row["state"] not in starting
    await _raise_if_failed(ctx, info, sandbox_id, op_id)
    return info, finished


async def _raise_if_failed(ctx: ApiContext, info: SandboxInfo, sandbox_id: str, op_id: str) -> None:
    """A create's error when its sandbox failed to start: ``NoCapacity`` or ``SandboxFailed``."""
    if info.state == SandboxState.FAILED:
        details: dict[str, Any] = {"sandbox_id": sandbox_id, "operation_id": op_id}
        code = await ctx.pool.fetchval("SELECT error_code FROM operations WHERE id=$1", op_id)
        if code == NoCapacity.code:
            raise NoCapacity(f"no node has room for sandbox {sandbox_id}: {info.failure_reason}",
                             details={**details, "retry_after_s": NoCapacity.DEFAULT_RETRY_AFTER_S})
        raise SandboxFailed(f"sandbox {sandbox_id} failed to start: {info.failure_reason}", details=details)


async def delete(ctx: ApiContext, who: Principal, sandbox_id: str, *, wait: bool) -> tuple[SandboxInfo, bool]:
    """Stop the sandbox's VM and remove its files; the row stays with state ``deleted``. A sandbox that was
    never placed is deleted here at once (finished). Raises ``NotFound``, ``InvalidState`` (already deleted)."""
    t0 = time.perf_counter()
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    node_cmd: DeleteSandboxCmd | None = None
    node_id: str | None = None
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.DELETE, row["state"])
        node_id = row["node_id"]
        audit_rec = AuditRecord(who.tenant_id, who.key_id, "sandbox.delete")
        if node_id is None:
            # Never placed: nothing runs anywhere, so the delete completes here. A suspended sandbox's promoted
            # snapshots go too (their chunks at the next collection), except pinned ones, which outlive it.
            await snapshot_state.delete_of_deleted_sandbox(conn, sandbox_id)
            await lifecycle.apply(
                conn, sandbox_id, Verb.DELETED, states=row["state"], values={"desired_state": "deleted"},
                operation=NewOperation(op_id, who.tenant_id, "delete", OperationState.SUCCEEDED, finished=True),
                event=SandboxEvent(EventType.DELETED, tenant_id=who.tenant_id), audit=audit_rec)
        else:
            await lifecycle.apply(conn, sandbox_id, Verb.DELETE, states=row["state"],
                                  operation=NewOperation(op_id, who.tenant_id, "delete"), audit=audit_rec)
            node_cmd = DeleteSandboxCmd(operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"])
    ctx.relay.kick()
    fut = None
    if node_cmd is not None and node_id is not None:
        fut = ctx.waiter.expect(sandbox_id, {"deleted"}) if wait else None
        await ctx.bus.publish_command(subjects.node_cmd(node_id, "delete"), node_cmd, msg_id=op_id)
    info, finished = await finish(ctx, who.tenant_id, sandbox_id, op_id, fut, "delete", t0)
    return info, finished or node_cmd is None


async def _node_operation(ctx: ApiContext, who: Principal, sandbox_id: str, command: SandboxCommand, *,
                          wait: bool) -> tuple[SandboxInfo, bool]:
    """Record an operation for ``command``, send it to the sandbox's node, and (bounded) wait for it."""
    t0 = time.perf_counter()
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(command, row["state"])
        await operation_state.insert(conn, op_id, tenant_id=who.tenant_id, sandbox_id=sandbox_id, kind=command.value)
        await lifecycle.renew_lease(conn, sandbox_id)
        await audit(conn, who, f"sandbox.{command.value}", sandbox_id)
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(
        subjects.node_cmd(row["node_id"], command.value),
        SandboxOpCmd(operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"]), msg_id=op_id)
    finished, outcome = await await_operation(ctx, fut)
    LIFECYCLE_OPERATION_SECONDS.labels("api", command.value, "ok" if finished else "pending").observe(
        time.perf_counter() - t0)
    if finished and outcome.get("state") == "failed":
        raise InvalidState(f"could not {command.value} sandbox {sandbox_id}: {outcome.get('error')}",
                           details={"operation_id": op_id})
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id), finished


async def pause(ctx: ApiContext, who: Principal, sandbox_id: str, *, wait: bool) -> tuple[SandboxInfo, bool]:
    """Pause a running sandbox in memory (QMP ``stop``). Raises ``InvalidState`` unless it is running."""
    return await _node_operation(ctx, who, sandbox_id, SandboxCommand.PAUSE, wait=wait)


async def resume(ctx: ApiContext, who: Principal, sandbox_id: str, *, wait: bool,
                 fallback: bool = False) -> tuple[SandboxInfo, bool]:
    """Resume a paused sandbox (QMP ``cont``, clock corrected) or wake a suspended one on a node with room
    (:func:`resume_suspended`, which ``fallback`` is for). Raises ``InvalidState`` unless paused or
    suspended, and what :func:`resume_suspended` raises."""
    state = await ctx.pool.fetchval("SELECT state FROM sandboxes WHERE id=$1 AND tenant_id=$2", sandbox_id,
                                    who.tenant_id)
    if state == SandboxState.SUSPENDED:
        return await resume_suspended(ctx, who, sandbox_id, wait=wait, fallback=fallback)
    return await _node_operation(ctx, who, sandbox_id, SandboxCommand.RESUME, wait=wait)


async def _wait(fut: asyncio.Future[dict[str, object]] | None, timeout_s: float) -> bool:
    if fut is None:
        return False
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_s)
        return True
    except TimeoutError:
        fut.cancel()
        return False


async def _op_error(ctx: ApiContext, op_id: str) -> tuple[str | None, str | None]:
    row = await ctx.pool.fetchrow("SELECT state, error_code, error_message FROM operations WHERE id=$1", op_id)
    if row is None or row["state"] != "failed":
        return None, None
    return row["error_code"], row["error_message"]


async def suspend(ctx: ApiContext, who: Principal, sandbox_id: str, *, wait: bool) -> tuple[SandboxInfo, bool]:
    """Suspend a running or paused sandbox to object storage (see the module docstring); bounded by
    ``suspend_timeout_s``. Raises ``InvalidState`` unless running or paused, ``Conflict`` while a sandbox (a
    fork child) is starting from one of its snapshots (``details.starting_sandbox_id``; nothing changed, retry
    shortly), ``SuspendFailed`` (the promotion failed: the sandbox is ``paused`` and intact;
    ``details.operation_id``)."""
    t0 = time.perf_counter()
    op_id, snap_id = new_id("op"), new_id("snap")
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        check_allowed(SandboxCommand.SUSPEND, row["state"])
        await lifecycle.suspend(conn, sandbox_id, tenant_id=who.tenant_id, state=row["state"], node_id=row["node_id"],
                                generation=row["generation"], operation_id=op_id, snapshot_id=snap_id,
                                actor=who.key_id)
    ctx.relay.kick()
    fault_point("suspend.recorded")
    fut = ctx.waiter.expect_operation(op_id) if wait else None
    await ctx.bus.publish_command(subjects.node_cmd(row["node_id"], "suspend"),
                                  SandboxOpCmd(operation_id=op_id, sandbox_id=sandbox_id,
                                               generation=row["generation"]), msg_id=op_id)
    finished = await _wait(fut, ctx.settings.suspend_timeout_s)
    LIFECYCLE_OPERATION_SECONDS.labels("api", "suspend", "ok" if finished else "pending").observe(
        time.perf_counter() - t0)
    if finished:
        code, message = await _op_error(ctx, op_id)
        if code is not None:
            LIFECYCLE_OPERATIONS.labels("api", "suspend", "failed").inc()
            raise SuspendFailed(f"could not suspend sandbox {sandbox_id}: {message}",
                                 details={"operation_id": op_id, "snapshot_id": snap_id})
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id), finished


async def resume_suspended(ctx: ApiContext, who: Principal, sandbox_id: str, *, wait: bool, fallback: bool,
                           ) -> tuple[SandboxInfo, bool]:
    """Wake a suspended sandbox on a node with room; returns (info, finished within the bound).

    Raises ``InvalidState`` (not suspended), ``QuotaExceeded`` (403 ``quota_exceeded``; it stays
    suspended), ``SnapshotCorrupt`` (502; it stays suspended),
    ``NoCapacity`` (no node has room; it stays suspended), ``SandboxFailed`` (the restore failed)."""
    t0 = time.perf_counter()
    op_id = new_id("op")
    bind_log_context(operation_id=op_id)  # every log line of this request names it
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        if row["state"] != SandboxState.SUSPENDED:
            raise InvalidState(f"sandbox {sandbox_id} is {row['state']}, not suspended",
                               details={"state": row["state"]})
        tpl = await conn.fetchval("SELECT template FROM sandboxes WHERE id=$1", sandbox_id)
        # A suspended sandbox holds no VM and counts against no quota; woken, it does again.
        await quotas.check_sandbox(conn, ctx, who, vcpus=row["vcpus"], memory_mib=row["memory_mib"],
                                   disk_mib=await quotas.sandbox_disk_mib(conn, sandbox_id),
                                   route="resume sandbox", target=sandbox_id)
        await lifecycle.apply(
            conn, sandbox_id, Verb.RESUME, states=SandboxState.SUSPENDED, renew_lease=True,
            operation=NewOperation(op_id, who.tenant_id, "resume"),
            event=SandboxEvent(EventType.RESUMING, tenant_id=who.tenant_id, data={"operation_id": op_id, "fallback": fallback}),
            audit=AuditRecord(who.tenant_id, who.key_id, "sandbox.resume"))
    ctx.relay.kick()
    fault_point("resume.recorded")
    fut = ctx.waiter.expect(sandbox_id, {"resumed", "suspended", "failed"}) if wait else None
    await ctx.bus.publish_command(subjects.SCHEDULER_PLACE, PlaceSandbox(
        operation_id=op_id, sandbox_id=sandbox_id, tenant_id=who.tenant_id, template=tpl,
        resources=Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"]), wake=True, fallback=fallback),
        msg_id=op_id)
    finished = await _wait(fut, ctx.settings.suspend_timeout_s)
    LIFECYCLE_OPERATION_SECONDS.labels("api", "resume_from_s3", "ok" if finished else "pending").observe(
        time.perf_counter() - t0)
    info = sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id)
    if finished:
        code, message = await _op_error(ctx, op_id)
        details = {"operation_id": op_id}
        if code == "snapshot_corrupt":
            raise SnapshotCorrupt(f"cannot resume sandbox {sandbox_id}: {message}", details=details)
        if code == NoCapacity.code:
            raise NoCapacity(f"cannot resume sandbox {sandbox_id}: {message}",
                             details={**details, "retry_after_s": NoCapacity.DEFAULT_RETRY_AFTER_S})
        if info.state == SandboxState.FAILED:
            raise SandboxFailed(f"sandbox {sandbox_id} failed to resume: {info.failure_reason}", details=details)
        if code is not None:
            raise PodbayError(f"cannot resume sandbox {sandbox_id}: {message}", details={**details, "code": code})
    return info, finished


async def auto_resume(ctx: ApiContext, who: Principal, sandbox_id: str) -> None:
    """Resume a suspended or paused sandbox before a data-plane call that asked for it (``auto_resume``)."""
    row = await ctx.pool.fetchrow("SELECT state, node_id, generation FROM sandboxes WHERE id=$1 AND tenant_id=$2",
                                  sandbox_id, who.tenant_id)
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} does not exist", details={"sandbox_id": sandbox_id})
    if row["state"] == SandboxState.SUSPENDED:
        _, finished = await resume_suspended(ctx, who, sandbox_id, wait=True, fallback=False)
        if not finished:
            raise Unavailable(f"sandbox {sandbox_id} is still resuming; retry shortly", details={"retryable": True})
    elif row["state"] == SandboxState.PAUSED:
        await resume(ctx, who, sandbox_id, wait=True)


#: Each sandbox whose suspend (``suspending`` on a node) or wake (``resuming``, no node yet) has its newest
#: unfinished operation: what :func:`republish_unfinished` sends again.
_UNFINISHED_SQL = (
    "SELECT s.id, s.state, s.node_id, s.generation, s.tenant_id, s.template, s.memory_mib, s.vcpus, o.id AS op_id"
    " FROM sandboxes s JOIN LATERAL (SELECT id FROM operations WHERE sandbox_id = s.id AND kind IN"
    f" ('suspend', 'resume') AND state IN ('{OperationState.PENDING}', '{OperationState.RUNNING}')"
    " ORDER BY created_at DESC LIMIT 1) o ON true"
    f" WHERE s.state = '{SandboxState.SUSPENDING}' OR (s.state = '{SandboxState.RESUMING}' AND s.node_id IS NULL)")


async def republish_unfinished(ctx: ApiContext) -> int:
    """At start-up: publish again the command of each suspend or resume that an API which died between its
    commit and its publish left without one (the same ``Nats-Msg-Id``, so a command that did go out is
    dropped as a duplicate or found done by its idempotent handler). Returns how many."""
    rows = await ctx.pool.fetch(_UNFINISHED_SQL)
    for r in rows:
        if r["state"] == SandboxState.SUSPENDING and r["node_id"]:
            await ctx.bus.publish_command(subjects.node_cmd(r["node_id"], "suspend"), SandboxOpCmd(
                operation_id=r["op_id"], sandbox_id=r["id"], generation=r["generation"]), msg_id=r["op_id"])
        elif r["state"] == SandboxState.RESUMING:
            await ctx.bus.publish_command(subjects.SCHEDULER_PLACE, PlaceSandbox(
                operation_id=r["op_id"], sandbox_id=r["id"], tenant_id=r["tenant_id"], template=r["template"],
                resources=Resources(memory_mib=r["memory_mib"], vcpus=r["vcpus"]), wake=True), msg_id=r["op_id"])
    return len(rows)
