"""Computer-use routes: a sandbox's browser for agents (docs/computer-use.md).

- ``POST /v1/sandboxes/{id}/computer/screenshot`` -> ``image/png`` of the browser's page, or of the X screen
  of a template with a display (header ``x-podbay-screenshot-source``);
- ``POST /v1/sandboxes/{id}/computer/mouse`` (:class:`MouseAction`) and ``.../keyboard``
  (:class:`KeyboardAction`) -> ``{"events": n}``; each is audited (``sandbox.computer.mouse`` /
  ``.keyboard``, with the action's name only: typed text may be a secret);
- ``POST /v1/sandboxes/{id}/computer/fill`` (:class:`FillRequest`) -> :class:`FillResult`: a stored
  credential typed into a field by the node, after its scope and the page's origin are checked there
  (services/nodeagent/computer/computer_fill.py; the node writes the ``credential.fill`` audit row);
- ``GET /v1/sandboxes/{id}/computer/cdp`` -> :class:`CdpEndpoint`: a WebSocket URL of the browser's CDP
  through the API's port edge (:mod:`.ports_edge`, path form), with the sandbox's traffic token.

The node does the work (services/nodeagent/computer/computer.py); these routes check the tenant and state (409
``invalid_state`` unless running), renew the lease as every data-plane call does, and pass the node's
answer on: 409 ``no_browser`` for a sandbox whose template runs no browser.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from podbay.contracts.computer import (SCREENSHOT_SOURCE_HEADER, CdpEndpoint, CdpTarget, ComputerResult,
                                      FillRequest, FillResult, KeyboardAction, MouseAction)
from podbay.contracts.states import SandboxCommand
from podbay.grants import GrantKind

from .. import nodes_client
from ..edge import ports_access as pa
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/computer", tags=["computer"])
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


def _node(base: str, sandbox_id: str, suffix: str) -> str:
    return f"{base}/internal/v1/sandboxes/{sandbox_id}/computer{suffix}"


@router.post("/screenshot", responses={200: {"content": {"image/png": {}}}})
async def screenshot(sandbox_id: str, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """The browser page's viewport as PNG (the viewport: 1280x577 in ``browser``, its 1280x720 window less the
    frame), or the whole X screen for a template with a display (``desktop``); header
    ``x-podbay-screenshot-source``: ``page`` or ``display``. After a credential fill, password fields and filled
    fields are painted over (opaque black)."""
    base, gen = await nodes_client.target(ctx, who, sandbox_id, SandboxCommand.EXEC)
    return await nodes_client.proxy(ctx, request, _node(base, sandbox_id, "/screenshot"), gen, method="POST",
                                 tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.COMPUTER,
                                 pass_headers=("content-type", "content-length", SCREENSHOT_SOURCE_HEADER))


@router.post("/mouse", response_model=ComputerResult)
async def mouse(sandbox_id: str, body: MouseAction, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Move, click, drag or scroll at CSS-pixel coordinates of the page."""
    base, gen, _ = await nodes_client.lookup(ctx, who, sandbox_id, SandboxCommand.EXEC, "sandbox.computer.mouse",
                                          {"action": body.action})
    return await nodes_client.proxy(ctx, request, _node(base, sandbox_id, "/mouse"), gen, method="POST",
                                 tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.COMPUTER,
                                 json_body=body.model_dump(mode="json"))


@router.post("/keyboard", response_model=ComputerResult)
async def keyboard(sandbox_id: str, body: KeyboardAction, request: Request, ctx: CtxDep,
                   who: PrincipalDep) -> Response:
    """Type text at the focus, or press keys (``Enter``, ``Control+a``)."""
    base, gen, _ = await nodes_client.lookup(ctx, who, sandbox_id, SandboxCommand.EXEC, "sandbox.computer.keyboard",
                                          {"action": body.action})
    return await nodes_client.proxy(ctx, request, _node(base, sandbox_id, "/keyboard"), gen, method="POST",
                                 tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.COMPUTER,
                                 json_body=body.model_dump(mode="json", exclude_none=True))


@router.post("/fill", response_model=FillResult)
async def fill(sandbox_id: str, body: FillRequest, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response:
    """Type credential ``credential`` into ``selector``'s element when the page's origin is one of its hosts.
    404 ``credential_not_found``; 403 ``credential_out_of_scope``, ``credential_expired``,
    ``origin_not_allowed``; 422 ``selector_not_found``, ``invalid_selector``. The answer never holds the value."""
    base, gen = await nodes_client.target(ctx, who, sandbox_id, SandboxCommand.EXEC)
    return await nodes_client.proxy(ctx, request, _node(base, sandbox_id, "/fill"), gen, method="POST",
                                 tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.FILL,
                                 json_body=body.model_dump(mode="json"))


@router.get("/cdp", response_model=CdpEndpoint)
async def cdp(sandbox_id: str, request: Request, ctx: CtxDep, who: PrincipalDep) -> Response | CdpEndpoint:
    """Where a CDP client (Playwright's ``connect_over_cdp``, Puppeteer's ``connect``) reaches the browser:
    ``ws(s)://<API>/ports/<port>-<id>/devtools/browser/<id>?podbay_token=...`` through the port edge."""
    base, gen = await nodes_client.target(ctx, who, sandbox_id, SandboxCommand.EXEC)
    resp = await nodes_client.proxy(ctx, request, _node(base, sandbox_id, "/cdp"), gen, method="GET",
                                 tenant=who.tenant_id, subject=sandbox_id, kind=GrantKind.COMPUTER)
    if resp.status_code != 200:
        return resp  # the node's error (no_browser), passed through
    t = CdpTarget.model_validate(json.loads(bytes(resp.body)))
    scheme = request.headers.get("x-forwarded-proto") or request.url.scheme
    host = request.headers.get("x-forwarded-host") or request.headers.get("host") or \
        f"{ctx.settings.api_host}:{ctx.settings.api_port}"
    _, path_url = pa.port_url(sandbox_id, t.port, scheme=scheme, domain=ctx.settings.ports_domain, api_host=host)
    ws_url = ("wss" if scheme == "https" else "ws") + path_url.partition("://")[1] + \
        path_url.partition("://")[2].rstrip("/") + t.browser_path
    token = pa.traffic_token(ctx.settings.internal_token, sandbox_id)
    return CdpEndpoint(url=f"{ws_url}?{pa.TOKEN_QUERY}={token}", ws_url=ws_url, token=token, port=t.port,
                       browser=t.browser)
