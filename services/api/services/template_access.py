"""Who may see and change a template, and what a template's name means (issue 37; docs/SECURITY.md "tenant
vs tenant").

Every template has an owner (``templates.owner_tenant``, migration 0033): the tenant that built it, or NULL
for a *shared* template, published by the operator tenant (``PODBAY_OPERATOR_TENANT``; ``base`` and what the
operator builds). Names are per owner (migration 0037): ``templates.alias`` is the name its owner gave, and
what every route takes and shows; ``templates.name`` is an internal *key* (:func:`new_key`) that node stores,
warm slots and pools, object-store keys and ``sandboxes.template`` use, so that tenant A's ``web`` and tenant
B's ``web`` never meet on a node. The rules, used by every template route (native and E2B), the warm-pool
routes and the create path:

- a name a tenant uses means its own template of that name, else the shared one (:func:`resolve`);
  another tenant's templates are not in its namespace at all;
- a tenant changes (rebuild, remove, tag, untag, pool size) only its own; a shared one answers 403
  ``forbidden`` (its existence is public), except to the operator tenant, which manages the shared ones;
- a tenant cannot build a name that a shared template has (403 ``forbidden``, saying the name is a shared
  template's; shared names are public, so this leaks nothing): its own would shadow the shared one for it
  and the operator's documented templates would silently change meaning. A name another tenant uses is free.
  When the operator publishes a name a tenant already has, that tenant keeps seeing its own.

A probe of a name that only another tenant has (answered 404, as a name nobody has) appends a
``tenant.refused`` audit row (the caller's tenant, decision ``deny``, reason ``not_owner``,
``detail.route``) in a transaction of its own, so that the refusal's rollback does not take it away; so
does every refusal of a shared template.
"""

from __future__ import annotations

import hashlib
from typing import Any

import asyncpg

from podbay import build_state, template_state
from podbay.audit import record
from podbay.errors import Conflict, Forbidden

from ..core.auth import Principal
from ..core.context import ApiContext

__all__ = ["VISIBLE_SQL", "RESOLVE_SQL", "ALIAS_SQL", "operator_tenant_id", "is_operator", "build_owner",
           "refuse", "new_key", "resolve", "lookup", "foreign", "build_key", "share_operator_templates"]


#: A ``templates`` row (alias ``t``) the tenant ``{tenant}`` (a placeholder such as ``$2``) may see.
VISIBLE_SQL = "(t.owner_tenant IS NULL OR t.owner_tenant = {tenant})"

#: The live template that name ``{alias}`` means to tenant ``{tenant}`` (SQL placeholders): its own of that
#: name, else the shared one. Columns ``name`` (the key), ``alias``, ``owner_tenant``; append a lock clause.
RESOLVE_SQL = ("SELECT name, alias, owner_tenant FROM templates WHERE alias = {alias} AND deleted_at IS NULL"
               " AND (owner_tenant IS NULL OR owner_tenant = {tenant}) ORDER BY owner_tenant NULLS LAST LIMIT 1")

#: SQL expression: the name its owner gave the template whose key is the SQL expression ``{key}`` (the key
#: itself when no row has it, e.g. an OCI reference in ``template_builds.parent``).
ALIAS_SQL = "coalesce((SELECT a.alias FROM templates a WHERE a.name = {key}), {key})"

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


def new_key(owner: str | None, alias: str) -> str:
    """The storage key of a new template named ``alias`` by ``owner`` (None: shared): ``tpl-`` and 24 hex
    digits of SHA-256 over both, a strict id (podbay.contracts.ids.ID_RE, and a template name) since it
    becomes a host path component. Deterministic, so that two first builds of one name by one owner meet on
    one key (``template_builds_one_running`` then refuses the second)."""
    digest = hashlib.sha256(f"{owner or ''}\0{alias}".encode()).hexdigest()
    return f"tpl-{digest[:24]}"


async def resolve(conn: asyncpg.Connection | asyncpg.Pool, who: Principal, alias: str, *,
                  lock: str | None = None) -> asyncpg.Record | None:
    """The live template (``name``: its key, ``alias``, ``owner_tenant``) that ``alias`` means to ``who``:
    its own, else the shared one; None when neither exists. ``lock``: ``"FOR UPDATE"`` or ``"FOR SHARE"``."""
    assert lock in (None, "FOR UPDATE", "FOR SHARE")
    return await conn.fetchrow(RESOLVE_SQL.format(alias="$1", tenant="$2") + f" {lock or ''}", alias, who.tenant_id)


async def _probe(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal, alias: str, *,
                 route: str) -> None:
    """Audit (reason ``not_owner``) a name the caller does not have when another tenant has it."""
    if await conn.fetchval("SELECT 1 FROM templates WHERE alias=$1 AND deleted_at IS NULL AND owner_tenant <> $2"
                           " LIMIT 1", alias, who.tenant_id) is not None:
        await refuse(ctx, who, alias, route=route, reason="not_owner", kind="template")


async def lookup(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal, name: str, *,
                 route: str, write: bool = False, lock: str | None = None) -> asyncpg.Record | None:
    """The row (``name``: the key, ``alias``, ``owner_tenant``) of the template ``name`` (the name the caller
    uses) means to ``who`` (:func:`resolve`); None when there is none (audited, reason ``not_owner``, when
    another tenant has that name). With ``write``, raises ``Forbidden`` (403, audited: reason ``shared``)
    for a shared template unless ``who`` is the operator tenant. ``lock``: ``"FOR UPDATE"`` or
    ``"FOR SHARE"`` (inside the caller's transaction); ``route`` names the call in the audit row (e.g.
    ``DELETE /v1/templates/{name}``)."""
    row = await resolve(conn, who, name, lock=lock)
    if row is None:
        await _probe(conn, ctx, who, name, route=route)
        return None
    if write and row["owner_tenant"] is None and not await is_operator(conn, ctx, who):
        await refuse(ctx, who, name, route=route, reason="shared", kind="template")
        raise Forbidden(f"template {name!r} is shared by the operator and read-only for tenants; build your own "
                        "FROM it", details={"template": name})
    return row


async def foreign(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, who: Principal, name: str, *,
                  route: str) -> bool:
    """Whether ``name`` is a template name only other tenants have (audited: reason ``not_owner``); False
    for a name nobody has, a shared template and the caller's own."""
    if await resolve(conn, who, name) is not None:
        return False
    owner = await conn.fetchval("SELECT owner_tenant FROM templates WHERE alias=$1 AND deleted_at IS NULL"
                                " AND owner_tenant <> $2 LIMIT 1", name, who.tenant_id)
    if owner is None:
        return False
    await refuse(ctx, who, name, route=route, reason="not_owner", kind="template")
    return True


async def build_key(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, name: str, owner: str | None, *,
                    route: str) -> str:
    """The key a build of template ``name`` under ``owner`` (:func:`build_owner`) registers as (inside the
    transaction that writes the build's row; rows read share-locked): the key of the owner's template of that
    name, also a removed one (a rebuild is a new version of it; the owner's live one even when a shared
    template took the name later), else a new one: the name itself for a shared
    template when no row has it as key (so ``base``, desktop ... keep their node stores), else
    :func:`new_key`. Raises ``Forbidden`` (403, audited: reason ``shared``) when a tenant builds a name a
    shared template has; ``Conflict`` if the new key is some other template's (not expected)."""
    own = await conn.fetchrow(
        "SELECT name, deleted_at IS NULL AS live FROM templates WHERE alias=$1 AND owner_tenant IS NOT DISTINCT FROM"
        " $2 ORDER BY deleted_at DESC NULLS FIRST LIMIT 1 FOR SHARE", name, owner)
    if own is not None and own["live"]:
        return str(own["name"])  # a rebuild of the owner's live template, also one a shared name shadows
    if owner is not None and await conn.fetchval(
            "SELECT 1 FROM templates WHERE alias=$1 AND owner_tenant IS NULL AND deleted_at IS NULL FOR SHARE",
            name) is not None:
        await refuse(ctx, who, name, route=route, reason="shared", kind="template")
        raise Forbidden(f"template name {name!r} is a shared template's, read-only for tenants; build under "
                        "another name FROM it", details={"template": name, "reason": "shared_name"})
    if own is not None:
        return str(own["name"])
    if owner is None and await conn.fetchval("SELECT 1 FROM templates WHERE name=$1", name) is None:
        return name
    key = new_key(owner, name)
    if await conn.fetchval("SELECT 1 FROM templates WHERE name=$1", key) is not None:
        raise Conflict(f"template {name!r} cannot be registered; choose another name", details={"template": name})
    return key


async def share_operator_templates(pool: asyncpg.Pool, operator_tenant: str) -> int:
    """Make the operator tenant's templates (and builds) shared (owner NULL): migration 0033 gave existing
    templates the tenant of their latest build, not knowing which tenant is the operator. Idempotent; run
    at the API's start. Returns how many templates changed."""
    async with pool.acquire() as conn, conn.transaction():
        tid = await conn.fetchval("SELECT id FROM tenants WHERE name=$1", operator_tenant)
        if tid is None:
            return 0
        await build_state.disown_builds(conn, tid)
        status = await template_state.disown(conn, tid)
    return int(status.split()[-1])
