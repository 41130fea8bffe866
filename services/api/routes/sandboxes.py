"""Sandbox lifecycle endpoints: create, list, get, delete, pause, resume, lease, and operations.

The routes check and shape HTTP; the work is the service layer's (services/api/services/sandbox_service.py), which
E2B's routes call too. Calls wait for completion by default, bounded by ``create_timeout_s``; with
``?wait=false`` (or when the bound runs out) they answer 202 with ``operation_id`` for
``GET /v1/operations/{id}``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Response

from podbay.contracts.api import (
    ErrorBody,
    LeaseUpdate,
    OperationInfo,
    SandboxCreate,
    SandboxInfo,
    SandboxList,
)
from podbay.contracts.states import OperationState
from podbay.errors import InvalidState, NotFound
from podbay.lifecycle import set_lease

from ..services import idempotency, sandbox_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services.idempotency import IdempotencyKey
from ..services.sandbox_lookup import audit, list_sandboxes_of, load_operation, load_sandbox, sandbox_info

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

#: OpenAPI: the 503 a create answers when no node has room (or the service is unavailable).
NO_CAPACITY_RESPONSE: dict[str, Any] = {
    "model": ErrorBody,
    "description": "`no_capacity`: no node had room within the scheduler's retry window (the sandbox is `failed`); "
                   "or `unavailable`.",
    "headers": {"Retry-After": {"description": "With `no_capacity`: seconds to wait before trying again.",
                                "schema": {"type": "integer"}}},
}
#: OpenAPI: the client errors a create answers (besides 503 ``NO_CAPACITY_RESPONSE``), each as ``ErrorBody``.
CREATE_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "`invalid_request`: resources the template's snapshot cannot restore "
                                             "with; `invalid_volume_path`."},
    404: {"model": ErrorBody, "description": "`not_found`: unknown template or volume."},
    409: {"model": ErrorBody, "description": "`volume_in_use`: a volume is attached read-write elsewhere."},
    422: {"model": ErrorBody, "description": "`invalid_disk_size`: `disk_mib` below the template's disk or over "
                                             "`PODBAY_SANDBOX_MAX_DISK_MIB` (`details`: `disk_mib`, "
                                             "`template_disk_mib` or `max_disk_mib`); `idempotency_key_reused`: the "
                                             "key came with another body; `validation_error`: a body the model "
                                             "refuses (`details.errors`)."},
}
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


def _answer(response: Response, outcome: tuple[SandboxInfo, bool]) -> SandboxInfo:
    """The sandbox of a service call's outcome; 202 when it did not finish within the bound."""
    info, finished = outcome
    if not finished:
        response.status_code = 202
    return info


@router.post("/sandboxes", status_code=201, response_model=SandboxInfo,
             responses={202: {"model": SandboxInfo}, **CREATE_ERROR_RESPONSES, 503: NO_CAPACITY_RESPONSE})
async def create_sandbox(
    body: SandboxCreate, ctx: CtxDep, who: PrincipalDep, response: Response,
    wait: bool = Query(True, description="Wait until the sandbox runs (bounded)."),
    idempotency_key: str | None = Header(
        None, alias="Idempotency-Key", max_length=idempotency.KEY_MAX_CHARS, pattern=idempotency.KEY_PATTERN,
        description="The client's name for this create (1-255 visible ASCII characters; a UUID). A retry with "
                    "the same key and body within `PODBAY_IDEMPOTENCY_KEY_TTL_S` makes no second sandbox and "
                    "answers with the first one's sandbox as it is now; the same key with another body is 422 "
                    "`idempotency_key_reused`."),
) -> SandboxInfo:
    """Create a sandbox from a template: from a warm slot when the template's pool has one ready (a claim
    and a resume), else by restoring the template's snapshot on a node with room.

    With ``Idempotency-Key`` the key is recorded with the sandbox in one transaction, so a retry after a lost
    answer (the API restarted mid-request, a broken connection) returns the same sandbox (README, "Retries:
    creates are idempotent").

    Errors: 404 ``not_found`` (unknown template or volume), 400 ``invalid_request`` (resources the template's
    snapshot cannot restore with), 400 ``invalid_volume_path``, 409 ``volume_in_use`` (services/api/volume_service.py),
    422 ``invalid_disk_size`` (``disk_mib`` below the template's disk or over ``PODBAY_SANDBOX_MAX_DISK_MIB``),
    503 ``no_capacity`` with ``Retry-After`` (no node had room within the scheduler's
    retry window, ``PODBAY_PLACEMENT_RETRY_S``; the sandbox is ``failed``), 500 ``sandbox_failed`` (with the
    reason), 503 ``unavailable``. With ``?wait=false`` the same outcomes show on the operation
    (``error.code``) and the sandbox (``failed``, ``failure_reason``). 422 ``idempotency_key_reused``: the key
    came with another body.
    """
    idem = None if idempotency_key is None else IdempotencyKey(
        idempotency_key, idempotency.request_hash("sandbox.create", body))
    return _answer(response, await sandbox_service.create(ctx, who, body, wait=wait, idem=idem))


@router.get("/sandboxes", response_model=SandboxList)
async def list_sandboxes(ctx: CtxDep, who: PrincipalDep,
                         all: bool = Query(False, description="Include deleted sandboxes."),
                         limit: int = Query(100, ge=1, le=1000)) -> SandboxList:
    """The tenant's sandboxes, newest first (deleted ones only with ``all=true``)."""
    rows = await list_sandboxes_of(ctx.pool, who.tenant_id, deleted=all, limit=limit)
    return SandboxList(sandboxes=[sandbox_info(r) for r in rows])


@router.get("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep) -> SandboxInfo:
    """One sandbox. 404 ``not_found`` when it does not exist or belongs to another tenant."""
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def delete_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                         wait: bool = Query(True)) -> SandboxInfo:
    """Stop the sandbox's VM and remove its files; the row stays with state ``deleted``.

    Deleting a deleted sandbox answers 409 ``invalid_state``.
    """
    return _answer(response, await sandbox_service.delete(ctx, who, sandbox_id, wait=wait))


@router.post("/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def pause_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                        wait: bool = Query(True)) -> SandboxInfo:
    """Pause a running sandbox in memory (QMP ``stop``): its vCPUs stop, processes and files stay as they are.

    409 ``invalid_state`` unless it is running.
    """
    return _answer(response, await sandbox_service.pause(ctx, who, sandbox_id, wait=wait))


@router.post("/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def resume_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                         wait: bool = Query(True),
                         fallback: bool = Query(False, description="Suspended only: when its snapshot is corrupt, "
                                                "restore the newest older intact one instead.")) -> SandboxInfo:
    """Resume a paused sandbox (QMP ``cont``) and correct its clock, or wake a suspended one on a node with
    room (services/api/sandbox_service.py). 409 ``invalid_state`` unless paused or suspended; 502
    ``snapshot_corrupt`` when a suspended sandbox's snapshot fails its checksums (it stays suspended)."""
    return _answer(response, await sandbox_service.resume(ctx, who, sandbox_id, wait=wait, fallback=fallback))


@router.post("/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
async def set_timeout(sandbox_id: str, body: LeaseUpdate, ctx: CtxDep, who: PrincipalDep) -> SandboxInfo:
    """Renew the sandbox's lease: it now runs out ``lease_s`` seconds from now (and every later call on the
    sandbox renews it again). When it runs out while the guest is idle, ``on_lease_expiry`` applies."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        if row["state"] in ("deleting", "deleted"):
            raise InvalidState(f"sandbox {sandbox_id} is {row['state']}", details={"state": row["state"]})
        await set_lease(conn, sandbox_id, body.lease_s, action=body.on_lease_expiry)
        await audit(conn, who, "sandbox.timeout", sandbox_id)
    return sandbox_info(await load_sandbox(ctx.pool, who.tenant_id, sandbox_id))


@router.get("/operations/{operation_id}", response_model=OperationInfo)
async def get_operation(operation_id: str, ctx: CtxDep, who: PrincipalDep) -> OperationInfo:
    """A lifecycle operation's state and, when it failed, its error."""
    row = await load_operation(ctx.pool, who.tenant_id, operation_id)
    if row is None:
        raise NotFound(f"operation {operation_id} does not exist")
    err = {"code": row["error_code"], "message": row["error_message"] or ""} if row["error_code"] else None
    return OperationInfo(id=row["id"], kind=row["kind"], sandbox_id=row["sandbox_id"],
                         state=OperationState(row["state"]).value, error=err,
                         created_at=row["created_at"], finished_at=row["finished_at"], node_id=row["node_id"],
                         progress=row["progress"], data=row["data"])
