"""The S3 server restarted while snapshots are being promoted (issue 42, "faults").

The real snapshotter's command handler (``podbay_snapshotter.main.Snapshotter.handle``) consumes promote
commands from the real JetStream stream, against the session's PostgreSQL and an S3 server (SeaweedFS) of the
test's own, which it stops and starts again on the same port and data while promotions upload. Invariants:
every snapshot ends ``promoted`` or ``failed`` (none left ``promoting``: the snapshotter retried, and a
promotion it gave up on says why); every ``promoted`` one has each of its chunks in the bucket with the size its
row records, and a fetch rebuilds its files byte for byte: no promotion recorded whose objects are missing.
The figures are printed (``-s``): S3 down time, recovery (from S3 answering again to the next promotion
recorded), promoted and failed counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from podbay import db
from podbay.bus import connect_bus, consume
from podbay.chunks import chunk_key
from podbay.config import Settings
from podbay.contracts import subjects
from podbay.contracts.messages import PromoteCmd
from podbay.devstack.procs import free_port
from podbay.devstack.servers import S3Server, start_s3
from podbay.objstore import open_store
from podbay.outbox import new_id
from podbay.promotion import fetch, snapshot_path
from podbay_snapshotter.main import Snapshotter

pytestmark = pytest.mark.timeout(420)

SNAPSHOTS = 6
MIB = 1 << 20
CHUNK_KIB = 256
FILES = ("ram", "disk.img", "state")
#: How long S3 stays stopped before it starts again (s): longer than the object store client's own retries and
#: than three deliveries of a promote command (what the snapshotter allowed before it waited storage out).
S3_DOWN_S = 25.0


class _NoRelay:
    """The outbox relay the snapshotter kicks after a promotion; the test reads the rows instead."""

    def kick(self) -> None:
        pass


def _make_files(d: Path) -> None:
    """16 MiB of incompressible ram, an 8 MiB disk, a small state: a promotion of some seconds each."""
    d.mkdir(parents=True)
    (d / "ram").write_bytes(os.urandom(16 * MIB))
    (d / "disk.img").write_bytes(os.urandom(8 * MIB))
    (d / "state").write_bytes(os.urandom(60_000))


@pytest.fixture
async def s3_of_our_own() -> AsyncIterator[tuple[S3Server, Path]]:
    root = Path(tempfile.mkdtemp(prefix="podbay-s3fault-"))
    server = await asyncio.to_thread(start_s3, root / "s3", free_port(), log_dir=root, bucket="podbay-s3fault")
    try:
        yield server, root
    finally:
        server.stop(1.0)
        shutil.rmtree(root, ignore_errors=True)


async def _seed(pool: asyncpg.Pool, data_dir: Path, node: str) -> list[tuple[str, str]]:
    """``SNAPSHOTS`` ready snapshots on ``node`` with their files: ``(snapshot id, sandbox id)`` each."""
    tenant = new_id("tnt")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1,'x',1,1,'tcg')",
                       node)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('s3fault', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    out = []
    for _ in range(SNAPSHOTS):
        sandbox, snap = new_id("sbx"), new_id("snap")
        await pool.execute(
            "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname) VALUES ($1,$2,'s3fault','d','running','running',256,1,'h')", sandbox, tenant)
        await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation, node_id)"
                           " VALUES ($1,$2,$3,'full','ready',1,$4)", snap, tenant, sandbox, node)
        await asyncio.to_thread(_make_files, snapshot_path(data_dir, node, sandbox, snap))
        out.append((snap, sandbox))
    return out


async def test_restarting_s3_during_promotions_records_none_whose_objects_are_missing(
        s3_of_our_own: tuple[S3Server, Path], pg_dsn: str, nats_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="podbay")
    server, root = s3_of_our_own
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    node = f"s3f-{os.urandom(3).hex()}"
    settings = Settings(s3_url=server.url, s3_bucket=server.bucket, pg_dsn=pg_dsn, node_id=node,
                        data_dir=root / "data", chunk_size_kib=CHUNK_KIB, s3_multipart_threshold_mib=64)
    pool = await db.connect_pool(pg_dsn, min_size=1, max_size=8)
    await db.migrate(pool)
    bus = await connect_bus(nats_url, name=f"faults-{node}", replicas=0)
    stop = asyncio.Event()
    try:
        snaps = await _seed(pool, settings.data_dir, node)
        ids = [s for s, _ in snaps]
        async with open_store(settings) as store:
            snapper = Snapshotter(settings, pool, bus, store, _NoRelay())
            sub = await bus.pull_subscribe(subjects.snapshotter_consumer(node), subjects.snapshotter_promote(node),
                                           ack_wait_s=60.0)
            consumer = asyncio.create_task(consume(sub, snapper.handle, stop, finish_timeout_s=30))
            for snap, sandbox in snaps:
                await bus.publish_command(subjects.snapshotter_promote(node),
                                          PromoteCmd(snapshot_id=snap, sandbox_id=sandbox),
                                          msg_id=f"promote.{snap}")
            # The fault: as soon as a promotion is under way (its manifest is recorded and its uploads run).
            deadline = time.monotonic() + 120
            while not await pool.fetchval("SELECT count(*) FROM snapshots WHERE id = ANY($1) AND"
                                          " promotion = 'promoting'", ids):
                assert time.monotonic() < deadline, "no promotion started"
                await asyncio.sleep(0.05)
            fault_at = time.monotonic()
            promoted_before = await pool.fetchval("SELECT count(*) FROM snapshots WHERE id = ANY($1) AND"
                                                  " promotion = 'promoted'", ids)
            await asyncio.to_thread(server.stop, 1.0)
            await asyncio.sleep(S3_DOWN_S)  # a restart that takes a while (a host reboot, a rolling update)
            restarted = await asyncio.to_thread(start_s3, root / "s3", server.port, log_dir=root,
                                                bucket=server.bucket)
            back_at = time.monotonic()
            try:
                deadline = time.monotonic() + 240
                first_after: float | None = None
                while True:
                    rows = await pool.fetch("SELECT id, promotion, promotion_error FROM snapshots"
                                            " WHERE id = ANY($1)", ids)
                    if first_after is None and sum(r["promotion"] == "promoted" for r in rows) > promoted_before:
                        first_after = time.monotonic() - back_at
                    if all(r["promotion"] in ("promoted", "failed") for r in rows):
                        break
                    assert time.monotonic() < deadline, [dict(r) for r in rows]
                    await asyncio.sleep(0.2)
                done_at = time.monotonic()
                stop.set()
                await consumer

                # Each failed try the snapshotter logged (it then leaves the command to be delivered again).
                retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
                promoted = [r["id"] for r in rows if r["promotion"] == "promoted"]
                failed = {r["id"]: r["promotion_error"] for r in rows if r["promotion"] == "failed"}
                # Every recorded promotion has all of its objects, of the recorded size, and fetches whole.
                for snap in promoted:
                    chunks = await pool.fetch(
                        "SELECT c.hash, c.stored_size FROM snapshot_chunks sc JOIN chunks c ON c.hash = sc.hash"
                        " WHERE sc.snapshot_id = $1", snap)
                    wanted = await pool.fetchval("SELECT count(*) FROM snapshot_chunks WHERE snapshot_id=$1", snap)
                    assert len(chunks) == wanted > 0, f"{snap}: chunks without their row"
                    for c in chunks:
                        assert await store.head(chunk_key(c["hash"])) == c["stored_size"], (snap, c["hash"])
                    sandbox = dict(snaps)[snap]
                    out = root / "fetched" / snap
                    await fetch(pool, store, settings, snap, out)
                    src = snapshot_path(settings.data_dir, node, sandbox, snap)
                    for name in FILES:
                        assert (out / name).read_bytes() == (src / name).read_bytes(), (snap, name)
                    shutil.rmtree(out)
                # A failed promotion says why (a clear error, not silence).
                assert all(failed.values()), failed
                print("FAULT " + json.dumps({
                    "fault": "s3 restarted during promotions", "s3_down_s": round(back_at - fault_at, 2),
                    "promoted": len(promoted), "failed": len(failed), "promoted_before_fault": promoted_before,
                    "first_promotion_after_restart_s": None if first_after is None else round(first_after, 2),
                    "all_settled_s": round(done_at - back_at, 2),
                    "failed_reasons": sorted({str(v)[:160] for v in failed.values()}),
                    "failed_tries": len(retries), "last_failed_try": max(
                        (int(m[1]) for m in (re.search(r"\(try (\d+)\)", r) for r in retries) if m), default=0)}))
                # The snapshotter retried across the outage: the promotions it was running finished.
                assert not failed, f"promotions given up although S3 came back: {failed}"
            finally:
                restarted.stop(1.0)
    finally:
        stop.set()
        await bus.close()
        await pool.close()
