"""What every sandbox route and service of the API shares: the ``sandboxes`` row's columns and API shape
(:func:`sandbox_info`), the tenant's row (:func:`load_sandbox`), the audit record of a state-changing call
(:func:`audit`), the bounded waits for an operation's outcome (:func:`await_operation`, :func:`finish`) and
the credential placeholder env of a new sandbox (:data:`GUEST_ENV_SQL`); and the named queries of E2B's
protocol over a sandbox (``e2b_sandboxes``: its create settings, network configuration and cold-resume
snapshot; ``e2b_metrics``: its metrics samples; E2B's listing), which services/api/e2b/ calls.

It imports no route module and no FastAPI type, so every route module (services/api/routes/, e2b/) and the
service layer (services/api/services/sandbox_service.py, warm.py, ...) import it without an import cycle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
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

__all__ = ["SANDBOX_COLS", "GUEST_ENV_SQL", "sandbox_info", "load_sandbox", "list_sandboxes_of", "load_operation", "audit",
           "await_operation", "finish", "sandbox_state", "template_name_of", "e2b_page", "insert_e2b_settings",
           "copy_e2b_settings", "store_e2b_network", "e2b_network", "e2b_envd_row", "e2b_iam_tokens",
           "cold_resume_snapshot", "set_cold_resume", "clear_cold_resume", "sampled_within_a_second",
           "add_metrics_sample", "metrics_samples"]

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


async def sandbox_state(pool: Any, sandbox_id: str) -> str | None:
    """The sandbox's ``state`` (any tenant's: the caller checked the tenant), or None when there is no row."""
    state: str | None = await pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sandbox_id)
    return state


async def template_name_of(conn: Any, sandbox_id: str) -> str | None:
    """The name the tenant gave the sandbox's template (``templates.alias``; ``sandboxes.template`` is its key,
    shown when the template row has no alias), or None when there is no such sandbox."""
    name: str | None = await conn.fetchval(
        "SELECT coalesce(t.alias, s.template) FROM sandboxes s LEFT JOIN templates t ON t.name = s.template"
        " WHERE s.id=$1", sandbox_id)
    return name


# E2B's protocol over a sandbox (services/api/e2b/). ``e2b_sandboxes`` holds one row per sandbox created with
# E2B's settings (migrations: env_vars, auto_resume, auto_pause_filesystem, network, iam_tokens,
# cold_resume_snapshot, and the port edge's allow_public_traffic, mask_request_host); ``e2b_metrics`` the
# metrics samples of its metrics route.

async def e2b_page(pool: Any, tenant_id: str, states: Sequence[str], *, metadata: Mapping[str, str],
                   template: str | None, started_after: datetime | None, ascending: bool, limit: int,
                   cursor: tuple[datetime, str] | None) -> list[asyncpg.Record]:
    """Up to ``limit`` of the tenant's sandboxes in ``states`` (podbay's states) whose metadata holds
    ``metadata``, of template ``template`` (the name its owner gave; None: any), created at or after
    ``started_after`` (None: any), after ``cursor`` ((created_at, id) of the previous page's last row; None:
    from the start), ordered by creation (``ascending`` or newest first). Rows: ``id``, ``template`` (the
    name the tenant gave, else the key), ``state``, ``vcpus``, ``memory_mib``, ``metadata``, ``created_at``,
    ``lease_expires_at``."""
    sql = ("SELECT id, coalesce(template_alias, template) AS template, state, vcpus, memory_mib, metadata, created_at, lease_expires_at"
           " FROM (SELECT s.*, (SELECT t.alias FROM templates t WHERE t.name = s.template) AS template_alias"
           " FROM sandboxes s) sandboxes"
           " WHERE tenant_id = $1 AND state = ANY($2::text[]) AND metadata @> $3::jsonb"
           " AND ($5::text IS NULL OR template_alias = $5) AND ($6::timestamptz IS NULL OR created_at >= $6)")
    args: list[Any] = [tenant_id, list(states), dict(metadata), limit, template, started_after]
    if cursor is not None:
        sql += f" AND (created_at, id) {'>' if ascending else '<'} ($7, $8)"
        args += [cursor[0], cursor[1]]
    direction = "ASC" if ascending else "DESC"
    sql += f" ORDER BY created_at {direction}, id {direction} LIMIT $4"
    return list(await pool.fetch(sql, *args))


async def insert_e2b_settings(pool: Any, sandbox_id: str, *, env_vars: Mapping[str, str], auto_resume: bool,
                              auto_pause_filesystem: bool) -> None:
    """Keep a new sandbox's E2B create settings: the default environment of its envd commands, whether
    traffic resumes it, whether the pause at its timeout drops memory (read by the node)."""
    await pool.execute("INSERT INTO e2b_sandboxes (sandbox_id, env_vars, auto_resume, auto_pause_filesystem)"
                       " VALUES ($1, $2, $3, $4)", sandbox_id, dict(env_vars), auto_resume, auto_pause_filesystem)


async def copy_e2b_settings(pool: Any, parent: str, children: Sequence[str]) -> None:
    """Give ``children`` the parent's E2B create settings (environment, auto-resume, filesystem-only pause,
    network configuration, workload identity tokens); a child that has a row already keeps it."""
    await pool.execute(
        "INSERT INTO e2b_sandboxes (sandbox_id, env_vars, auto_resume, auto_pause_filesystem, network, iam_tokens)"
        " SELECT c, e.env_vars, e.auto_resume, e.auto_pause_filesystem, e.network, e.iam_tokens"
        " FROM e2b_sandboxes e, unnest($2::text[]) AS c"
        " WHERE e.sandbox_id=$1"
        " ON CONFLICT DO NOTHING", parent, list(children))


async def store_e2b_network(pool: Any, sandbox_id: str, network: dict[str, Any] | None,
                            tokens: dict[str, dict[str, str]] | None = None) -> None:
    """Keep E2B's network configuration (and, when given, the ``iam.tokens``) on ``e2b_sandboxes``."""
    await pool.execute(
        "INSERT INTO e2b_sandboxes (sandbox_id, network, iam_tokens) VALUES ($1, $2, $3)"
        " ON CONFLICT (sandbox_id) DO UPDATE SET network = EXCLUDED.network,"
        " iam_tokens = coalesce(EXCLUDED.iam_tokens, e2b_sandboxes.iam_tokens)",
        sandbox_id, network, tokens or None)


async def e2b_network(pool: Any, sandbox_id: str) -> dict[str, Any] | None:
    """E2B's network configuration kept for the sandbox (:func:`store_e2b_network`), or None."""
    network: dict[str, Any] | None = await pool.fetchval(
        "SELECT network FROM e2b_sandboxes WHERE sandbox_id = $1", sandbox_id)
    return network


async def e2b_envd_row(pool: Any, sandbox_id: str) -> asyncpg.Record | None:
    """What E2B's envd proxy (services/api/edge/envd.py) decides a request on, or None when there is no such
    sandbox (any tenant's: the proxy checked the envd token): ``tenant_id``, ``state``, ``env_vars`` (E2B's
    create-time ``envVars``; None without an ``e2b_sandboxes`` row) and ``auto_resume`` (false without one)."""
    row: asyncpg.Record | None = await pool.fetchrow(
        "SELECT s.tenant_id, s.state, e.env_vars, COALESCE(e.auto_resume, false) AS auto_resume FROM sandboxes s"
        " LEFT JOIN e2b_sandboxes e ON e.sandbox_id = s.id WHERE s.id = $1", sandbox_id)
    return row


async def e2b_iam_tokens(pool: Any, sandbox_id: str) -> dict[str, dict[str, str]] | None:
    """The sandbox's workload identity tokens (``{name: {"audience", "tokenType"}}``), or None."""
    tokens: dict[str, dict[str, str]] | None = await pool.fetchval(
        "SELECT iam_tokens FROM e2b_sandboxes WHERE sandbox_id = $1", sandbox_id)
    return tokens


async def cold_resume_snapshot(pool: Any, sandbox_id: str) -> str | None:
    """The disk snapshot the sandbox's next resume boots afresh from (after a filesystem-only pause), or None."""
    snapshot_id: str | None = await pool.fetchval(
        "SELECT cold_resume_snapshot FROM e2b_sandboxes WHERE sandbox_id=$1", sandbox_id)
    return snapshot_id


async def set_cold_resume(pool: Any, sandbox_id: str, snapshot_id: str | None) -> None:
    """The sandbox's next resume boots afresh from disk snapshot ``snapshot_id`` (None: resumes its memory)."""
    await pool.execute(
        "INSERT INTO e2b_sandboxes (sandbox_id, cold_resume_snapshot) VALUES ($1, $2)"
        " ON CONFLICT (sandbox_id) DO UPDATE SET cold_resume_snapshot = EXCLUDED.cold_resume_snapshot",
        sandbox_id, snapshot_id)


async def clear_cold_resume(pool: Any, sandbox_id: str) -> None:
    """Forget the sandbox's cold-resume snapshot (it is being used), if it has a row."""
    await pool.execute("UPDATE e2b_sandboxes SET cold_resume_snapshot = NULL WHERE sandbox_id=$1", sandbox_id)


async def sampled_within_a_second(pool: Any, sandbox_id: str) -> bool:
    """Whether a metrics sample of the sandbox was taken within the last second."""
    return bool(await pool.fetchval(
        "SELECT true FROM e2b_metrics WHERE sandbox_id=$1 AND at > now() - interval '1 second'", sandbox_id))


async def add_metrics_sample(pool: Any, sandbox_id: str, at: datetime, sample: dict[str, Any], keep: int) -> None:
    """Store a metrics sample taken at ``at`` (one per instant: a second one is dropped) and, in the same
    statement, drop the samples older than the ``keep`` + 1 newest before it (``keep`` >= 0)."""
    await pool.execute(
        "WITH i AS (INSERT INTO e2b_metrics (sandbox_id, at, sample) VALUES ($1, $2, $3)"
        " ON CONFLICT DO NOTHING)"
        " DELETE FROM e2b_metrics WHERE sandbox_id=$1 AND at < (SELECT at FROM e2b_metrics WHERE sandbox_id=$1"
        " ORDER BY at DESC OFFSET $4 LIMIT 1)",
        sandbox_id, at, sample, keep)


async def metrics_samples(pool: Any, sandbox_id: str, start: datetime | None,
                          end: datetime | None) -> list[dict[str, Any]]:
    """The sandbox's metrics samples taken from ``start`` to ``end`` (both inclusive, to the second; None:
    unbounded), oldest first."""
    rows = await pool.fetch(
        "SELECT sample FROM e2b_metrics WHERE sandbox_id=$1 AND ($2::timestamptz IS NULL OR at >= $2)"
        " AND ($3::timestamptz IS NULL OR at < $3 + interval '1 second') ORDER BY at", sandbox_id, start, end)
    return [r["sample"] for r in rows]
