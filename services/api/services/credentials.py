"""Credentials as a service (table ``credentials``; docs/DESIGN.md §6, docs/architecture/network.md): the store
that seals a value (podbay.credentials), and the named queries of a tenant's credentials. ``/v1/credentials``
(services/api/routes/credentials.py) and E2B's Secrets API (services/api/e2b/secrets.py) call them. A value is
never read back by any of these: rows carry its sealed form only, and :data:`COLS` leaves that out. E2B's
secrets are credentials with a row in ``e2b_secrets`` (E2B's metadata and version): the ``*_secret``
functions below.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

import asyncpg

from podbay.contracts.access import CredentialCreate
from podbay.credentials import CredentialStore, Sealed, open_store
from podbay.errors import StorageError

from ..core.context import ApiContext

__all__ = ["COLS", "store_for", "destroy_quietly", "placeholder_taken", "insert", "list_live", "get_live",
           "lock_live", "mark_deleted", "find_secret", "insert_secret", "secrets_page", "update_secret"]

log = logging.getLogger("podbay.api.credentials")

#: The columns of a credential the API shows (never its sealed value).
COLS = ("id, name, hosts, path_prefix, header, format, expires_at, rate_limit_per_min, scope_sandboxes,"
        " scope_templates, backend, created_at")


def store_for(ctx: ApiContext, backend: str | None = None) -> CredentialStore:
    """The credential store for ``backend`` (default: the configured one). A configuration the store refuses
    (no key, a malformed key, no OpenBao address) is 503 ``storage_error``: the operator's to fix."""
    try:
        return open_store(ctx.settings, backend)
    except ValueError as exc:
        raise StorageError(f"the credential store is not usable: {exc}") from exc


async def destroy_quietly(store: CredentialStore, cred_id: str, tenant_id: str, sealed: Sealed) -> None:
    """Destroy an abandoned credential's sealed value in its backend, best effort (a failure is logged)."""
    try:
        await store.destroy(cred_id, tenant_id, sealed)
    except Exception:  # noqa: BLE001 - best effort: the original error is what the caller must see
        log.warning("could not destroy the sealed value of abandoned credential %s", cred_id)


def _placeholder_sql(name: str) -> str:
    return name.upper().replace("-", "_")


async def placeholder_taken(pool: asyncpg.Pool, tenant_id: str, name: str) -> str | None:
    """The name of the tenant's live credential whose placeholder (``PODBAY_CRED_<NAME>``) is ``name``'s, if any."""
    taken: str | None = await pool.fetchval(
        "SELECT name FROM credentials WHERE tenant_id=$1 AND deleted_at IS NULL"
        " AND upper(replace(name, '-', '_')) = $2", tenant_id, _placeholder_sql(name))
    return taken


async def insert(conn: asyncpg.Connection, cred_id: str, tenant_id: str, body: CredentialCreate,
                 sealed: Sealed) -> asyncpg.Record:
    """Write credential ``cred_id`` of ``body`` with its ``sealed`` value; its row (:data:`COLS`).
    ``asyncpg.UniqueViolationError`` when the tenant has a live credential of that name."""
    row: asyncpg.Record = await conn.fetchrow(
        "INSERT INTO credentials (id, tenant_id, name, hosts, path_prefix, header, format, expires_at,"
        " rate_limit_per_min, scope_sandboxes, scope_templates, backend, ciphertext, secret_ref)"
        f" VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14) RETURNING {COLS}",
        cred_id, tenant_id, body.name, body.hosts, body.path_prefix, body.header, body.format,
        body.expires_at, body.rate_limit_per_min, body.sandboxes, body.templates, sealed.backend,
        sealed.ciphertext, sealed.secret_ref)
    return row


async def list_live(pool: asyncpg.Pool, tenant_id: str) -> list[asyncpg.Record]:
    """The tenant's live credentials (:data:`COLS`), by name."""
    return list(await pool.fetch(
        f"SELECT {COLS} FROM credentials WHERE tenant_id=$1 AND deleted_at IS NULL ORDER BY name", tenant_id))


async def get_live(pool: asyncpg.Pool, tenant_id: str, name: str) -> asyncpg.Record | None:
    """The tenant's live credential ``name`` (:data:`COLS`), or None."""
    row: asyncpg.Record | None = await pool.fetchrow(
        f"SELECT {COLS} FROM credentials WHERE tenant_id=$1 AND name=$2 AND deleted_at IS NULL", tenant_id, name)
    return row


async def lock_live(conn: asyncpg.Connection, tenant_id: str, name: str) -> asyncpg.Record | None:
    """The tenant's live credential ``name`` (``id, backend, ciphertext, secret_ref``), locked ``FOR UPDATE`` to
    the end of the caller's transaction; None when there is none."""
    row: asyncpg.Record | None = await conn.fetchrow(
        "SELECT id, backend, ciphertext, secret_ref FROM credentials"
        " WHERE tenant_id=$1 AND name=$2 AND deleted_at IS NULL FOR UPDATE", tenant_id, name)
    return row


async def mark_deleted(conn: asyncpg.Connection, cred_id: str) -> None:
    """Mark credential ``cred_id`` deleted and drop its sealed value (the row stays for the audit trail)."""
    await conn.execute("UPDATE credentials SET deleted_at=now(), ciphertext=NULL WHERE id=$1", cred_id)


# E2B's secrets (services/api/e2b/secrets.py). The columns of one: its credential row joined with its E2B row
# (the sealed value too, which the caller needs to destroy it and never returns).
_SECRET_SQL = ("SELECT c.id, c.name, c.created_at, e.metadata, e.version, e.updated_at, c.backend, c.ciphertext,"
               " c.secret_ref FROM credentials c JOIN e2b_secrets e ON e.credential_id = c.id"
               " WHERE c.tenant_id = $1 AND c.deleted_at IS NULL")


async def find_secret(conn: Any, tenant_id: str, secret: str, *, by_id: bool,
                      for_update: bool = False) -> asyncpg.Record | None:
    """The tenant's live E2B secret whose id (``by_id``) or name is ``secret`` (``id, name, created_at,
    metadata, version, updated_at, backend, ciphertext, secret_ref``), locked ``FOR UPDATE`` to the end of the
    caller's transaction when asked; None when there is none."""
    row: asyncpg.Record | None = await conn.fetchrow(
        _SECRET_SQL + (" AND c.id = $2" if by_id else " AND c.name = $2") + (" FOR UPDATE OF c, e" if for_update else ""),
        tenant_id, secret)
    return row


async def insert_secret(conn: asyncpg.Connection, sec_id: str, tenant_id: str, name: str, sealed: Sealed,
                        metadata: dict[str, str]) -> None:
    """Write E2B secret ``sec_id``: a credential scoped to no sandbox (an empty array, so neither guest env nor
    gateway sees it until a rule names it) with its ``sealed`` value, and its E2B row (version 1). Call it
    in a transaction; ``asyncpg.UniqueViolationError`` when the tenant has a live credential of that name."""
    await conn.execute(
        "INSERT INTO credentials (id, tenant_id, name, hosts, header, format, scope_sandboxes, backend,"
        " ciphertext, secret_ref) VALUES ($1, $2, $3, '{}', 'Authorization', '{value}', '{}', $4, $5, $6)",
        sec_id, tenant_id, name, sealed.backend, sealed.ciphertext, sealed.secret_ref)
    await conn.execute("INSERT INTO e2b_secrets (credential_id, tenant_id, metadata) VALUES ($1, $2, $3)",
                       sec_id, tenant_id, json.dumps(metadata))


async def secrets_page(pool: asyncpg.Pool, tenant_id: str, limit: int,
                       cursor: tuple[datetime, str] | None) -> list[asyncpg.Record]:
    """Up to ``limit`` of the tenant's live E2B secrets (the columns of :func:`find_secret`), newest first,
    after ``cursor`` ((created_at, id) of the previous page's last row; None: from the newest)."""
    sql = _SECRET_SQL
    args: list[Any] = [tenant_id, limit]
    if cursor is not None:
        sql += " AND (c.created_at, c.id) < ($3, $4)"
        args += [cursor[0], cursor[1]]
    return list(await pool.fetch(sql + " ORDER BY c.created_at DESC, c.id DESC LIMIT $2", *args))


async def update_secret(conn: asyncpg.Connection, cred_id: str, sealed: Sealed,
                        metadata: dict[str, str] | None) -> None:
    """E2B secret ``cred_id``'s new ``sealed`` value: its next version, and its ``metadata`` when given."""
    await conn.execute("UPDATE credentials SET ciphertext=$2, secret_ref=$3 WHERE id=$1",
                       cred_id, sealed.ciphertext, sealed.secret_ref)
    await conn.execute(
        "UPDATE e2b_secrets SET version = version + 1, updated_at = now(),"
        " metadata = COALESCE($2::jsonb, metadata) WHERE credential_id = $1",
        cred_id, json.dumps(metadata) if metadata is not None else None)
