"""What every sandbox route and service of the API shares: the ``sandboxes`` row's columns and API shape
(:func:`sandbox_info`), the tenant's row (:func:`load_sandbox`), the audit record of a state-changing call
(:func:`audit`), the bounded waits for an operation's outcome (:func:`await_operation`, :func:`finish`) and
the credential placeholder env of a new sandbox (:data:`GUEST_ENV_SQL`).

It imports no route module and no FastAPI type, so every route module (services/api/routes/, e2b/) and the
service layer (services/api/services/sandbox_service.py, warm.py, ...) import it without an import cycle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg

from podbay.audit import record
from podbay.contracts.access import PLACEHOLDER_PREFIX
from podbay.contracts.api import SandboxInfo
from podbay.contracts.states import OperationState, SandboxState
from podbay.errors import NotFound
from podbay.telemetry import LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS

from ..core.auth import Principal
from ..core.context import ApiContext

__all__ = ["SANDBOX_COLS", "GUEST_ENV_SQL", "sandbox_info", "load_sandbox", "list_sandboxes_of", "load_operation", "audit", "await_operation", "finish"]

#: The columns :func:`sandbox_info` reads (``FROM sandboxes``): ``template`` is the template's key,
#: ``template_alias`` the name its owner gave it, which the API shows (services/api/services/template_access.py).
SANDBOX_COLS = (
    "id, tenant_id, template, template_digest, state, desired_state, node_id, generation, memory_mib, vcpus, disk_mib, "
    "hostname, failure_reason, metadata, created_at, updated_at, lease_s, lease_expires_at, lease_action, "
    "parent_sandbox_id, (SELECT t.alias FROM templates t WHERE t.name = sandboxes.template) AS template_alias"
)

#: SQL expression (``str.format`` with ``tenant``, ``sandbox`` and ``template`` as SQL expressions) giving the
#: placeholder env of a sandbox (``sandboxes.guest_env``): one entry per live, unexpired credential of the
#: tenant whose scope includes the sandbox and its template; NULL when there is none. Kept in SQL so that the
#: warm create stays one statement. Mirrors :func:`podbay.contracts.access.placeholder_env`.
GUEST_ENV_SQL = (
    "(SELECT jsonb_object_agg('" + PLACEHOLDER_PREFIX + "' || upper(replace(c.name, '-', '_')),"
    " 'podbay-credential:' || c.name) FROM credentials c"
    " WHERE c.tenant_id = {tenant} AND c.deleted_at IS NULL AND (c.expires_at IS NULL OR c.expires_at > now())"
    " AND (c.scope_sandboxes IS NULL OR {sandbox} = ANY(c.scope_sandboxes))"
    # Scopes name templates as their owners named them (``alias``); ``{template}`` is the key.
    " AND (c.scope_templates IS NULL OR coalesce((SELECT a.alias FROM templates a WHERE a.name = {template}),"
    " {template}) = ANY(c.scope_templates)))"
)


def sandbox_info(row: asyncpg.Record | dict[str, Any], operation_id: str | None = None) -> SandboxInfo:
    """The API shape of a ``sandboxes`` row (:data:`SANDBOX_COLS`); ``template`` shows ``template_alias`` when
    the row has it (the template's key otherwise)."""
    return SandboxInfo(
        id=row["id"],
        template=row.get("template_alias") or row["template"],
        template_digest=row.get("template_digest"),
        state=row["state"],
        desired_state=row["desired_state"],
        node_id=row["node_id"],
        generation=row["generation"],
        memory_mib=row["memory_mib"],
        vcpus=row["vcpus"],
        disk_mib=row.get("disk_mib"),
        hostname=row["hostname"],
        failure_reason=row["failure_reason"],
        metadata=row["metadata"] or {},
        lease_s=row["lease_s"],
        lease_expires_at=row["lease_expires_at"],
        on_lease_expiry=row["lease_action"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        parent_id=row.get("parent_sandbox_id"),
        operation_id=operation_id,
    )


async def load_sandbox(conn: Any, tenant_id: str, sandbox_id: str, *, for_update: bool = False) -> asyncpg.Record:
    """The tenant's sandbox row, or ``NotFound`` (also for another tenant's sandbox, docs/DESIGN.md §6)."""
    sql = f"SELECT {SANDBOX_COLS} FROM sandboxes WHERE id = $1 AND tenant_id = $2"
    row = await conn.fetchrow(sql + (" FOR UPDATE" if for_update else ""), sandbox_id, tenant_id)
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} does not exist", details={"sandbox_id": sandbox_id})
    return row


async def list_sandboxes_of(pool: Any, tenant_id: str, *, deleted: bool, limit: int) -> list[asyncpg.Record]:
    """Up to ``limit`` of ``tenant_id``'s sandbox rows (:data:`SANDBOX_COLS`), newest first; ``deleted``
    ones only when asked."""
    sql = f"SELECT {SANDBOX_COLS} FROM sandboxes WHERE tenant_id = $1"
    if not deleted:
        sql += f" AND state <> '{SandboxState.DELETED}'"
    return list(await pool.fetch(sql + " ORDER BY created_at DESC LIMIT $2", tenant_id, limit))


async def load_operation(pool: Any, tenant_id: str, operation_id: str) -> asyncpg.Record | None:
    """``tenant_id``'s operation row ``operation_id`` (``id, kind, sandbox_id, state, error_code,
    error_message, created_at, finished_at, node_id, progress, data``), or None (none, or another tenant's)."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT id, kind, sandbox_id, state, error_code, error_message, created_at, finished_at, node_id,"
        " progress, data FROM operations WHERE id = $1 AND tenant_id = $2", operation_id, tenant_id)
    return row


#: While a call waits for its operation's outcome event, how often it also reads the operation's row (s).
OUTCOME_RECHECK_S = 2.0
_ENDED = (OperationState.SUCCEEDED, OperationState.FAILED)


async def finish(ctx: ApiContext, tenant_id: str, sandbox_id: str, op_id: str,
                 fut: asyncio.Future[dict[str, object]] | None, kind: str, t0: float) -> tuple[SandboxInfo, bool]:
    """Wait (bounded by ``create_timeout_s``) for the operation's outcome event ``fut``, or for its row to show
    it ended (read every :data:`OUTCOME_RECHECK_S` s, in case the event was missed), and record the
    operation's metrics (``kind``; ``t0``: its ``time.perf_counter()`` start); returns (the sandbox now,
    finished within the bound)."""
    finished = False
    if fut is not None:
        deadline = time.monotonic() + ctx.settings.create_timeout_s
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, min(
                    OUTCOME_RECHECK_S, deadline - time.monotonic())))
                finished = True
                break
            except TimeoutError:
                pass
            # The event travels on core NATS: one published while this process's connection was moving to
            # another server (a NATS server lost) never arrives. The operation's row, written in the same
            # transaction as the event, says whether it ended; without this the call waited out the bound.
            if await ctx.pool.fetchval("SELECT state FROM operations WHERE id = $1", op_id) in _ENDED:
                finished = True
                break
            if time.monotonic() >= deadline:
                break
        if not fut.done():
            fut.cancel()
    row = await load_sandbox(ctx.pool, tenant_id, sandbox_id)
    outcome = "ok" if finished and row["state"] != SandboxState.FAILED else ("timeout" if not finished else "failed")
    LIFECYCLE_OPERATION_SECONDS.labels("api", kind, outcome).observe(time.perf_counter() - t0)
    LIFECYCLE_OPERATIONS.labels("api", kind, outcome).inc()
    return sandbox_info(row, op_id), finished


async def await_operation(ctx: ApiContext, fut: asyncio.Future[dict[str, object]] | None,
                          ) -> tuple[bool, dict[str, object]]:
    """Wait (bounded by ``create_timeout_s``) for an operation notice; returns (finished, notice body)."""
    if fut is None:
        return False, {}
    try:
        return True, await asyncio.wait_for(fut, timeout=ctx.settings.create_timeout_s)
    except TimeoutError:
        return False, {}


async def audit(conn: Any, who: Principal, action: str, target: str | None, *,
                detail: dict[str, Any] | None = None, sandbox_id: str | None = None) -> None:
    """Append the audit row of a state-changing call (and its event, through the outbox) in ``conn``'s
    transaction: :func:`podbay.audit.record` with the caller's tenant and key. ``sandbox.*`` actions name the
    sandbox in ``sandbox_id`` too, so ``GET /v1/audit?sandbox_id=`` finds them."""
    if sandbox_id is None and action.startswith("sandbox."):
        sandbox_id = target
    await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action=action, target=target,
                 sandbox_id=sandbox_id, detail=detail)
