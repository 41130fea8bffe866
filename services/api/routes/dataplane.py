"""Exec and file endpoints: authorised and state-checked, then proxied to the sandbox's node through the node
client (services/api/nodes_client.py), which finds the node, renews the lease, audits and streams.

The node agent's data plane (``/internal/v1/sandboxes/{id}/...``) speaks the same bodies as these routes,
so the API streams requests and responses through without re-encoding. Every call carries a fresh grant
(podbay.grants) for the caller's tenant, this sandbox, its generation and the kind of operation; the node
refuses anything else (403 ``grant_refused``), and a stale placement with 409 ``stale_generation``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from podbay.contracts.api import ErrorBody, ExecRequest, ExecResult, FileInfo, FileList
from podbay.contracts.states import SandboxCommand
from podbay.grants import GrantKind

from ..nodes_client import exec_body, lookup, node_url, proxy, target
from ..services import sandbox_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep

__all__ = ["router"]

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


async def _auto_resume(sandbox_id: str, ctx: CtxDep, who: PrincipalDep,
                       auto_resume: bool = Query(False, description="Resume a suspended or paused sandbox first "
                                                 "(waits for it, bounded).")) -> None:
    if auto_resume:
        await sandbox_service.auto_resume(ctx, who, sandbox_id)


router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", dependencies=[Depends(_auto_resume)])


def _exec_detail(body: ExecRequest) -> dict[str, Any]:
    """What the audit row keeps of an exec: the program, not its arguments or env (they may hold data)."""
    return {"program": (body.argv[0] if body.argv else "/bin/sh")[:256], "shell": body.shell is not None}


@router.post("/exec", response_model=ExecResult)
async def exec_(sandbox_id: str, body: ExecRequest, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Run a command to completion; answers ``{stdout, stderr, exit_code, duration_ms, timed_out}``.

    Output is captured up to 16 MiB per stream; use ``/exec/stream`` for more. 409 ``invalid_state`` unless
    the sandbox is running.
    """
    base, gen, guest_env = await lookup(ctx, who, sandbox_id, SandboxCommand.EXEC, "sandbox.exec", _exec_detail(body))
    return await proxy(ctx, request, node_url(base, sandbox_id, "/exec"), gen, method="POST",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.EXEC,
                       json_body=exec_body(body, guest_env))


@router.post("/exec/stream", responses={200: {"content": {"application/x-ndjson": {}}}})
async def exec_stream(sandbox_id: str, body: ExecRequest, request: Request, ctx: CtxDep,
                      who: PrincipalDep) -> Response:
    """Run a command and stream ``ExecEvent`` lines (NDJSON) as output is produced; the last is ``exit``."""
    base, gen, guest_env = await lookup(ctx, who, sandbox_id, SandboxCommand.EXEC, "sandbox.exec", _exec_detail(body))
    return await proxy(ctx, request, node_url(base, sandbox_id, "/exec/stream"), gen, method="POST",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.EXEC,
                       json_body=exec_body(body, guest_env), stream_response=True)


PathQ = Annotated[str, Query(min_length=1, max_length=4096, description="Absolute path in the guest.")]


@router.get("/files", responses={200: {"content": {"application/octet-stream": {}}}})
async def read_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """The file's bytes, streamed. 404 ``not_found`` when it does not exist; 400 ``invalid_request`` for a
    directory, device, FIFO or socket (a device such as ``/dev/zero`` has no end); a symlink is read as its
    target."""
    base, gen = await target(ctx, who, sandbox_id, SandboxCommand.FILES)
    return await proxy(ctx, request, node_url(base, sandbox_id, "/files"), gen, method="GET",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                       params={"path": path}, stream_response=True)


@router.put("/files", response_model=FileInfo, responses={403: {
    "model": ErrorBody,
    "description": "`not_writable`: the guest refused the write (a read-only or pseudo file system such as "
                   "/proc or /sys, or no permission); `details.path` names the file."}})
async def write_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep,
                     mode: str = Query("0644", pattern=r"^0?[0-7]{3,4}$")) -> Response:
    """Write the raw request body to ``path`` (atomically: temp file then rename; missing parent directories
    are made); answers its ``FileInfo``. 403 ``not_writable`` when the guest refuses the write: ``/proc/version``
    and other files of ``/proc`` and ``/sys`` (no file can be made beside them), a read-only file system, or
    a file the sandbox's user may not write. 400 ``invalid_request`` for a directory or a device."""
    base, gen, _ = await lookup(ctx, who, sandbox_id, SandboxCommand.FILES, "sandbox.files.write", {"path": path})
    return await proxy(ctx, request, node_url(base, sandbox_id, "/files"), gen, method="PUT",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                       params={"path": path, "mode": mode}, stream_body=True)


@router.delete("/files", status_code=204)
async def remove_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep,
                      recursive: bool = False) -> Response:
    """Remove a file, or a directory with ``recursive=true``."""
    base, gen, _ = await lookup(ctx, who, sandbox_id, SandboxCommand.FILES, "sandbox.files.remove", {"path": path})
    return await proxy(ctx, request, node_url(base, sandbox_id, "/files"), gen, method="DELETE",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                       params={"path": path, "recursive": str(recursive).lower()})


@router.get("/files/stat", response_model=FileInfo)
async def stat_file(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """``FileInfo`` of ``path``; 404 ``not_found`` when missing."""
    base, gen = await target(ctx, who, sandbox_id, SandboxCommand.FILES)
    return await proxy(ctx, request, node_url(base, sandbox_id, "/files/stat"), gen, method="GET",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                       params={"path": path})


@router.get("/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """The entries of directory ``path`` (one level)."""
    base, gen = await target(ctx, who, sandbox_id, SandboxCommand.FILES)
    return await proxy(ctx, request, node_url(base, sandbox_id, "/files/list"), gen, method="GET",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                       params={"path": path})


@router.post("/files/mkdir", response_model=FileInfo)
async def mkdir(sandbox_id: str, path: PathQ, request: Request, ctx: CtxDep, who: PrincipalDep,
                parents: bool = True) -> Response:
    """Create directory ``path`` (and its parents unless ``parents=false``)."""
    base, gen, _ = await lookup(ctx, who, sandbox_id, SandboxCommand.FILES, "sandbox.files.mkdir", {"path": path})
    return await proxy(ctx, request, node_url(base, sandbox_id, "/files/mkdir"), gen, method="POST",
                       tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILES,
                       params={"path": path, "parents": str(parents).lower()})


