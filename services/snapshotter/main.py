"""``podbay-snapshotter``: one per node; will promote snapshots to S3 (DESIGN.md §5).

For now it connects to PostgreSQL, NATS and S3 (creating the bucket if missing), reports health (all three
answer) and metrics, and stops cleanly. Promotion, fetch and garbage collection land with the suspend work.
"""

from __future__ import annotations

import asyncio
import logging
import os

from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from podbay import db
from podbay.bus import connect_bus
from podbay.config import get_settings
from podbay.service import health_app, run_service, serve_http

__all__ = ["main"]

log = logging.getLogger("podbay.snapshotter")


async def _main(stop: asyncio.Event) -> None:
    settings = get_settings()
    pool = await db.connect_pool(settings.pg_dsn, min_size=1, max_size=4)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name=f"podbay-snapshotter-{settings.node_id}")
    state: dict[str, object] = {"ok": False, "s3": "unknown"}
    session = get_session()
    async with session.create_client(
        "s3", endpoint_url=settings.s3_url, region_name=settings.s3_region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "podbay"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "podbay-secret"),
    ) as s3:

        async def check_s3() -> None:
            try:
                try:
                    await s3.head_bucket(Bucket=settings.s3_bucket)
                except ClientError:
                    await s3.create_bucket(Bucket=settings.s3_bucket)
                state["s3"] = "ok"
            except (BotoCoreError, ClientError, OSError) as exc:
                state["s3"] = f"error: {exc}"
            state["ok"] = state["s3"] == "ok" and bus.nc.is_connected

        await check_s3()
        app = health_app("snapshotter", lambda: dict(state))
        http = asyncio.create_task(serve_http(app, "127.0.0.1", settings.snapshotter_port, stop))
        log.info("snapshotter ready (node %s, bucket %s: %s)", settings.node_id, settings.s3_bucket, state["s3"])
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=10)
            except TimeoutError:
                await check_s3()
        await http
    await bus.close()
    await pool.close()


def main() -> None:
    raise SystemExit(run_service("snapshotter", _main))
