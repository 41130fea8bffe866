"""The gateway's PostgreSQL side: a sandbox's policy and tenant, its credentials, and every decision that is
audited (docs/DESIGN.md §4, §6). No mitmproxy here.

Each audited decision is one transaction: the ``audit_log`` row (through :func:`podbay.audit.record`, which
also emits ``podbay.evt.audit.<tenant>.<action>``) plus an egress event on
``podbay.evt.egress.<sandbox>.<type>`` in the outbox; the caller kicks the :class:`~podbay.outbox.Relay`.

A credential use is counted and recorded under ``pg_advisory_xact_lock`` keyed by the credential id, so two
gateways (or two connections of one) that race for the last use of a minute agree: the count of allowed
``credential.use`` rows in the last 60 s and the new row are read and written under the same lock.

Errors: asyncpg errors are converted to :class:`podbay.errors.Unavailable` (retryable) at this boundary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from pydantic import ValidationError

from podbay import audit
from podbay.contracts import subjects
from podbay.contracts.egress import EgressPolicy
from podbay.contracts.messages import Event
from podbay.errors import Unavailable
from podbay.outbox import emit, new_id

from .shaping import CredentialRow, over_rate_limit

__all__ = ["SandboxContext", "GatewayStore", "UseVerdict"]

log = logging.getLogger("podbay.gateway.store")

# The gateway's advisory-lock namespace (first key of the two-int form), so it cannot collide with the
# migration lock or another service's locks.
_CRED_LOCK_NS = 0x70627763  # "pbwc"


#: The sandbox id a builder VM's binding carries (services/nodeagent/build/builder.py).
BUILDER_PREFIX = "build-"


@dataclass(frozen=True)
class SandboxContext:
    """What a connection is decided against. ``policy`` is ``None`` when neither the sandbox nor its
    template has one (deny all) or when the stored JSON does not validate (fail closed, logged)."""

    sandbox_id: str
    tenant_id: str
    template: str
    generation: int
    state: str
    policy: EgressPolicy | None
    #: E2B's ``iam.tokens`` of the sandbox: ``{name: {"audience", "tokenType"}}`` (empty without workload identity).
    iam_tokens: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class UseVerdict:
    """Outcome of :meth:`GatewayStore.use_credential`: ``allowed``, or the refusal ``code``
    (``credential_expired`` / ``credential_rate_limited``) with a message; ``audit_id`` of the row written."""

    allowed: bool
    code: str
    message: str
    audit_id: int


class GatewayStore:
    """Queries and audited writes of one gateway (``actor`` = ``gateway:<node>``)."""

    def __init__(self, pool: asyncpg.Pool, node_id: str) -> None:
        self._pool = pool
        self.actor = f"gateway:{node_id}"
        self.node_id = node_id

    async def sandbox(self, sandbox_id: str) -> SandboxContext | None:
        """The sandbox's context, or ``None`` when there is no such row (a warm slot not yet claimed, or a
        sandbox already gone): the caller denies."""
        try:
            row = await self._pool.fetchrow(
                "SELECT s.id, s.tenant_id, s.template, s.generation, s.state,"
                " coalesce(s.egress_policy, t.egress_policy) AS policy, e.iam_tokens"
                " FROM sandboxes s LEFT JOIN templates t ON t.name = s.template"
                " LEFT JOIN e2b_sandboxes e ON e.sandbox_id = s.id WHERE s.id = $1", sandbox_id)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"gateway cannot read sandbox {sandbox_id}: {exc}") from exc
        if row is None:
            return await self._build(sandbox_id) if sandbox_id.startswith(BUILDER_PREFIX) else None
        policy: EgressPolicy | None = None
        if row["policy"] is not None:
            try:
                policy = EgressPolicy.model_validate(row["policy"])
            except ValidationError as exc:
                log.warning("sandbox=%s stored egress policy does not validate, denying all: %s", sandbox_id, exc)
        return SandboxContext(row["id"], row["tenant_id"], row["template"], int(row["generation"]), row["state"],
                              policy, dict(row["iam_tokens"] or {}))

    async def secret(self, tenant_id: str, name: str) -> CredentialRow | None:
        """The tenant's live E2B secret (a credential with an ``e2b_secrets`` row, services/api/e2b/secrets.py)
        named ``name``, which a ``${e2b.secrets.<name>}`` placeholder in the sandbox's own rules names; ``None``
        when there is none. A podbay credential that is not an E2B secret is never found: its ``hosts`` and
        scope decide where it goes, and a rule must not send it elsewhere."""
        try:
            r = await self._pool.fetchrow(
                "SELECT c.id, c.tenant_id, c.name, c.hosts, c.path_prefix, c.header, c.format, c.expires_at,"
                " c.rate_limit_per_min, c.backend, c.ciphertext, c.secret_ref FROM credentials c"
                " JOIN e2b_secrets e ON e.credential_id = c.id AND e.tenant_id = c.tenant_id"
                " WHERE c.tenant_id = $1 AND c.name = $2 AND c.deleted_at IS NULL", tenant_id, name)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"gateway cannot read secret {name}: {exc}") from exc
        if r is None:
            return None
        return CredentialRow(id=r["id"], tenant_id=r["tenant_id"], name=r["name"], hosts=tuple(r["hosts"]),
                             header=r["header"], format=r["format"], backend=r["backend"],
                             path_prefix=r["path_prefix"], expires_at=r["expires_at"],
                             rate_limit_per_min=r["rate_limit_per_min"], ciphertext=r["ciphertext"],
                             secret_ref=r["secret_ref"])

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    async def _build(self, vm_id: str) -> SandboxContext | None:
        """A template build's builder VM (``build-<build id>``, services/nodeagent/build/): decided like a
        sandbox of the template being built, under the build's policy, while the build runs."""
        try:
            row = await self._pool.fetchrow(
                "SELECT id, tenant_id, name, egress_policy FROM template_builds WHERE id = $1 AND state = 'running'",
                vm_id.removeprefix(BUILDER_PREFIX))
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"gateway cannot read build {vm_id}: {exc}") from exc
        if row is None:
            return None
        policy: EgressPolicy | None = None
        if row["egress_policy"] is not None:
            try:
                policy = EgressPolicy.model_validate(row["egress_policy"])
            except ValidationError as exc:
                log.warning("build=%s stored egress policy does not validate, denying all: %s", row["id"], exc)
        return SandboxContext(vm_id, row["tenant_id"], row["name"], 1, "running", policy)

    async def credentials(self, ctx: SandboxContext) -> list[CredentialRow]:
        """The tenant's live credentials in scope for this sandbox and its template (host and path are
        matched by the caller)."""
        try:
            rows = await self._pool.fetch(
                "SELECT id, tenant_id, name, hosts, path_prefix, header, format, expires_at, rate_limit_per_min,"
                " backend, ciphertext, secret_ref FROM credentials WHERE tenant_id = $1 AND deleted_at IS NULL"
                " AND (scope_sandboxes IS NULL OR $2 = ANY(scope_sandboxes))"
                " AND (scope_templates IS NULL OR $3 = ANY(scope_templates))",
                ctx.tenant_id, ctx.sandbox_id, ctx.template)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"gateway cannot read credentials: {exc}") from exc
        return [CredentialRow(id=r["id"], tenant_id=r["tenant_id"], name=r["name"], hosts=tuple(r["hosts"]),
                              header=r["header"], format=r["format"], backend=r["backend"],
                              path_prefix=r["path_prefix"], expires_at=r["expires_at"],
                              rate_limit_per_min=r["rate_limit_per_min"], ciphertext=r["ciphertext"],
                              secret_ref=r["secret_ref"]) for r in rows]

    async def record_denial(self, *, tenant_id: str | None, sandbox_id: str, destination: str, reason: str,
                            message: str, detail: dict[str, Any] | None = None) -> int:
        """Audit ``egress.deny`` (decision deny) and emit ``egress.<sandbox>.denied``; returns the audit id."""
        data = {"destination": destination, "reason": reason, "message": message, **(detail or {})}
        return await self._audited(tenant_id, sandbox_id, action="egress.deny", target=destination,
                                   decision="deny", detail=data, event_type="denied")

    async def use_credential(self, cred: CredentialRow, *, sandbox_id: str, host: str, method: str,
                             path: str) -> UseVerdict:
        """Decide and record one use of ``cred``: expired -> refused; over its per-minute limit -> refused;
        else an allowed ``credential.use`` row. Each outcome is one audit row and one egress event."""
        detail = {"host": host, "method": method, "path": path, "credential": cred.name}
        now = datetime.now(UTC)
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                if cred.expires_at is not None and cred.expires_at <= now:
                    msg = f"credential {cred.name} expired at {cred.expires_at.isoformat()}"
                    aid = await self._write(conn, cred.tenant_id, sandbox_id, action="credential.use",
                                            target=cred.id, decision="deny",
                                            detail={**detail, "reason": "credential_expired"},
                                            event_type="credential_refused")
                    return UseVerdict(False, "credential_expired", msg, aid)
                if cred.rate_limit_per_min is not None:
                    await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", _CRED_LOCK_NS, cred.id)
                    used = await conn.fetchval(
                        "SELECT count(*) FROM audit_log WHERE action = 'credential.use' AND decision = 'allow'"
                        " AND target = $1 AND at > now() - interval '60 seconds'", cred.id)
                    if over_rate_limit(int(used), cred.rate_limit_per_min):
                        msg = (f"credential {cred.name} was used {used} times in the last minute"
                               f" (limit {cred.rate_limit_per_min} per minute)")
                        aid = await self._write(conn, cred.tenant_id, sandbox_id, action="credential.use",
                                                target=cred.id, decision="deny",
                                                detail={**detail, "reason": "credential_rate_limited"},
                                                event_type="credential_refused")
                        return UseVerdict(False, "credential_rate_limited", msg, aid)
                aid = await self._write(conn, cred.tenant_id, sandbox_id, action="credential.use", target=cred.id,
                                        decision="allow", detail=detail, event_type="credential_used")
                return UseVerdict(True, "allowed", f"credential {cred.name} injected", aid)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"gateway cannot record a credential use: {exc}") from exc

    async def _audited(self, tenant_id: str | None, sandbox_id: str, **kw: Any) -> int:
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                return await self._write(conn, tenant_id, sandbox_id, **kw)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"gateway cannot write an audit row: {exc}") from exc

    async def _write(self, conn: asyncpg.Connection, tenant_id: str | None, sandbox_id: str, *, action: str,
                     target: str, decision: str, detail: dict[str, Any], event_type: str) -> int:
        aid = await audit.record(conn, tenant_id=tenant_id, actor=self.actor, action=action, target=target,
                                 sandbox_id=sandbox_id, decision=decision, detail=detail)
        event = Event(id=new_id("evt"), type=f"egress.{event_type}", sandbox_id=sandbox_id, node_id=self.node_id,
                      tenant_id=tenant_id, reason=str(detail.get("reason") or decision), at=datetime.now(UTC),
                      data={"audit_id": aid, "action": action, "target": target, **detail})
        await emit(conn, subjects.egress_event(sandbox_id, event_type), event)
        return aid
