"""Guest port routes: what listens, who may reach it, and where (docs/ARCHITECTURE.md "Ports").

- ``GET /v1/sandboxes/{id}/ports``: the guest's listening TCP ports (the node reads ``/proc/net/tcp{,6}``
  through guestd) merged with the ports that have an access setting.
- ``PUT /v1/sandboxes/{id}/ports/{port}`` ``{"public": bool}``: a port's access; each change appends an audit
  row (``sandbox.port.public`` / ``sandbox.port.private``) in the same transaction.
- ``GET /v1/sandboxes/{id}/ports/{port}/url``: the host-form and path-form URLs and the sandbox's traffic
  token (:mod:`.ports_access`). The traffic itself is served by :mod:`.ports_edge`.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from podbay.contracts.api import PortAccess, PortAccessUpdate, PortInfo, PortList, PortUrl
from podbay.contracts.states import SandboxCommand
from podbay.grants import GrantKind

from .. import nodes_client
from ..edge import ports_access as pa
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import ports
from ..services.sandbox_lookup import load_sandbox

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/ports", tags=["ports"])
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]
PortPath = Annotated[int, Path(ge=1, le=65535, description="Guest TCP port.")]


def _reachable(address: str) -> bool:
    try:
        return not ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@router.get("", response_model=PortList)
async def list_ports(sandbox_id: str, request: Request, ctx: CtxDep, who: PrincipalDep) -> PortList:
    """Listening ports of a running sandbox (409 ``invalid_state`` otherwise) and every port with a setting."""
    base, gen = await nodes_client.target(ctx, who, sandbox_id, SandboxCommand.FILES)
    resp = await nodes_client.proxy(ctx, request, f"{base}/internal/v1/sandboxes/{sandbox_id}/ports", gen,
                                 method="GET", tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.PORTS)
    if resp.status_code != 200:
        return resp  # type: ignore[return-value]  # the node's error, passed through
    listening: dict[int, list[str]] = {}
    for item in json.loads(bytes(resp.body))["ports"]:
        listening.setdefault(int(item["port"]), []).append(str(item["address"]))
    public = await ports.settings_of(ctx.pool, sandbox_id)
    out = [PortInfo(port=p, listening=p in listening, addresses=listening.get(p, []),
                    reachable=any(_reachable(a) for a in listening.get(p, [])), public=public.get(p, False))
           for p in sorted(set(listening) | set(public))]
    return PortList(ports=out)


@router.put("/{port}", response_model=PortAccess)
async def set_access(sandbox_id: str, port: PortPath, body: PortAccessUpdate, ctx: CtxDep,
                     who: PrincipalDep) -> PortAccess:
    """Make a port public or private (404 for a sandbox that is not the caller's); audited when it changes."""
    await ports.set_public(ctx, who, sandbox_id, port, body.public)
    return PortAccess(port=port, public=body.public)


@router.get("/{port}/url", response_model=PortUrl)
async def port_url(sandbox_id: str, port: PortPath, request: Request, ctx: CtxDep, who: PrincipalDep) -> PortUrl:
    """Where the port answers (host and path form, for the API as this request reached it) and its token."""
    await load_sandbox(ctx.pool, who.tenant_id, sandbox_id)
    public = await ports.is_public(ctx.pool, sandbox_id, port)
    scheme = request.headers.get("x-forwarded-proto") or request.url.scheme
    host = request.headers.get("x-forwarded-host") or request.headers.get("host") or \
        f"{ctx.settings.api_host}:{ctx.settings.api_port}"
    url, path_url = pa.port_url(sandbox_id, port, scheme=scheme, domain=ctx.settings.ports_domain, api_host=host)
    return PortUrl(port=port, url=url, path_url=path_url, public=bool(public),
                   token=pa.traffic_token(ctx.settings.internal_token, sandbox_id))
