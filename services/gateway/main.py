"""``podbay-gateway``: one per node, the only way out for sandboxes (docs/DESIGN.md §1, §6; docs/egress.md).

Listens on:

* ``0.0.0.0:settings.gateway_proxy_port``: the transparent TCP proxy (mitmproxy; :mod:`.proxy`);
* ``0.0.0.0:settings.gateway_dns_port``: DNS over UDP and TCP (:mod:`.dnsserver`);
* ``127.0.0.1:settings.gateway_port``: ``/healthz`` and ``/metrics``.

The proxy and DNS ports bind every address because the node's nftables ``redirect`` sends a tap's traffic
to the tap's own host address; only sandbox taps are redirected there, and a peer without a binding file is
refused. Runs on the plain asyncio loop (mitmproxy's transparent mode reads ``SO_ORIGINAL_DST`` from the
asyncio socket), from its own virtualenv ``.venv-gateway`` (mitmproxy pins h2 below what the test extra needs).

Shutdown on SIGTERM/SIGINT: stop accepting, let mitmproxy close its connections, wait for pending audit
writes and publish the outbox, then close NATS and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

from podbay import db
from podbay.bus import connect_bus
from podbay.config import get_settings
from podbay.outbox import Relay
from podbay.health import nats_check, pg_check, task_check
from podbay.service import health_app, run_service, serve_http

from .dnsserver import DnsServer
from .engine import Gateway
from .store import GatewayStore

__all__ = ["main"]

log = logging.getLogger("podbay.gateway")


async def _main(stop: asyncio.Event) -> None:
    from .proxy import build_master  # mitmproxy is only in the gateway's virtualenv

    settings = get_settings()
    pool = await db.connect_pool(settings.pg_dsn, min_size=1, max_size=8)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name=f"podbay-gateway-{settings.node_id}",
                            heartbeat_ttl_s=settings.node_heartbeat_ttl_s)
    relay = Relay(pool, bus)
    relay_task = asyncio.create_task(relay.run(), name="outbox-relay")
    gw = Gateway(settings, GatewayStore(pool, settings.node_id), relay)
    await gw.refresh_own_addresses()
    if not gw.own_addrs - {"127.0.0.1", "::1"}:
        log.warning("no address of this node found besides loopback; only the fixed ranges protect it")
    addr_task = asyncio.create_task(gw.watch_own_addresses(stop), name="node-addresses")
    dns_server = DnsServer(gw, "0.0.0.0", settings.gateway_dns_port)
    await dns_server.start()
    master, _addon, work_dir = build_master(settings, gw)
    proxy_task = asyncio.create_task(master.run(), name="proxy")
    ready = asyncio.Event()

    async def _watch_ready() -> None:
        ps = master.addons.get("proxyserver")
        while not stop.is_set() and not proxy_task.done():
            if ps is not None and ps.servers.is_updating is False and any(s.is_running for s in ps.servers):
                ready.set()
                return
            await asyncio.sleep(0.05)

    ready_task = asyncio.create_task(_watch_ready())

    def health() -> dict[str, object]:
        ok = ready.is_set() and not proxy_task.done() and bus.nc.is_connected and not pool._closed  # noqa: SLF001  # asyncpg's Pool has no public closed flag
        return {"ok": ok, "proxy_port": settings.gateway_proxy_port, "dns_port": settings.gateway_dns_port}

    log.info("gateway for node %s: proxy :%d, dns :%d, health %s:%d", settings.node_id,
             settings.gateway_proxy_port, settings.gateway_dns_port, settings.health_host, settings.gateway_port)

    async def _proxy_died() -> None:
        await asyncio.wait({proxy_task}, return_when=asyncio.FIRST_COMPLETED)
        stop.set()

    watchdog = asyncio.create_task(_proxy_died())

    async def proxy_listening() -> str | None:
        return None if ready.is_set() and not proxy_task.done() else "proxy not listening"

    app = health_app("gateway", health, {"proxy": proxy_listening, "nats": nats_check(bus),
                                         "postgres": pg_check(pool),
                                         "node addresses": task_check("address watch", lambda: addr_task)})
    try:
        await serve_http(app, settings.health_host, settings.gateway_port, stop)
    finally:
        ready_task.cancel()
        watchdog.cancel()
        addr_task.cancel()
        master.shutdown()
        await asyncio.wait({proxy_task}, timeout=10)
        shutil.rmtree(work_dir, ignore_errors=True)
        await dns_server.close()
        await gw.drain()
        try:
            await asyncio.wait_for(relay.flush(), timeout=5)
        except Exception as exc:  # noqa: BLE001 - the periodic sweep of any process publishes what is left
            log.warning("outbox not flushed at shutdown: %s", exc)
        relay_task.cancel()
        await bus.close()
        await pool.close()
    if proxy_task.done() and not proxy_task.cancelled() and proxy_task.exception() is not None:
        raise RuntimeError("the proxy stopped") from proxy_task.exception()
    if not ready.is_set():
        raise RuntimeError(f"the proxy never listened on port {settings.gateway_proxy_port}")


def main() -> None:
    """Entry point: plain asyncio (not uvloop), signals set the stop event; exit code 1 on failure."""
    raise SystemExit(run_service("gateway", _main, use_uvloop=False))  # level: PODBAY_LOG_LEVEL
