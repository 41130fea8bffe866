"""Create from a warm slot (docs/DESIGN.md §5, warm pools): the short path of ``POST /v1/sandboxes``.

1. One transaction: claim the oldest ready slot of the template (``FOR UPDATE SKIP LOCKED``, so two
   creates never get the same slot), insert the sandbox with the slot's id as ``starting`` at generation 1
   on the slot's node, its operation and the ``created`` event (outbox).
2. One NATS request over the API's open connection to ``podbay.warm.<node>.claim``; the node resumes the
   slot, runs the after-restore hygiene and commits ``running`` with the ``started`` event, then answers.

No scheduler and no JetStream hop: the slot's node is the placement. When no slot is ready the caller
takes the restore path. When the node refuses the slot or does not answer in ``warm_claim_timeout_s``,
this sandbox goes back to ``pending`` without a node and through the scheduler like any other create;
the node fences its late answer by generation, so the pool never makes a create fail.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

import asyncpg

from podbay.contracts.events import EventType
from podbay.contracts import subjects
from podbay.contracts.api import SandboxCreate, SandboxInfo
from podbay.contracts.messages import Event, PlaceSandbox, Resources, WarmClaim, WarmClaimReply
from podbay import lifecycle
from podbay.contracts.states import NodeState, OperationState, SandboxState
from podbay.errors import SandboxFailed
from podbay.lifecycle import OperationOutcome, Verb
from podbay.logs import bind_log_context
from podbay.outbox import new_id, sandbox_event
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS

from ..core.auth import Principal
from ..core.context import ApiContext
from .idempotency import IdempotencyKey
from .quotas import USAGE_SQL_FOR, lock_tenant
from .sandbox_lookup import GUEST_ENV_SQL, finish, load_sandbox, sandbox_info
from .template_access import RESOLVE_SQL

__all__ = ["warm_create", "CLAIM_SQL"]

log = logging.getLogger("podbay.api.warm")

#: One statement, after the tenant's quota lock (services/api/services/quotas.lock_tenant) in the same transaction:
#: look the template up (its current digest; the
#: requested memory and vCPUs, $2 and $4, must match it when given), claim the oldest ready slot of it at
#: that digest (a slot another claim holds is skipped, so no slot goes out twice), insert the sandbox with
#: the slot's id (``starting``, generation 1, the slot's node, event seq 1, its egress policy and credential
#: placeholders; podbay.lifecycle.insert_sql, so the row is born as every other), its operation, the audit record and its event, and the ``created`` event (payloads patched
#: with the id, which is known only here). Nothing is written when no slot is ready (or the template does
#: not exist or does not match: the restore path then says why). With an ``Idempotency-Key`` ($19, its request
#: hash $20) the same statement records the key, so a keyed warm create is still one statement; a key that
#: has a row already (a retry) claims nothing here.
CLAIM_SQL = (
    # The tenant's use, read after services/api/services/quotas.lock_tenant in the same transaction; $21-$24 are its
    # sandboxes, vCPU, memory and disk limits. A create over one claims nothing: the restore path refuses it.
    "WITH q AS (" + USAGE_SQL_FOR.format(tenant="$3") + "),"
    # The template name $1 means to the tenant: its own of that name, else the shared one; its key names
    # the slots and the sandbox row (services/api/services/template_access.py). In this statement, so the warm create
    # stays one round trip.
    " r AS (" + RESOLVE_SQL.format(alias="$1", tenant="$3") + "),"
    " t AS (SELECT name, digest, memory_mib, vcpus FROM templates WHERE name=(SELECT name FROM r)"
    " AND ($2::integer IS NULL OR memory_mib=$2) AND ($4::integer IS NULL OR vcpus=$4)"
    " AND (SELECT sandboxes FROM q) + 1 <= $21 AND (SELECT vcpus FROM q) + vcpus <= $22"
    " AND (SELECT memory_mib FROM q) + memory_mib <= $23"
    " AND (SELECT disk_mib FROM q) + ceil(coalesce(size_bytes, 0) / 1048576.0) <= $24"
    # A key with a row (live or expired) takes the restore path, which answers a retry from the row or
    # replaces an expired one (services/api/services/idempotency.py); the common case, a new key, stays here.
    " AND NOT EXISTS (SELECT 1 FROM idempotency_keys WHERE tenant_id=$3 AND key=$19::text)),"
    " c AS (SELECT w.id FROM warm_slots w JOIN t ON w.template=t.name AND w.template_digest=t.digest"
    " WHERE w.state='ready'"
    # Only on nodes that take placements (not draining, drained or lost).
    f" AND w.node_id IN (SELECT id FROM nodes WHERE state='{NodeState.READY}')"
    " ORDER BY w.created_at LIMIT 1 FOR UPDATE OF w SKIP LOCKED),"
    " slot AS (UPDATE warm_slots w SET state='claimed', claimed_at=now() FROM c WHERE w.id=c.id"
    " RETURNING w.id, w.node_id),"
    " sbx AS (" + lifecycle.insert_sql(SandboxState.STARTING, {
        "id": "slot.id", "tenant_id": "$3", "template": "t.name", "template_digest": "t.digest",
        "node_id": "slot.node_id", "generation": "1", "memory_mib": "t.memory_mib", "vcpus": "t.vcpus",
        "metadata": "$6", "lease_s": "$7", "lease_action": "$8", "event_seq": "1", "egress_policy": "$17::jsonb",
        "guest_env": GUEST_ENV_SQL.format(tenant="$3", sandbox="slot.id", template="t.name"),
    }, select_from="slot, t", returning="*") + "),"
    " op AS (INSERT INTO operations (id, tenant_id, sandbox_id, kind, state)"
    " SELECT $9, $3, id, 'create', 'running' FROM sbx),"
    " aud AS (INSERT INTO audit_log (tenant_id, actor, action, target, sandbox_id, detail)"
    " SELECT $3, $10, 'sandbox.create', id, id, $16::jsonb FROM sbx RETURNING id, sandbox_id),"
    " aev AS (INSERT INTO outbox (event_id, subject, payload) SELECT $18, $5,"
    " jsonb_set(jsonb_set(jsonb_set($15::jsonb, '{sandbox_id}', to_jsonb(sandbox_id)), '{data,audit_id}',"
    " to_jsonb(id)), '{data,target}', to_jsonb(sandbox_id)) FROM aud),"
    " ev AS (INSERT INTO outbox (event_id, subject, payload) SELECT $11, $12 || id || $13,"
    " jsonb_set(jsonb_set($14::jsonb, '{sandbox_id}', to_jsonb(id)), '{node_id}', to_jsonb(node_id)) FROM sbx),"
    # A plain insert: a concurrent create that recorded the key first makes this statement fail as a whole
    # (UniqueViolationError), so no slot is claimed and no sandbox is written without its key.
    " idem AS (INSERT INTO idempotency_keys (tenant_id, key, request_hash, sandbox_id, operation_id)"
    " SELECT $3, $19::text, $20, id, $9 FROM sbx WHERE $19::text IS NOT NULL)"
    " SELECT * FROM sbx"
)


async def warm_create(ctx: ApiContext, who: Principal, body: SandboxCreate, t0: float,
                      idem: IdempotencyKey | None = None) -> SandboxInfo | None:
    """Create the sandbox from a warm slot of ``body.template``; None when no slot is ready, or the template
    does not exist or does not match the requested resources, or ``idem``'s key has a row already (nothing
    was written; the caller's restore path looks the template up and answers why, or answers from the key).

    Returns the running sandbox (also after a fallback to a restore), or raises ``SandboxFailed``.
    Hops recorded in ``podbay_hop_seconds{service="api"}``: ``warm_claim_db``, ``warm_node``.
    """
    op_id = new_id("op")

    bind_log_context(operation_id=op_id)  # every log line of this request names it
    event = sandbox_event("", EventType.CREATED, seq=1, state="starting", tenant_id=who.tenant_id, generation=1,
                          data={"template": body.template, "operation_id": op_id, "warm": True})
    subject_head, subject_tail = subjects.sandbox_event("\x00", EventType.CREATED).split("\x00")
    # The audit row's event, as podbay.audit.record would emit it (its sandbox id and row id patched in SQL).
    audit_detail = {"template": body.template, "network": body.network is not None, "warm": True}
    audit_event = Event(id=new_id("evt"), type="sandbox.create", tenant_id=who.tenant_id, at=datetime.now(UTC),
                        data={"audit_id": 0, "actor": who.key_id, "target": None, **audit_detail})
    t = time.perf_counter()
    try:
        async with ctx.pool.acquire() as conn, conn.transaction():
            quota = await lock_tenant(conn, ctx.settings, who.tenant_id)
            row = await conn.fetchrow(
                CLAIM_SQL, body.template, body.memory_mib, who.tenant_id, body.vcpus,
                subjects.audit_event(who.tenant_id, "sandbox.create"), body.metadata,
                body.lease_s or ctx.settings.lease_s, body.on_lease_expiry or ctx.settings.lease_action, op_id, who.key_id,
                event.id, subject_head, subject_tail, json.loads(event.model_dump_json()),
                json.loads(audit_event.model_dump_json()), audit_detail,
                body.network.model_dump(mode="json") if body.network is not None else None,
                audit_event.id, idem.key if idem else None, idem.request_hash if idem else None,
                quota.sandboxes, quota.vcpus, quota.memory_mib, quota.disk_mib)
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name != "idempotency_keys_pkey":
            raise
        return None  # a concurrent create with this key committed first: the caller answers from its row
    if row is None:
        return None
    sandbox_id, node_id, hostname = row["id"], row["node_id"], row["hostname"]
    HOP_SECONDS.labels("api", "warm_claim_db").observe(time.perf_counter() - t)
    reply = await _ask_node(ctx, node_id, WarmClaim(operation_id=op_id, sandbox_id=sandbox_id,
                                                    tenant_id=who.tenant_id, generation=1, hostname=hostname))
    ctx.relay.kick()  # the ``created`` event; after the claim, so the relay does not compete with it
    if reply.ok:
        # The row as the node left it, without reading it back: running since the node's commit.
        info = sandbox_info({**dict(row), "template_alias": body.template, "state": "running",
                             "updated_at": reply.updated_at or row["updated_at"]}, op_id)
        LIFECYCLE_OPERATION_SECONDS.labels("api", "create_warm", "ok").observe(time.perf_counter() - t0)
        LIFECYCLE_OPERATIONS.labels("api", "create_warm", "ok").inc()
        return info
    log.warning("warm slot %s on %s not handed over (%s): restoring instead", sandbox_id, node_id, reply.error)
    LIFECYCLE_OPERATIONS.labels("api", "create_warm", "fallback").inc()
    return await _fall_back(ctx, who, row, sandbox_id, op_id, t0)


async def _ask_node(ctx: ApiContext, node_id: str, claim: WarmClaim) -> WarmClaimReply:
    t = time.perf_counter()
    try:
        msg = await ctx.bus.nc.request(subjects.warm_claim(node_id), claim.model_dump_json().encode(),
                                       timeout=ctx.settings.warm_claim_timeout_s)
        return WarmClaimReply.model_validate_json(msg.data)
    except Exception as exc:  # no responder, timeout, garbage: all mean "not from this slot"
        return WarmClaimReply(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        HOP_SECONDS.labels("api", "warm_node").observe(time.perf_counter() - t)


async def _fall_back(ctx: ApiContext, who: Principal, row: asyncpg.Record, sandbox_id: str, op_id: str,
                     t0: float) -> SandboxInfo:
    """Send the already recorded sandbox (``row``) through the scheduler (restore path) and wait for it."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        back = await lifecycle.apply(conn, sandbox_id, Verb.REQUEUE, states=SandboxState.STARTING, generation=1,
                                     set_node=None,
                                     operation=OperationOutcome(op_id, OperationState.PENDING, finished=None))
    if back is None:
        # The node committed after all (its answer was lost or late): the sandbox runs or moved on.
        return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id), op_id)
    fut = ctx.waiter.expect(sandbox_id, {"started", "failed"})
    await ctx.bus.publish_command(
        subjects.SCHEDULER_PLACE,
        PlaceSandbox(operation_id=op_id, sandbox_id=sandbox_id, tenant_id=who.tenant_id, template=row["template"],
                     resources=Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"])),
        msg_id=op_id)
    info, _ = await finish(ctx, who.tenant_id, sandbox_id, op_id, fut, "create", t0)
    if info.state == "failed":
        raise SandboxFailed(f"sandbox {sandbox_id} failed to start: {info.failure_reason}",
                            details={"sandbox_id": sandbox_id, "operation_id": op_id})
    return info
