"""API keys of the caller's tenant (docs/DESIGN.md §6): ``POST/GET /v1/keys``, ``DELETE /v1/keys/{id}``.

A key is shown once, at creation; listings show its prefix only (never the key or its hash). A revoked key is
refused (401 ``unauthorized``) on its next request: this process forgets it at once and tells the others
(``subjects.API_KEY_REVOKED``); each refused attempt appends an ``api_key.refused`` audit row.
"""

from __future__ import annotations

from typing import Annotated

import asyncpg
from fastapi import APIRouter, Depends

from podbay.contracts import subjects
from podbay.contracts.access import KeyCreate, KeyCreated, KeyInfo, KeyList
from podbay.errors import Conflict, NotFound

from ..core.auth import Principal, create_key, forget_key, key_row, list_keys, lock_live_keys, mark_revoked
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services.sandbox_lookup import audit

__all__ = ["router", "on_revoked"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

def _info(row: asyncpg.Record) -> KeyInfo:
    return KeyInfo(id=row["id"], name=row["name"], prefix=row["prefix"], created_at=row["created_at"],
                   revoked_at=row["revoked_at"])


@router.post("/keys", status_code=201, response_model=KeyCreated)
async def create_api_key(body: KeyCreate, ctx: CtxDep, who: PrincipalDep) -> KeyCreated:
    """A new key for the caller's tenant. ``key`` is in this answer only: store it now."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        key_id, key = await create_key(conn, who.tenant_id, body.name, actor=who.key_id)
        row = await key_row(conn, key_id)
    ctx.relay.kick()
    return KeyCreated(**_info(row).model_dump(), key=key)


@router.get("/keys", response_model=KeyList)
async def list_api_keys(ctx: CtxDep, who: PrincipalDep,
                        all: bool = False) -> KeyList:
    """The tenant's keys, newest first (revoked ones only with ``all=true``): id, name, prefix, dates."""
    rows = await list_keys(ctx.pool, who.tenant_id, revoked=all)
    return KeyList(keys=[_info(r) for r in rows])


@router.delete("/keys/{key_id}", response_model=KeyInfo)
async def revoke_api_key(key_id: str, ctx: CtxDep, who: PrincipalDep) -> KeyInfo:
    """Revoke a key of the tenant; it is refused from its next request on. Revoking a revoked key answers it
    as it is. 404 ``not_found`` (also another tenant's key); 409 ``conflict`` when a key would revoke itself
    while it is the tenant's last live key (the tenant would be locked out)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        # Lock the tenant's live keys, so that two keys revoking each other cannot both succeed.
        live = await lock_live_keys(conn, who.tenant_id)
        row = await key_row(conn, key_id, tenant_id=who.tenant_id)
        if row is None:
            raise NotFound(f"API key {key_id} does not exist", details={"key_id": key_id})
        if row["revoked_at"] is not None:
            return _info(row)
        if len(live) <= 1:
            raise Conflict("this is the tenant's last API key; create another before revoking it",
                           details={"key_id": key_id})
        row = await mark_revoked(conn, key_id)
        await audit(conn, who, "api_key.revoke", key_id, detail={"name": row["name"], "prefix": row["prefix"]})
    ctx.relay.kick()
    forget_key(bytes(row["key_hash"]))
    await ctx.bus.nc.publish(subjects.API_KEY_REVOKED, bytes(row["key_hash"]).hex().encode())
    return _info(row)


async def on_revoked(msg: object) -> None:
    """Core-NATS callback for ``subjects.API_KEY_REVOKED``: forget the key in this process too."""
    try:
        forget_key(bytes.fromhex(msg.data.decode()))  # type: ignore[attr-defined]  # a nats-py Msg, typed object at the subscription callback
    except (ValueError, UnicodeDecodeError):
        return
