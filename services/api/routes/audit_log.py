"""``GET /v1/audit``: the tenant's audit log, newest first (docs/DESIGN.md §6).

Rows come from every state-changing API call (actor = the API key id) and from the gateways (actor =
``gateway:<node>``: ``credential.use``, ``credential.refused``, ``egress.deny``, with ``decision``). The table
is append-only (migration 0007 refuses UPDATE, DELETE and TRUNCATE); nothing here writes to it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from podbay.contracts.access import AuditEntry, AuditPage

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import audit_log

__all__ = ["router"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]


@router.get("/audit", response_model=AuditPage)
async def list_audit(
    ctx: CtxDep,
    who: PrincipalDep,
    action: str | None = Query(None, max_length=128, description="Only this action, e.g. 'credential.use'; "
                               "a trailing '*' matches a prefix ('sandbox.*')."),
    sandbox_id: str | None = Query(None, max_length=128, description="Only rows about this sandbox."),
    since: datetime | None = Query(None, description="Only rows at or after this time (ISO 8601)."),
    before: int | None = Query(None, ge=1, description="Cursor: only rows with a smaller id (next_before)."),
    limit: int = Query(100, ge=1, le=1000),
) -> AuditPage:
    """The tenant's audit rows, newest first; page with ``before=<next_before>``."""
    rows = await audit_log.page(ctx.pool, who.tenant_id, action=action, sandbox_id=sandbox_id, since=since,
                                before=before, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    entries = [AuditEntry(id=r["id"], at=r["at"], actor=r["actor"], action=r["action"], target=r["target"],
                          sandbox_id=r["sandbox_id"], decision=r["decision"], detail=r["detail"] or {})
               for r in rows]
    return AuditPage(entries=entries, next_before=entries[-1].id if more and entries else None)
