"""podbay as an OIDC issuer of workload identity tokens (podbay.oidc; docs/egress.md "Workload identity"):
the two documents a relying party reads to verify a token the egress gateway minted. Public, no key: they hold
public keys only (a cloud's web identity federation fetches them anonymously).

    GET /.well-known/openid-configuration   200  OpenID Provider Metadata (OpenID Connect Discovery 1.0 §3)
    GET /.well-known/jwks.json              200  {"keys": [JWK]} (RFC 7517): the current and previous keys
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from podbay import oidc

from ..core.context import ApiContext
from ..core.deps import ctx_dep

__all__ = ["router"]

router = APIRouter(prefix="/.well-known", include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
# Verifiers cache these; a new key is published twice this long before it signs (podbay.oidc.PUBLISH_S).
_CACHE = {"Cache-Control": f"public, max-age={oidc.JWKS_MAX_AGE_S}"}


@router.get("/openid-configuration")
async def openid_configuration(ctx: CtxDep) -> JSONResponse:
    """The issuer's metadata: ``issuer``, ``jwks_uri``, RS256."""
    return JSONResponse(oidc.discovery(ctx.settings), headers=_CACHE)


@router.get("/jwks.json")
async def jwks(ctx: CtxDep) -> JSONResponse:
    """The public signing keys (a first key is made here when there is none, or the newest is due)."""
    return JSONResponse(await oidc.jwks(ctx.pool, ctx.settings), headers=_CACHE)
