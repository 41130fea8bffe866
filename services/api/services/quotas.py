"""Per-tenant quotas (issue 37): what a tenant may hold at once, checked where sandboxes and builds are made.

Limits (``tenant_quotas``, migration 0033; a NULL limit or no row: the default from settings,
``PODBAY_QUOTA_SANDBOXES``, ``_VCPUS``, ``_MEMORY_MIB``, ``_DISK_MIB``, ``_BUILDS``):

- ``sandboxes``: sandboxes in :data:`ACTIVE_STATES` (those that hold a VM or are getting one);
- ``vcpus``, ``memory_mib``, ``disk_mib``: the sums over those sandboxes (a disk of the template's own size
  counts as the template's current disk);
- ``builds``: template builds running at once;
- the ``max_size`` of a tenant's pools of its own templates, all together, stays within ``sandboxes``
  (:func:`check_pool`): warm slots hold VMs before anyone claims them.

:func:`check_sandbox` and :func:`check_builds` run inside the transaction that writes the new row, after
locking the tenant's row (``FOR NO KEY UPDATE``, which the foreign keys' ``FOR KEY SHARE`` locks do not
wait for), so two concurrent creates of one tenant are serialised and cannot both pass the last unit. A
refusal is 403 ``quota_exceeded`` naming the limit, its value and the current use, and appends a
``quota.refused`` audit row (podbay.audit) in a transaction of its own.

Routes (services/api/routes/quotas.py): ``GET /v1/tenants/{tenant}/quota`` (the operator tenant, or the tenant
itself) and ``PUT`` (the operator tenant only); ``{tenant}`` is a tenant id or name.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from podbay.config import Settings
from podbay.contracts.quotas import QUOTA_KINDS, QuotaInfo, QuotaLimits, QuotaSet
from podbay.errors import Forbidden, NotFound

from ..core.auth import Principal
from ..core.context import ApiContext
from .template_access import refuse

__all__ = ["QuotaExceeded", "ACTIVE_STATES", "USAGE_SQL", "USAGE_SQL_FOR", "lock_tenant", "limits", "check_sandbox",
           "check_builds", "check_pool", "disk_mib_of",
           "sandbox_disk_mib", "tenant_id_of", "info", "set_limits"]

_MIB = 1 << 20


class QuotaExceeded(Forbidden):
    """Creating this would pass one of the tenant's quotas (``details``: ``limit`` (its name), ``quota``
    (its value), ``usage`` (now), ``requested``)."""

    code = "quota_exceeded"


#: The states of a sandbox that count against the ``sandboxes``, ``vcpus``, ``memory_mib`` and ``disk_mib``
#: quotas: it holds a VM or is getting one. Suspended sandboxes (in object storage) and failed ones do not.
ACTIVE_STATES = ("pending", "starting", "running", "paused", "suspending", "resuming")

#: A tenant's use (``{tenant}``: a placeholder for its id, e.g. ``$1``): ``sandboxes``, ``vcpus``,
#: ``memory_mib``, ``disk_mib`` (MiB), ``builds``.
USAGE_SQL_FOR = (
    "SELECT count(*)::int AS sandboxes, coalesce(sum(s.vcpus), 0)::int AS vcpus,"
    " coalesce(sum(s.memory_mib), 0)::int AS memory_mib,"
    " coalesce(sum(coalesce(s.disk_mib, ceil(coalesce(t.size_bytes, 0) / 1048576.0))), 0)::bigint AS disk_mib,"
    " (SELECT count(*) FROM template_builds b WHERE b.tenant_id={tenant} AND b.state='running')::int AS builds"
    " FROM sandboxes s LEFT JOIN templates t ON t.name = s.template"
    " WHERE s.tenant_id={tenant} AND s.state IN (" + ", ".join(f"'{st}'" for st in ACTIVE_STATES) + ")")
USAGE_SQL = USAGE_SQL_FOR.format(tenant="$1")


async def lock_tenant(conn: asyncpg.Connection, settings: Settings, tenant_id: str) -> QuotaLimits:
    """Serialise the quota checks of one tenant until the caller's transaction ends (one statement: the
    tenant's row ``FOR NO KEY UPDATE``) and return its limits in force. Statements after this one see every
    create that committed before the lock was granted."""
    row = await conn.fetchrow(f"SELECT {', '.join('q.' + k for k in QUOTA_KINDS)} FROM tenants te LEFT JOIN"
                              " tenant_quotas q ON q.tenant_id = te.id WHERE te.id=$1 FOR NO KEY UPDATE OF te",
                              tenant_id)
    return QuotaLimits(**{k: v if row is not None and (v := row[k]) is not None else getattr(settings, f"quota_{k}")
                          for k in QUOTA_KINDS})


async def limits(conn: asyncpg.Connection | asyncpg.Pool, settings: Settings,
                 tenant_id: str) -> tuple[QuotaLimits, QuotaSet]:
    """The limits in force for ``tenant_id`` and the tenant's own settings (None where the default applies)."""
    row = await conn.fetchrow(f"SELECT {', '.join(QUOTA_KINDS)} FROM tenant_quotas WHERE tenant_id=$1", tenant_id)
    own = QuotaSet(**({k: row[k] for k in QUOTA_KINDS} if row else {}))
    eff = QuotaLimits(**{k: v if (v := getattr(own, k)) is not None else getattr(settings, f"quota_{k}")
                         for k in QUOTA_KINDS})
    return eff, own


async def _usage(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> QuotaLimits:
    return QuotaLimits(**dict(await conn.fetchrow(USAGE_SQL, tenant_id)))


async def _check(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, wants: dict[str, int], *,
                 route: str, target: str | None) -> None:
    eff = await lock_tenant(conn, ctx.settings, who.tenant_id)
    use = await _usage(conn, who.tenant_id)
    for kind, more in wants.items():
        quota, now = getattr(eff, kind), getattr(use, kind)
        if more and now + more > quota:
            detail: dict[str, Any] = {"limit": kind, "quota": quota, "usage": now, "requested": more}
            await refuse(ctx, who, target or kind, route=route, reason="quota", action="quota.refused", **detail)
            raise QuotaExceeded(f"the tenant's {kind} quota is {quota} and {now} are in use; this needs {more} "
                                "more", details=detail)


async def check_sandbox(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, *, vcpus: int,
                        memory_mib: int, disk_mib: int, route: str, target: str | None = None,
                        count: int = 1) -> None:
    """Refuse (:class:`QuotaExceeded`, audited) ``count`` new (or woken) sandboxes of ``vcpus``,
    ``memory_mib`` and ``disk_mib`` (MiB) each that would pass one of ``who``'s quotas; call inside the
    transaction that inserts (or wakes) them."""
    await _check(conn, ctx, who, {"sandboxes": count, "vcpus": vcpus * count, "memory_mib": memory_mib * count,
                                  "disk_mib": disk_mib * count}, route=route, target=target)


async def sandbox_disk_mib(conn: asyncpg.Connection, sandbox_id: str) -> int:
    """The MiB sandbox ``sandbox_id``'s root disk counts for (its own size, else its template's)."""
    return int(await conn.fetchval(
        "SELECT coalesce(s.disk_mib, ceil(coalesce(t.size_bytes, 0) / 1048576.0))::bigint FROM sandboxes s"
        " LEFT JOIN templates t ON t.name = s.template WHERE s.id=$1", sandbox_id) or 0)


async def check_builds(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, *, route: str,
                       target: str | None = None) -> None:
    """Refuse (:class:`QuotaExceeded`, audited) one more running build of ``who``'s; call inside the
    transaction that writes the build's row."""
    await _check(conn, ctx, who, {"builds": 1}, route=route, target=target)


async def check_pool(conn: asyncpg.Connection, ctx: ApiContext, who: Principal, template: str, max_size: int, *,
                     route: str) -> None:
    """Refuse (:class:`QuotaExceeded`, audited; ``limit`` ``sandboxes``) a pool of ``max_size`` slots for
    ``who``'s template ``template`` when, with the ``max_size`` of the tenant's other pools, it would pass the
    tenant's sandboxes quota: warm slots hold VMs on shared nodes before anyone claims them."""
    eff = await lock_tenant(conn, ctx.settings, who.tenant_id)
    others = int(await conn.fetchval(
        "SELECT coalesce(sum(p.max_size), 0) FROM warm_pools p JOIN templates t ON t.name = p.template"
        " WHERE t.owner_tenant=$1 AND p.template <> $2", who.tenant_id, template))
    if others + max_size > eff.sandboxes:
        detail: dict[str, Any] = {"limit": "sandboxes", "quota": eff.sandboxes, "usage": others,
                                  "requested": max_size}
        await refuse(ctx, who, template, route=route, reason="quota", action="quota.refused", **detail)
        raise QuotaExceeded(f"the tenant's pools would keep {others + max_size} warm slots; its sandboxes quota "
                            f"is {eff.sandboxes}", details=detail)


def disk_mib_of(disk_mib: int | None, template_size_bytes: int | None) -> int:
    """The MiB a new sandbox's root disk counts for: its own size, else its template's (0 when unknown)."""
    if disk_mib is not None:
        return disk_mib
    return -(-(template_size_bytes or 0) // _MIB)


async def tenant_id_of(conn: asyncpg.Connection | asyncpg.Pool, ref: str) -> str:
    """The id of the tenant ``ref`` names (its id or its name). NotFound when no such tenant."""
    tid = await conn.fetchval("SELECT id FROM tenants WHERE id=$1 OR name=$1 ORDER BY id=$1 DESC LIMIT 1", ref)
    if tid is None:
        raise NotFound(f"tenant {ref!r} does not exist", details={"tenant": ref})
    return str(tid)


async def info(conn: asyncpg.Connection | asyncpg.Pool, ctx: ApiContext, tenant_id: str) -> QuotaInfo:
    """A tenant's quota: the limits in force, its own settings (None: the default) and its use now."""
    eff, own = await limits(conn, ctx.settings, tenant_id)
    return QuotaInfo(tenant_id=tenant_id, limits=eff, set=own, usage=await _usage(conn, tenant_id))


async def set_limits(conn: asyncpg.Connection, tenant_id: str, body: QuotaSet) -> None:
    """Write ``tenant_id``'s own limits (a None field: the default from settings), in the caller's transaction."""
    vals = [getattr(body, k) for k in QUOTA_KINDS]
    await conn.execute(
        f"INSERT INTO tenant_quotas (tenant_id, {', '.join(QUOTA_KINDS)}) VALUES ($1,$2,$3,$4,$5,$6)"
        " ON CONFLICT (tenant_id) DO UPDATE SET "
        + ", ".join(f"{k}=EXCLUDED.{k}" for k in QUOTA_KINDS) + ", updated_at=now()", tenant_id, *vals)
