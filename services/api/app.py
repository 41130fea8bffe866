"""The FastAPI application of ``podbay-api``: routes, middleware, health and metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from podbay import db
from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.outbox import Relay
from podbay.telemetry import HTTP_REQUEST_SECONDS

from podbay.contracts import subjects

from . import (audit_log, credentials, dataplane, drain, e2b, e2b_envd, keys, network, nodes, pools, sandboxes, snapshots,
               suspend)
from .context import ApiContext
from .errors import install_error_handlers

__all__ = ["create_app"]


def create_app(settings: Settings) -> FastAPI:
    """Build the app; connections open in the lifespan (PostgreSQL pool, NATS, outbox relay)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await db.connect_pool(settings.pg_dsn, min_size=2, max_size=20)
        await db.migrate(pool)
        bus = await connect_bus(settings.nats_url, name="podbay-api", heartbeat_ttl_s=settings.node_heartbeat_ttl_s)
        relay = Relay(pool, bus)
        # Exec and file transfers can be long; the per-request timeout is the guest's business, not httpx's.
        nodes_http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                       limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))
        ctx = ApiContext(settings=settings, pool=pool, bus=bus, relay=relay, nodes_http=nodes_http)
        await ctx.waiter.start(bus)
        await bus.nc.subscribe(subjects.API_KEY_REVOKED, cb=keys.on_revoked)
        relay_task = asyncio.create_task(relay.run(), name="outbox-relay")
        app.state.ctx = ctx
        await suspend.republish_unfinished(ctx)
        try:
            yield
        finally:
            relay_task.cancel()
            await nodes_http.aclose()
            await bus.close()
            await pool.close()

    app = FastAPI(
        title="podbay API",
        version="0.1.0",
        description="Sandboxes for long-running AI agents. Authenticate with `Authorization: Bearer <key>`.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(sandboxes.router)
    app.include_router(dataplane.router)
    app.include_router(snapshots.router)
    # E2B SDK compatibility (docs/e2b.md): its REST API under /e2b, its envd traffic routed by header or host.
    app.include_router(e2b.router)
    app.include_router(e2b_envd.router)
    app.add_middleware(e2b_envd.EnvdRouting, domain=settings.e2b_domain)
    app.include_router(suspend.router)
    app.include_router(pools.router)
    app.include_router(nodes.router)
    app.include_router(credentials.router)
    app.include_router(keys.router)
    app.include_router(audit_log.router)
    app.include_router(network.router)
    app.include_router(drain.router)

    @app.middleware("http")
    async def _metrics(request: Request, call_next: Any) -> Response:
        t = time.perf_counter()
        response: Response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        HTTP_REQUEST_SECONDS.labels("api", path, request.method, f"{response.status_code // 100}xx").observe(
            time.perf_counter() - t)
        return response

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, object]:
        ctx: ApiContext = app.state.ctx
        await ctx.pool.fetchval("SELECT 1")
        return {"service": "api", "ok": True, "nats": ctx.bus.nc.is_connected}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
