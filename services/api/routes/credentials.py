"""Credentials (docs/DESIGN.md §6): ``POST/GET/DELETE /v1/credentials``.

A value is sealed on the way in by :func:`podbay.credentials.open_store` (AES-GCM into the row, or OpenBao)
and never leaves through any API, log line or error message; the gateway alone reveals it, at the moment it
injects it into a matching request. Every sandbox created (or forked) while a credential is in scope gets the
placeholder ``PODBAY_CRED_<NAME>=podbay-credential:<name>`` in its command environment (``sandboxes.guest_env``,
computed by :data:`services.api.sandbox_lookup.GUEST_ENV_SQL` in the create's own statement).

Errors: 409 ``conflict`` (name taken), 422 ``validation_error``, 404 ``not_found`` (also another tenant's),
503 ``storage_error`` (the backend is unreachable or misconfigured; retryable).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, Response

from podbay.contracts.access import (
    CredentialCreate,
    CredentialInfo,
    CredentialList,
    placeholder_env,
)
from podbay.credentials import CredentialUnreadable, Sealed
from podbay.errors import Conflict, NotFound
from podbay.outbox import new_id

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import credentials
from ..services.credentials import destroy_quietly, store_for
from ..services.sandbox_lookup import audit

__all__ = ["router"]

log = logging.getLogger("podbay.api.credentials")
router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

def _info(row: asyncpg.Record) -> CredentialInfo:
    return CredentialInfo(
        id=row["id"], name=row["name"], hosts=list(row["hosts"]), path_prefix=row["path_prefix"],
        header=row["header"], format=row["format"], expires_at=row["expires_at"],
        rate_limit_per_min=row["rate_limit_per_min"],
        sandboxes=list(row["scope_sandboxes"]) if row["scope_sandboxes"] is not None else None,
        templates=list(row["scope_templates"]) if row["scope_templates"] is not None else None,
        backend=row["backend"], placeholder=next(iter(placeholder_env([row["name"]]))), created_at=row["created_at"])


@router.post("/credentials", status_code=201, response_model=CredentialInfo)
async def create_credential(body: CredentialCreate, ctx: CtxDep, who: PrincipalDep) -> CredentialInfo:
    """Store a credential. The answer has everything but the value, which no API ever returns.

    409 ``conflict`` when the tenant has a live credential of this name (or one whose placeholder,
    ``PODBAY_CRED_<NAME>``, would be the same); 503 ``storage_error`` when the backend cannot seal it.
    """
    cred_id = new_id("cred")
    taken = await credentials.placeholder_taken(ctx.pool, who.tenant_id, body.name)
    if taken is not None:
        raise Conflict(f"credential {taken!r} exists (same name or same placeholder)", details={"name": taken})
    store = store_for(ctx)
    sealed = await store.seal(cred_id, who.tenant_id, body.value.get_secret_value())
    try:
        async with ctx.pool.acquire() as conn, conn.transaction():
            row = await credentials.insert(conn, cred_id, who.tenant_id, body, sealed)
            await _audit(conn, who, "credential.create", cred_id,
                         {"name": body.name, "hosts": body.hosts, "backend": sealed.backend})
    except asyncpg.UniqueViolationError as exc:
        # A concurrent create of the same name won; do not leave this one's value behind in the backend.
        await destroy_quietly(store, cred_id, who.tenant_id, sealed)
        raise Conflict(f"credential {body.name!r} exists", details={"name": body.name}) from exc
    except BaseException:
        await destroy_quietly(store, cred_id, who.tenant_id, sealed)
        raise
    ctx.relay.kick()
    return _info(row)


@router.get("/credentials", response_model=CredentialList)
async def list_credentials(ctx: CtxDep, who: PrincipalDep) -> CredentialList:
    """The tenant's live credentials, by name (never their values)."""
    rows = await credentials.list_live(ctx.pool, who.tenant_id)
    return CredentialList(credentials=[_info(r) for r in rows])


@router.get("/credentials/{name}", response_model=CredentialInfo)
async def get_credential(name: str, ctx: CtxDep, who: PrincipalDep) -> CredentialInfo:
    """One credential (never its value). 404 ``not_found`` when the tenant has no live one of that name."""
    row = await credentials.get_live(ctx.pool, who.tenant_id, name)
    if row is None:
        raise NotFound(f"credential {name!r} does not exist", details={"name": name})
    return _info(row)


@router.delete("/credentials/{name}", status_code=204)
async def delete_credential(name: str, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Delete a credential: its value is destroyed in its backend, then the row is marked deleted (kept for
    the audit trail). The gateway stops injecting it on its next request. 404 ``not_found``; 503
    ``storage_error`` when the backend cannot destroy the value (nothing changes then; retry)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await credentials.lock_live(conn, who.tenant_id, name)
        if row is None:
            raise NotFound(f"credential {name!r} does not exist", details={"name": name})
        sealed = Sealed(row["backend"], ciphertext=row["ciphertext"], secret_ref=row["secret_ref"])
        # Destroy first, under the row lock: a failure leaves the credential as it was, never a live row
        # whose value is gone nor a deleted row whose value lingers in the backend.
        try:
            await store_for(ctx, row["backend"]).destroy(row["id"], who.tenant_id, sealed)
        except CredentialUnreadable:
            pass  # already gone from the backend: deleting the row finishes the job
        await credentials.mark_deleted(conn, row["id"])
        await _audit(conn, who, "credential.delete", row["id"], {"name": name})
    ctx.relay.kick()
    return Response(status_code=204)


async def _audit(conn: Any, who: Principal, action: str, target: str, detail: dict[str, Any]) -> None:
    await audit(conn, who, action, target, detail=detail)
