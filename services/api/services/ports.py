"""Guest ports' access as a service (table ``sandbox_ports``: a port is private unless a row makes it public;
``e2b_sandboxes``: E2B's traffic options; docs/ARCHITECTURE.md "Ports"). ``/v1/sandboxes/{id}/ports``
(services/api/routes/ports.py) and E2B's create (services/api/e2b/sandboxes.py) call it; the edge
(services/api/edge/ports.py) enforces what it records.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from ..core.auth import Principal
from ..core.context import ApiContext
from ..edge import ports_access as pa
from .sandbox_lookup import audit, load_sandbox

__all__ = ["settings_of", "is_public", "set_public", "e2b_traffic", "edge_row"]


_EDGE_ROW = (
    "SELECT s.tenant_id, s.state, s.generation, n.dataplane_url, COALESCE(p.public, false) AS public,"
    " COALESCE(e.allow_public_traffic, false) AS e2b_public, COALESCE(e.auto_resume, false) AS e2b_auto_resume,"
    " e.mask_request_host, e.env_vars"
    " FROM sandboxes s LEFT JOIN nodes n ON n.id = s.node_id"
    " LEFT JOIN sandbox_ports p ON p.sandbox_id = s.id AND p.port = $2"
    " LEFT JOIN e2b_sandboxes e ON e.sandbox_id = s.id"
    " WHERE s.id = $1")


async def edge_row(pool: asyncpg.Pool, sandbox_id: str, port: int) -> asyncpg.Record | None:
    """What the port edge (services/api/edge/ports.py) decides a request on, in one query, or None when there is
    no such sandbox (any tenant's: the edge checks the credential): ``tenant_id``, ``state``, ``generation``,
    ``dataplane_url`` (its node's; None without a node), ``public`` (the guest ``port``'s setting, false
    without one), and E2B's traffic options: ``e2b_public``, ``e2b_auto_resume`` (false without an
    ``e2b_sandboxes`` row), ``mask_request_host``, ``env_vars`` (None without one)."""
    row: asyncpg.Record | None = await pool.fetchrow(_EDGE_ROW, sandbox_id, port)
    return row


async def settings_of(pool: asyncpg.Pool, sandbox_id: str) -> dict[int, bool]:
    """``{port: public}`` of every port of the sandbox with an access setting."""
    return {int(r["port"]): bool(r["public"]) for r in await pool.fetch(
        "SELECT port, public FROM sandbox_ports WHERE sandbox_id = $1", sandbox_id)}


async def is_public(conn: asyncpg.Connection | asyncpg.Pool, sandbox_id: str, port: int) -> bool:
    """Whether the sandbox's guest ``port`` is public (no setting: private)."""
    return bool(await conn.fetchval("SELECT public FROM sandbox_ports WHERE sandbox_id = $1 AND port = $2",
                                    sandbox_id, port))


async def set_public(ctx: ApiContext, who: Principal, sandbox_id: str, port: int, public: bool) -> None:
    """Make the caller's sandbox's guest ``port`` public or private; audited (``sandbox.port.public`` /
    ``sandbox.port.private``) in the same transaction when it changes. NotFound (another tenant's sandbox)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        await load_sandbox(conn, who.tenant_id, sandbox_id, for_update=True)
        if await is_public(conn, sandbox_id, port) != public:
            await conn.execute("INSERT INTO sandbox_ports (sandbox_id, port, public) VALUES ($1, $2, $3)"
                               " ON CONFLICT (sandbox_id, port) DO UPDATE SET public = $3, updated_at = now()",
                               sandbox_id, port, public)
            await audit(conn, who, "sandbox.port.public" if public else "sandbox.port.private", sandbox_id,
                        detail={"port": port})
    ctx.relay.kick()


async def e2b_traffic(ctx: ApiContext, sandbox_id: str, network: dict[str, Any] | None) -> dict[str, str]:
    """E2B's create options ``network.allowPublicTraffic`` (default true) and ``network.maskRequestHost``
    (checked by ``e2b.network.egress_policy`` before the create): record them for the edge and answer the
    fields E2B's ``Sandbox`` adds: ``trafficAccessToken`` when the sandbox's ports need it
    (``e2b-traffic-access-token``), nothing otherwise."""
    public = not (isinstance(network, dict) and network.get("allowPublicTraffic") is False)
    mask = network.get("maskRequestHost") if isinstance(network, dict) else None
    await ctx.pool.execute(
        "INSERT INTO e2b_sandboxes (sandbox_id, allow_public_traffic, mask_request_host) VALUES ($1, $2, $3)"
        " ON CONFLICT (sandbox_id) DO UPDATE SET allow_public_traffic = $2, mask_request_host = $3",
        sandbox_id, public, mask)
    return {} if public else {"trafficAccessToken": pa.e2b_traffic_token(ctx.settings.internal_token, sandbox_id)}
