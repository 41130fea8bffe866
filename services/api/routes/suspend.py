"""Suspend to object storage and resume anywhere: the route (docs/DESIGN.md §5; docs/ARCHITECTURE.md
"Suspend and resume").

- ``POST /v1/sandboxes/{id}/suspend`` (running or paused): :func:`services.api.sandbox_service.suspend`
  records the snapshot, the ``suspending`` state and the operation, sends ``podbay.cmd.node.<node>.suspend``
  and waits (bounded by ``suspend_timeout_s``) for the node's notice. A failed promotion leaves the sandbox
  ``paused`` with the error on the operation (409 ``suspend_failed``).
- ``POST /v1/sandboxes/{id}/resume`` of a suspended sandbox and ``?auto_resume=true`` are the service
  layer's too (``sandbox_service.resume_suspended``, ``sandbox_service.auto_resume``).
- ``sandbox_service.republish_unfinished``: at start-up, the commands an API that died between commit and
  publish left unsent.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from podbay.contracts.api import SandboxInfo

from ..services import sandbox_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.post("/suspend", response_model=SandboxInfo, responses={202: {"model": SandboxInfo}})
async def suspend_sandbox(sandbox_id: str, ctx: CtxDep, who: PrincipalDep, response: Response,
                          wait: bool = Query(True, description="Wait until suspended (bounded).")) -> SandboxInfo:
    """Suspend a running or paused sandbox to object storage: a full snapshot is taken and promoted, then
    the VM and the node's files are freed (state ``suspended``; it costs no node resources).

    Errors: 409 ``invalid_state`` unless running or paused; 409 ``conflict`` while a sandbox (a fork child)
    is still starting from one of its snapshots (``details.starting_sandbox_id``; retry shortly: the suspend
    would drop the snapshot that start reads); 409 ``suspend_failed`` (the promotion failed:
    the sandbox is ``paused`` and intact; ``details.operation_id``). 202 with ``operation_id`` when
    ``wait=false`` or the bound ran out.
    """
    info, finished = await sandbox_service.suspend(ctx, who, sandbox_id, wait=wait)
    if not finished:
        response.status_code = 202
    return info
