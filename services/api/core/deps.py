"""FastAPI dependencies: the process context and the authenticated caller."""

from __future__ import annotations

from fastapi import Request

from .auth import Principal
from ..console.session import request_principal
from .context import ApiContext

__all__ = ["ctx_dep", "principal_dep"]


def ctx_dep(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def principal_dep(request: Request) -> Principal:
    """The caller: its bearer key, or else its console session cookie (services/api/console/session.py), which
    needs the session's ``X-CSRF-Token`` on every method but GET, HEAD and OPTIONS. 401 ``unauthorized``
    without a valid key or session; 403 ``csrf_refused`` for a cookie's change without the token."""
    ctx: ApiContext = request.app.state.ctx
    return await request_principal(ctx.pool, request.method, request.headers, request.cookies,
                                   on_refused=ctx.relay.kick)
