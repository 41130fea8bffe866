"""The FastAPI application of ``podbay-api``: routes, middleware, health and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Header, Response

from podbay import db
from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.health import nats_check, pg_check, task_check
from podbay.errors import Forbidden
from podbay.httpmetrics import RequestMetrics
from podbay.metricsauth import metrics_response, token_matches
from podbay.outbox import Relay
from podbay.renewals import LeaseRenewals
from podbay.service import readyz_route
from podbay.webhooks import Deliverer

from podbay.contracts import subjects

from .routes import audit_log, computer, credentials, dataplane, drain, events, keys, network, nodes, pools, ports, sandboxes, snapshots, suspend, webhooks
from .e2b import sandboxes as e2b, network as e2b_network, secrets as e2b_secrets, snapshots as e2b_snapshots, volumes as e2b_volumes
from .edge import envd as e2b_envd, ports as ports_edge
from .core.auth import authenticate
from .core.bodylimit import BodyLimit
from .core.context import ApiContext
from .core.errors import install_error_handlers
from .schedules import routes as schedule_routes
from .e2b import template_admin as e2b_template_admin, templates as e2b_templates
from .routes import templates as template_routes
from .routes import volumes as volume_routes
from .services import idempotency, sandbox_service
from .services import template_access
from .routes import quotas as quota_routes
from .routes import oidc as oidc_routes
from .console import pty as console_pty, routes as console_routes
from .schedules.firer import ScheduleFirer

__all__ = ["create_app", "RequestMetrics"]


async def _starting() -> str:
    return "starting"


async def _stopping() -> str:
    return "stopping"


def create_app(settings: Settings) -> FastAPI:
    """Build the app; connections open in the lifespan (PostgreSQL pool, NATS, outbox relay)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await db.connect_pool(settings.pg_dsn, min_size=2, max_size=20)
        await db.migrate(pool)
        # Templates of the operator tenant are shared (owner NULL): migration 0033 could not know that tenant.
        await template_access.share_operator_templates(pool, settings.operator_tenant)
        bus = await connect_bus(settings.nats_url, name="podbay-api", heartbeat_ttl_s=settings.node_heartbeat_ttl_s)
        relay = Relay(pool, bus)
        # Exec and file transfers can be long; the per-request timeout is the guest's business, not httpx's.
        nodes_http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                       limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))
        # Idle connections are dropped before the node's server drops them (uvicorn: after 5 s), so a call
        # never goes out on a connection the node is closing.
        nodes_json = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0), auto_decompress=False, trust_env=False,
            connector=aiohttp.TCPConnector(limit=200, keepalive_timeout=4.0))
        ctx = ApiContext(settings=settings, pool=pool, bus=bus, relay=relay, nodes_http=nodes_http,
                         nodes_json=nodes_json)
        await ctx.waiter.start(bus)
        await bus.nc.subscribe(subjects.API_KEY_REVOKED, cb=keys.on_revoked)
        relay_task = asyncio.create_task(relay.run(), name="outbox-relay")
        ctx.renewals = LeaseRenewals(pool)
        renewals_stop = asyncio.Event()
        renewals_task = asyncio.create_task(ctx.renewals.run(renewals_stop), name="lease-renewals")
        app.state.ctx = ctx
        ready_checks.clear()
        ready_checks.update({"postgres": pg_check(pool), "nats": nats_check(bus),
                             "outbox relay": task_check("outbox relay", lambda: relay_task)})
        await sandbox_service.republish_unfinished(ctx)
        # Webhook delivery runs beside the API (podbay.webhooks): replicas share one durable consumer.
        hooks_stop = asyncio.Event()
        hooks_task: asyncio.Task[None] | None = None
        if settings.webhooks_enabled:
            deliverer = Deliverer(pool, bus, max_attempts=settings.webhook_max_attempts,
                                  backoff_s=settings.webhook_backoff_s, backoff_max_s=settings.webhook_backoff_max_s,
                                  timeout_s=settings.webhook_timeout_s,
                                  allow_private=settings.webhook_allow_private)
            hooks_task = asyncio.create_task(deliverer.run(hooks_stop), name="webhooks")
        # Schedules fire from the replica holding the `schedules` lease (schedules/firer.py).
        firer_task: asyncio.Task[None] | None = None
        if settings.schedules_enabled:
            firer_task = asyncio.create_task(ScheduleFirer(ctx).run(hooks_stop), name="schedules")
        keys_task = asyncio.create_task(idempotency.sweep_loop(pool, settings.idempotency_key_ttl_s, hooks_stop),
                                        name="idempotency-sweep")
        try:
            yield
        finally:
            ready_checks.clear()
            ready_checks["stopping"] = _stopping
            hooks_stop.set()
            if hooks_task is not None:
                try:
                    await asyncio.wait_for(hooks_task, timeout=8)
                except Exception:  # its unacked events are redelivered to another replica
                    hooks_task.cancel()
            if firer_task is not None:
                try:
                    await asyncio.wait_for(firer_task, timeout=10)
                except Exception:  # its runs stay `running`; the next lease holder puts their sandboxes back
                    firer_task.cancel()
            keys_task.cancel()
            renewals_stop.set()  # its last pass writes what it holds
            try:
                await asyncio.wait_for(renewals_task, timeout=5)
            except Exception:
                renewals_task.cancel()
            relay_task.cancel()
            await nodes_http.aclose()
            await nodes_json.close()
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
    app.include_router(template_routes.router)
    app.include_router(dataplane.router)
    app.include_router(snapshots.router)
    # E2B SDK compatibility (docs/e2b.md): its REST API under /e2b, its envd traffic routed by header or host.
    app.include_router(e2b.router)
    app.include_router(e2b_envd.router)
    app.include_router(e2b_templates.router)  # GET /templates/aliases/{alias} before .../{id}/tags
    app.include_router(e2b_template_admin.router)  # DELETE /templates/tags before .../{id} (e2b_snapshots)
    app.include_router(e2b_snapshots.router)
    app.include_router(e2b_network.router)
    app.include_router(e2b_volumes.router)
    app.include_router(e2b_secrets.router)
    app.include_router(oidc_routes.router)  # /.well-known: the workload identity issuer's public documents
    app.include_router(e2b.fallback_router)  # last of the /e2b routes: unknown ones answer E2B's 404
    # Inside EnvdRouting and the port edge: it sees the rewritten envd paths, never a guest port's traffic.
    app.add_middleware(BodyLimit, max_bytes=settings.api_body_max_mib << 20)
    app.add_middleware(e2b_envd.EnvdRouting, domain=settings.e2b_domain)
    # Guest ports ({port}-{sandbox}.{ports_domain}, /ports/..., E2B's hosts for ports other than envd's):
    # outside EnvdRouting, so it sees E2B's hosts first and leaves envd's port to it.
    app.add_middleware(ports_edge.PortsEdge, settings=settings)
    app.include_router(ports.router)
    app.include_router(computer.router)
    app.include_router(suspend.router)
    app.include_router(pools.router)
    app.include_router(nodes.router)
    app.include_router(credentials.router)
    app.include_router(keys.router)
    app.include_router(audit_log.router)
    app.include_router(network.router)
    app.include_router(events.router)
    app.include_router(webhooks.router)
    app.include_router(drain.router)
    app.include_router(quota_routes.router)
    app.include_router(schedule_routes.router)
    app.include_router(volume_routes.router)
    app.include_router(console_routes.router)  # the web console at /console (services/api/console/)
    app.include_router(console_pty.router)

    app.add_middleware(RequestMetrics, service="api")

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, object]:
        ctx: ApiContext = app.state.ctx
        await ctx.pool.fetchval("SELECT 1")
        return {"service": "api", "ok": True, "nats": ctx.bus.nc.is_connected}

    # Filled by the lifespan once the pool and bus exist; until then (and while stopping) the API is not ready.
    ready_checks: dict[str, Any] = {"starting": _starting}
    readyz_route(app, "api", ready_checks)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(authorization: str | None = Header(None)) -> Response:
        """Prometheus text for ``Bearer <PODBAY_METRICS_TOKEN>`` or an operator tenant's key: 401
        ``unauthorized`` without a (valid) credential, 403 ``forbidden`` for another tenant's key."""
        if token_matches(authorization, settings.metrics_token):
            return metrics_response()
        ctx: ApiContext = app.state.ctx
        who = await authenticate(ctx.pool, authorization)
        if await ctx.pool.fetchval("SELECT name FROM tenants WHERE id=$1", who.tenant_id) != settings.operator_tenant:
            raise Forbidden("only the operator tenant (or PODBAY_METRICS_TOKEN) may read metrics: they cover "
                            "every tenant")
        return metrics_response()

    return app
