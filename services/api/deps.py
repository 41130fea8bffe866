"""FastAPI dependencies: the process context and the authenticated caller."""

from __future__ import annotations

from fastapi import Request

from .auth import Principal, authenticate
from .context import ApiContext

__all__ = ["ctx_dep", "principal_dep"]


def ctx_dep(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def principal_dep(request: Request) -> Principal:
    """401 ``unauthorized`` unless the bearer key is valid."""
    ctx: ApiContext = request.app.state.ctx
    return await authenticate(ctx.pool, request.headers.get("authorization"), on_refused=ctx.relay.kick)
