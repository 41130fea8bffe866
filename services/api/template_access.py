"""Who may see and change a template (issue 37; docs/SECURITY.md "tenant vs tenant").

Every template has an owner (``templates.owner_tenant``, migration 0033): the tenant that built it, or NULL
for a *shared* template, published by the operator tenant (``PODBAY_OPERATOR_TENANT``; ``base`` and what the
operator builds). The rules, used by every template route (native and E2B), the warm-pool routes and the
create path:

- a tenant sees its own templates and the shared ones (lists, gets, creates, ``FROM``); another tenant's
  template is answered as if it did not exist (404 ``not_found``, as another tenant's sandbox is);
- a tenant changes (rebuild, remove, tag, untag, pool size) only its own; a shared one answers 403
  ``forbidden`` (its existence is public), except to the operator tenant, which manages the shared ones;
- names are global (they key node stores, object-store keys and warm slots): a build of a name another
  owner holds is refused with 409 ``template_name_taken``, which names no tenant.

Every refusal that concerns an existing template of someone else appends a ``tenant.refused`` audit row
(the caller's tenant, decision ``deny``, ``detail.route``) in a transaction of its own, so that the
refusal's rollback does not take it away.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from podbay.audit import record
from podbay.errors import Conflict, Forbidden

from .auth import Principal
from .context import ApiContext

__all__ = ["TemplateNameTaken", "VISIBLE_SQL", "operator_tenant_id", "is_operator", "build_owner", "refuse",
           "lookup", "foreign", "check_build_name", "share_operator_templates"]


class TemplateNameTaken(Conflict):
    """A build of a template name that another owner holds (names are global); ``details.template``."""

    code = "template_name_taken"


#: A ``templates`` row (alias ``t``) the tenant ``{tenant}`` (a placeholder such as ``$2``) may see.
VISIBLE_SQL = "(t.owner_tenant IS NULL OR t.owner_tenant = {tenant})"

_operator_ids: dict[str, str] = {}


async def operator_tenant_id(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext) -> str | None:
    """The id of the operator tenant (by its name, ``settings.operator_tenant``), cached once known; None
    while no such tenant exists."""
    name = ctx.settings.operator_tenant
    if name not in _operator_ids:
        tid = await conn.fetchval("SELECT id FROM tenants WHERE name=$1", name)
        if tid is None:
            return None
        _operator_ids[name] = str(tid)
    return _operator_ids[name]


async def is_operator(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal) -> bool:
    """Whether the caller belongs to the operator tenant."""
    return await operator_tenant_id(conn, ctx) == who.tenant_id


async def build_owner(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal) -> str | None:
    """The owner a build by ``who`` registers its template under: None (shared) for the operator tenant."""
    return None if await is_operator(conn, ctx, who) else who.tenant_id


async def refuse(ctx: ApiContext, who: Principal, target: str, *, route: str, reason: str,
                 action: str = "tenant.refused", **detail: Any) -> None:
    """Append the audit row of a refusal (``action``, decision ``deny``, ``detail``: ``route``, ``reason``
    and ``detail``) in a transaction of its own, then kick the outbox relay. The caller raises the error."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action=action, target=target,
                     decision="deny", detail={"route": route, "reason": reason, **detail})
    ctx.relay.kick()


async def lookup(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal, name: str, *,
                 route: str, write: bool = False, lock: str | None = None) -> asyncpg.Record | None:
    """The row (``name``, ``owner_tenant``) of template ``name`` (not removed) that ``who`` may see; None when
    there is none, or it is another tenant's (audited: reason ``not_owner``). With ``write``, raises
    ``Forbidden`` (403, audited: reason ``shared``) for a shared template unless ``who`` is the operator
    tenant. ``lock``: ``"FOR UPDATE"`` or ``"FOR SHARE"`` (inside the caller's transaction); ``route``
    names the call in the audit row (e.g. ``DELETE /v1/templates/{name}``)."""
    assert lock in (None, "FOR UPDATE", "FOR SHARE")
    row = await conn.fetchrow(f"SELECT name, owner_tenant FROM templates WHERE name=$1 AND deleted_at IS NULL"
                              f" {lock or ''}", name)
    if row is None:
        return None
    owner = row["owner_tenant"]
    if owner is not None and owner != who.tenant_id:
        await refuse(ctx, who, name, route=route, reason="not_owner", kind="template")
        return None
    if write and owner is None and not await is_operator(conn, ctx, who):
        await refuse(ctx, who, name, route=route, reason="shared", kind="template")
        raise Forbidden(f"template {name!r} is shared by the operator and read-only for tenants; build your own "
                        "FROM it", details={"template": name})
    return row


async def foreign(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal, name: str, *,
                  route: str) -> bool:
    """Whether template ``name`` (not removed) is another tenant's (audited: reason ``not_owner``); False for
    a name nobody holds, a shared template and the caller's own."""
    owner = await conn.fetchval("SELECT owner_tenant FROM templates WHERE name=$1 AND deleted_at IS NULL", name)
    if owner is None or owner == who.tenant_id:
        return False
    await refuse(ctx, who, name, route=route, reason="not_owner", kind="template")
    return True


async def check_build_name(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, name: str,
                           owner: str | None, *, route: str) -> None:
    """Refuse a build of template ``name`` under ``owner`` (:func:`build_owner`) when another owner holds
    the name (inside the transaction that writes the build's row; the template's row is share-locked):
    ``Forbidden`` for a shared template built by a tenant, :class:`TemplateNameTaken` otherwise, both audited.
    A removed template's name is free."""
    row = await conn.fetchrow("SELECT owner_tenant FROM templates WHERE name=$1 AND deleted_at IS NULL"
                              " FOR SHARE", name)
    if row is None:
        return  # a new name, or a removed template's
    held = row["owner_tenant"]
    if held == owner:
        return
    if held is None:
        await refuse(ctx, who, name, route=route, reason="shared", kind="template")
        raise Forbidden(f"template {name!r} is shared by the operator and read-only for tenants; build under "
                        "another name FROM it", details={"template": name})
    await refuse(ctx, who, name, route=route, reason="name_taken", kind="template")
    raise TemplateNameTaken(f"the template name {name!r} is taken; choose another name",
                            details={"template": name})


async def share_operator_templates(pool: asyncpg.Pool, operator_tenant: str) -> int:
    """Make the operator tenant's templates (and builds) shared (owner NULL): migration 0033 gave existing
    templates the tenant of their latest build, not knowing which tenant is the operator. Idempotent; run
    at the API's start. Returns how many templates changed."""
    async with pool.acquire() as conn, conn.transaction():
        tid = await conn.fetchval("SELECT id FROM tenants WHERE name=$1", operator_tenant)
        if tid is None:
            return 0
        await conn.execute("UPDATE template_builds SET owner_tenant=NULL WHERE owner_tenant=$1", tid)
        status = await conn.execute("UPDATE templates SET owner_tenant=NULL WHERE owner_tenant=$1", tid)
    return int(status.split()[-1])
