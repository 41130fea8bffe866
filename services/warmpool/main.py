"""``podbay-warmpool``: will keep prepared sandboxes per template and node (DESIGN.md §5, warm pools).

For now it connects to PostgreSQL and NATS, reports health and metrics, and stops cleanly; creation falls
back to a restore from the template snapshot, which is what the pool will accelerate.
"""

from __future__ import annotations

import asyncio
import logging

from podbay import db
from podbay.bus import connect_bus
from podbay.config import get_settings
from podbay.service import health_app, run_service, serve_http

__all__ = ["main"]

log = logging.getLogger("podbay.warmpool")


async def _main(stop: asyncio.Event) -> None:
    settings = get_settings()
    pool = await db.connect_pool(settings.pg_dsn, min_size=1, max_size=2)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name="podbay-warmpool")

    def health() -> dict[str, object]:
        return {"ok": bus.nc.is_connected and not pool._closed}  # noqa: SLF001  # asyncpg has no public flag

    app = health_app("warmpool", health)
    log.info("warm-pool manager ready")
    await serve_http(app, "127.0.0.1", settings.warmpool_port, stop)
    await bus.close()
    await pool.close()


def main() -> None:
    raise SystemExit(run_service("warmpool", _main))
