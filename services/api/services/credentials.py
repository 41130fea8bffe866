"""Credentials as a service (table ``credentials``; docs/DESIGN.md §6, docs/architecture/network.md): the store
that seals a value (podbay.credentials), and the named queries of a tenant's credentials. ``/v1/credentials``
(services/api/routes/credentials.py) and E2B's Secrets API (services/api/e2b/secrets.py) call them. A value is
never read back by any of these: rows carry its sealed form only, and :data:`COLS` leaves that out.
"""

from __future__ import annotations

import logging

import asyncpg

from podbay.contracts.access import CredentialCreate
from podbay.credentials import CredentialStore, Sealed, open_store
from podbay.errors import StorageError

from ..core.context import ApiContext

__all__ = ["COLS", "store_for", "destroy_quietly", "placeholder_taken", "insert", "list_live", "get_live",
           "lock_live", "mark_deleted"]

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
