"""The one writer of the ``templates`` table: a template's row by its key (``name``), the named statements that
register, change and remove it (docs/architecture/build-and-storage.md).

A row has no state column: it is live, or removed (``deleted_at`` set; its key stays so that its nodes' stores
and its sandboxes keep their meaning). It is written by

- a node agent registering what its cache holds at start (:func:`register_cached`: name, digest, size; the
  owner and alias stay as they are);
- a node agent registering a finished build (:func:`register_build`: the build's row gives the owner and the
  alias, the API's decisions; a removed row is taken over, a live one of another owner is not);
- the API removing a template (:func:`mark_deleted`), replacing its egress policy (:func:`set_egress_policy`)
  and, at start, sharing the operator tenant's templates (:func:`disown`).

Every ``INSERT``/``UPDATE``/``DELETE`` of ``templates`` in services/ and libs/ lives in this module
(tests/unit/test_template_state.py refuses others). The builds of a template are written by
podbay.build_state.

Every function takes a connection or a pool (``conn``): inside the caller's transaction when it passes one.
"""

from __future__ import annotations

from typing import Any, Final

import asyncpg

from podbay.transitions import Conn

__all__ = ["register_cached", "register_build", "mark_deleted", "set_egress_policy", "disown"]

_REGISTER_CACHED_SQL: Final = (
    "INSERT INTO templates (name, digest, memory_mib, vcpus, size_bytes) VALUES ($1,$2,$3,$4,$5)"
    " ON CONFLICT (name) DO UPDATE SET digest=$2, memory_mib=$3, vcpus=$4, size_bytes=$5, updated_at=now()")
_REGISTER_BUILD_SQL: Final = (
    "INSERT INTO templates (name, digest, memory_mib, vcpus, parent, config, size_bytes, owner_tenant,"
    " alias) VALUES ($1,$2,$3,$4,$5,$6::jsonb,$7,(SELECT owner_tenant FROM template_builds WHERE id=$8),"
    " (SELECT alias FROM template_builds WHERE id=$8))"
    " ON CONFLICT (name) DO UPDATE SET digest=$2, memory_mib=$3,"
    " vcpus=$4, parent=$5, config=$6::jsonb, size_bytes=$7, deleted_at=NULL, updated_at=now(),"
    " owner_tenant=CASE WHEN $8::text IS NULL THEN templates.owner_tenant ELSE EXCLUDED.owner_tenant END"
    " WHERE $8::text IS NULL OR templates.deleted_at IS NOT NULL"
    " OR templates.owner_tenant IS NOT DISTINCT FROM EXCLUDED.owner_tenant"
    " RETURNING created_at, updated_at, alias,"
    " coalesce((SELECT p.alias FROM templates p WHERE p.name = $5), $5) AS parent_alias")
_MARK_DELETED_SQL: Final = "UPDATE templates SET deleted_at=now(), updated_at=now() WHERE name=$1"
_SET_EGRESS_POLICY_SQL: Final = "UPDATE templates SET egress_policy=$2 WHERE name=$1"
_DISOWN_SQL: Final = "UPDATE templates SET owner_tenant=NULL WHERE owner_tenant=$1"


async def register_cached(conn: Conn, name: str, digest: str, memory_mib: int, vcpus: int, size_bytes: int) -> None:
    """Upsert the row of cached template ``name``: its ``digest``, its VM's MiB and vCPUs, its disk's size in
    bytes; ``updated_at`` now. Owner, alias, parent and a removal stay as they are. Concurrent registrations
    of one name must be serialised by the caller (services/nodeagent/vm/vmdriver.py takes a lock per name)."""
    await conn.execute(_REGISTER_CACHED_SQL, name, digest, memory_mib, vcpus, size_bytes)


async def register_build(conn: Conn, name: str, digest: str, memory_mib: int, vcpus: int, parent: str | None,
                         config: Any, size_bytes: int, build_id: str | None) -> asyncpg.Record | None:
    """Upsert the row of template key ``name`` from a finished build: ``digest``, MiB, vCPUs, ``parent`` (the
    FROM template's key; None for a root template), ``config`` (JSON or None), ``size_bytes``; the owner and
    alias come from build ``build_id``'s row (None: a root template, shared, whose row keeps its owner). A
    removed row is revived. Returns ``created_at``, ``updated_at``, ``alias`` and ``parent_alias`` (the parent's
    alias, else ``parent``), or None when a live row of that key belongs to another owner (left alone)."""
    row: asyncpg.Record | None = await conn.fetchrow(_REGISTER_BUILD_SQL, name, digest, memory_mib, vcpus, parent,
                                                     config, size_bytes, build_id)
    return row


async def mark_deleted(conn: Conn, name: str) -> None:
    """Remove template key ``name``: ``deleted_at`` (and ``updated_at``) now; the row and its key stay."""
    await conn.execute(_MARK_DELETED_SQL, name)


async def set_egress_policy(conn: Conn, name: str, policy: Any) -> None:
    """Replace template key ``name``'s default egress policy (JSON, or None for none)."""
    await conn.execute(_SET_EGRESS_POLICY_SQL, name, policy)


async def disown(conn: Conn, tenant_id: str) -> str:
    """Tenant ``tenant_id``'s templates lose their owner (``owner_tenant`` NULL: shared). Returns the command
    status (``UPDATE n``)."""
    status: str = await conn.execute(_DISOWN_SQL, tenant_id)
    return status
