"""E2B's Secrets API (the ``e2b`` SDK's ``Secret``), backed by podbay's credential store (services/api/
routes/credentials.py, services/credentials.py): a secret *is* a podbay credential whose id is its ``secretID`` (``sec_...``), its value sealed
by :func:`podbay.credentials.open_store` and never returned by any route; table ``e2b_secrets`` keeps E2B's
metadata and version. A secret is created with an empty sandbox scope (``scope_sandboxes = {}``): no sandbox
gets its placeholder and the gateway injects it nowhere until a rule names it.

    POST   /e2b/secrets                201 Secret     {"name", "value", "metadata"?}; 409 name taken
    GET    /e2b/secrets                200 [Secret]   ?limit (1-1000, default 100), nextToken (x-next-token)
    GET    /e2b/secrets/{id or name}   200 Secret     404 unknown (also another tenant's)
    POST   /e2b/secrets/{id or name}   200 Secret     {"value", "metadata"?}: the value's new version
    DELETE /e2b/secrets/{id or name}   204            404 unknown

``Secret`` is ``{"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}``. Names are
lower-cased (E2B's canonical form) and share the namespace of the tenant's credentials; metadata holds at most
32 entries, keys of at most 128 bytes, values of at most 1024, 8192 bytes in all (E2B's limits, 400 beyond).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from podbay.contracts.access import CREDENTIAL_NAME_PATTERN
from podbay.credentials import CredentialUnreadable, Sealed
from podbay.errors import Conflict, InvalidRequest, NotFound
from podbay.outbox import new_id

from ..core.auth import Principal
from ..core.context import ApiContext
from ..services import credentials
from ..services.credentials import destroy_quietly as _destroy_quietly, store_for
from ..core.deps import ctx_dep
from .common import WhoDep, _Body, _E2bRoute, _iso, decode_cursor, encode_cursor
from ..services.sandbox_lookup import audit

__all__ = ["router"]

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

MAX_METADATA_ENTRIES = 32
MAX_METADATA_KEY_BYTES = 128
MAX_METADATA_VALUE_BYTES = 1024
MAX_METADATA_BYTES = 8192
MAX_VALUE_CHARS = 64 * 1024
_NAME = re.compile(CREDENTIAL_NAME_PATTERN)


def _check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ValueError(f"metadata holds at most {MAX_METADATA_ENTRIES} entries")
    total = 0
    for k, v in metadata.items():
        kb, vb = len(k.encode()), len(v.encode())
        if kb > MAX_METADATA_KEY_BYTES or vb > MAX_METADATA_VALUE_BYTES:
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_BYTES} bytes, values at most "
                             f"{MAX_METADATA_VALUE_BYTES}")
        total += kb + vb
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is at most {MAX_METADATA_BYTES} bytes in all")
    return metadata


class NewSecret(_Body):
    name: str = Field(min_length=1, max_length=63)
    value: str = Field(min_length=1, max_length=MAX_VALUE_CHARS)
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(_check_metadata)


class SecretUpdate(_Body):
    value: str = Field(min_length=1, max_length=MAX_VALUE_CHARS)
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(_check_metadata)


def _name(raw: str) -> str:
    """E2B's canonical (lower-cased) form of a secret name; 400 for one podbay cannot hold as a credential
    name, or one in the ``sec_`` form reserved for ids."""
    name = raw.lower()
    if name.startswith("sec_"):
        raise InvalidRequest("a secret name must not start with sec_ (secret ids do)")
    if not _NAME.match(name):
        raise InvalidRequest(f"a secret name must match {CREDENTIAL_NAME_PATTERN} once lower-cased")
    return name


def _secret(row: asyncpg.Record) -> dict[str, Any]:
    """E2B's ``Secret``: never the value."""
    meta = row["metadata"]
    return {"secretID": row["id"], "name": row["name"], "currentVersion": row["version"],
            "metadata": json.loads(meta) if isinstance(meta, str) else dict(meta or {}),
            "createdAt": _iso(row["created_at"]), "updatedAt": _iso(row["updated_at"])}


async def _find(conn: Any, who: Principal, secret: str, *, for_update: bool = False) -> asyncpg.Record:
    """The caller's live secret named by id (``sec_...``) or name; 404 otherwise (another tenant's too)."""
    by_id = secret.startswith("sec_")
    row = await credentials.find_secret(conn, who.tenant_id, secret if by_id else secret.lower(), by_id=by_id,
                                        for_update=for_update)
    if row is None:
        raise NotFound(f"secret {secret} was not found")
    return row


@router.post("/secrets")
async def create_secret(body: NewSecret, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Store a new secret (version 1) -> 201 ``Secret``; 409 when the tenant has a secret or credential of
    that name (or of the same placeholder); 400 for a bad name or metadata."""
    name = _name(body.name)
    taken = await credentials.placeholder_taken(ctx.pool, who.tenant_id, name)
    if taken is not None:
        raise Conflict(f"secret {taken} already exists")
    sec_id = new_id("sec")
    store = store_for(ctx)
    sealed = await store.seal(sec_id, who.tenant_id, body.value)
    try:
        async with ctx.pool.acquire() as conn, conn.transaction():
            # Scope: no sandbox (an empty array), so neither guest env nor gateway sees it until a rule does.
            await credentials.insert_secret(conn, sec_id, who.tenant_id, name, sealed, body.metadata or {})
            await audit(conn, who, "credential.create", sec_id, detail={"name": name, "backend": sealed.backend,
                                                                        "e2b_secret": True})
            row = await _find(conn, who, sec_id)
    except asyncpg.UniqueViolationError as exc:
        await _destroy_quietly(store, sec_id, who.tenant_id, sealed)
        raise Conflict(f"secret {name} already exists") from exc
    except BaseException:
        await _destroy_quietly(store, sec_id, who.tenant_id, sealed)
        raise
    ctx.relay.kick()
    return JSONResponse(_secret(row), status_code=201)


@router.get("/secrets")
async def list_secrets(ctx: CtxDep, who: WhoDep, limit: int = Query(100, ge=1, le=1000),
                       next_token: str | None = Query(None, alias="nextToken")) -> JSONResponse:
    """The caller's secrets, newest first, ``limit`` per page (the next page's token in ``x-next-token``)."""
    cursor = decode_cursor(next_token)
    rows = await credentials.secrets_page(ctx.pool, who.tenant_id, limit + 1, cursor)
    headers = None
    if len(rows) > limit:
        rows = rows[:limit]
        headers = {"x-next-token": encode_cursor(rows[-1]["created_at"], rows[-1]["id"])}
    return JSONResponse([_secret(r) for r in rows], headers=headers)


@router.get("/secrets/{secret}")
async def get_secret(secret: str, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """One secret by id or name -> 200 ``Secret`` (never its value); 404 unknown."""
    return JSONResponse(_secret(await _find(ctx.pool, who, secret)))


@router.post("/secrets/{secret}")
async def update_secret(secret: str, body: SecretUpdate, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """A new value (the next version; the old one is gone from the store) and, when given, new metadata ->
    200 ``Secret``; 404 unknown."""
    store = None
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await _find(conn, who, secret, for_update=True)
        store = store_for(ctx, row["backend"])
        # Sealed again under the same id: the pg store's ciphertext is replaced in this transaction, an
        # OpenBao secret is written over.
        sealed = await store.seal(row["id"], who.tenant_id, body.value)
        await credentials.update_secret(conn, row["id"], sealed, body.metadata)
        await audit(conn, who, "credential.update", row["id"], detail={"name": row["name"], "e2b_secret": True})
        row = await _find(conn, who, row["id"])
    ctx.relay.kick()
    return JSONResponse(_secret(row))


@router.delete("/secrets/{secret}", status_code=204)
async def delete_secret(secret: str, ctx: CtxDep, who: WhoDep) -> Response:
    """Delete a secret: its value destroyed in its backend, its credential row marked deleted (kept for the
    audit trail) -> 204; 404 unknown."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await _find(conn, who, secret, for_update=True)
        sealed = Sealed(row["backend"], ciphertext=row["ciphertext"], secret_ref=row["secret_ref"])
        try:
            await store_for(ctx, row["backend"]).destroy(row["id"], who.tenant_id, sealed)
        except CredentialUnreadable:
            pass  # already gone from the backend
        await credentials.mark_deleted(conn, row["id"])
        await audit(conn, who, "credential.delete", row["id"], detail={"name": row["name"], "e2b_secret": True})
    ctx.relay.kick()
    return Response(status_code=204)
