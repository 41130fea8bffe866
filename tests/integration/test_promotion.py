"""Promotion to object storage, fetch and garbage collection against real PostgreSQL and S3 (SeaweedFS).

Snapshot files are made here (a sparse "disk", a "ram" of random and zero pages, a small "state"), so
these tests need no VM; tests/e2e/test_suspend.py covers the same paths with real microVMs.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from podbay.chunks import Manifest, chunk_key, compress
from podbay.config import Settings
from podbay.devstack.servers import S3Endpoint
from podbay.errors import SnapshotCorrupt
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import new_id
from podbay.promotion import collect_garbage, fetch, local_chunks, promote

pytestmark = pytest.mark.integration

CHUNK_KIB = 256
MIB = 1 << 20


@pytest.fixture
def settings(s3: S3Endpoint, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    return Settings(s3_url=s3.url, s3_bucket=s3.bucket, pg_dsn=pg_dsn, chunk_size_kib=CHUNK_KIB,
                    s3_multipart_threshold_mib=5)


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[ObjectStore]:
    async with open_store(settings) as st:
        await st.ensure_bucket()
        yield st


async def _sandbox(pool: asyncpg.Pool) -> tuple[str, str]:
    tenant, sandbox = new_id("tnt"), new_id("sbx")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('promo-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname) VALUES ($1,$2,'promo-test','d','running','running',256,1,'h')", sandbox, tenant)
    return tenant, sandbox


async def _snapshot(pool: asyncpg.Pool, tenant: str, sandbox: str) -> str:
    snap = new_id("snap")
    await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation)"
                       " VALUES ($1,$2,$3,'full','ready',1)", snap, tenant, sandbox)
    return snap


def _make_files(d: Path, seed: bytes) -> None:
    """A 24 MiB ram (16 MiB random, the rest zero), a 64 MiB sparse disk with 8 MiB of data, a small state."""
    d.mkdir(parents=True)
    rnd = b"".join(__import__("hashlib").sha256(seed + i.to_bytes(4, "big")).digest() * 128 for i in range(4096))
    with open(d / "ram", "wb") as f:
        f.write(rnd[: 16 * MIB] if len(rnd) >= 16 * MIB else (rnd * 16)[: 16 * MIB])
        f.truncate(24 * MIB)
    with open(d / "disk.img", "wb") as f:
        f.truncate(64 * MIB)
        f.seek(8 * MIB)
        f.write(os.urandom(8 * MIB))
    (d / "state").write_bytes(os.urandom(60_000))


def _change(src: Path, dst: Path, *, ram_bytes: int) -> None:
    """``dst`` = ``src`` with ``ram_bytes`` of the ram file rewritten (an idle guest's few dirty pages)."""
    shutil.copytree(src, dst)
    with open(dst / "ram", "r+b") as f:
        f.seek(3 * MIB)
        f.write(os.urandom(ram_bytes))
    (dst / "state").write_bytes(os.urandom(60_000))


async def test_second_snapshot_uploads_a_small_fraction_and_fetch_rebuilds_it(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path) -> None:
    tenant, sandbox = await _sandbox(pool)
    first, second = await _snapshot(pool, tenant, sandbox), await _snapshot(pool, tenant, sandbox)
    _make_files(tmp_path / first, first.encode())
    _change(tmp_path / first, tmp_path / second, ram_bytes=300 * 1024)

    r1 = await promote(pool, store, settings, first, tmp_path / first)
    r2 = await promote(pool, store, settings, second, tmp_path / second)
    assert r1.uploaded_bytes >= 24 * MIB  # 16 MiB of ram and 8 MiB of disk data, at least
    assert r2.uploaded_bytes < 0.10 * r1.uploaded_bytes, (r1, r2)
    assert r1.stored_bytes < r1.uploaded_bytes + 4 * MIB  # compressed; zero chunks nearly vanish
    rows = await pool.fetch("SELECT promotion, manifest FROM snapshots WHERE id = ANY($1::text[])", [first, second])
    assert {r["promotion"] for r in rows} == {"promoted"}
    again = await promote(pool, store, settings, second, tmp_path / second)
    assert again.already

    # Fetch on "another node": no base, then with the first snapshot as the local base (reused chunks).
    out = tmp_path / "fetched"
    res = await fetch(pool, store, settings, second, out)
    for name in ("ram", "disk.img", "state"):
        assert (out / name).read_bytes() == (tmp_path / second / name).read_bytes(), name
    out2 = tmp_path / "fetched-with-base"
    res2 = await fetch(pool, store, settings, second, out2, base_dir=tmp_path / first)
    assert (out2 / "ram").read_bytes() == (tmp_path / second / "ram").read_bytes()
    assert res2.chunks_downloaded < res.chunks_downloaded / 4, (res, res2)


async def test_fetch_reuses_chunks_of_other_snapshots_on_the_node_and_checks_them(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path) -> None:
    tenant, sandbox = await _sandbox(pool)
    other, wanted = await _snapshot(pool, tenant, sandbox), await _snapshot(pool, tenant, sandbox)
    _make_files(tmp_path / other, other.encode())
    _change(tmp_path / other, tmp_path / wanted, ram_bytes=512 * 1024)
    await promote(pool, store, settings, other, tmp_path / other)
    await promote(pool, store, settings, wanted, tmp_path / wanted)
    manifest = Manifest.model_validate(await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", other))

    plain = await fetch(pool, store, settings, wanted, tmp_path / "plain")
    local = local_chunks([(manifest, tmp_path / other)])
    reused = await fetch(pool, store, settings, wanted, tmp_path / "reused", local=local)
    for name in ("ram", "disk.img", "state"):
        assert (tmp_path / "reused" / name).read_bytes() == (tmp_path / wanted / name).read_bytes(), name
    assert reused.chunks_downloaded < plain.chunks_downloaded / 4, (plain, reused)

    # A local file that changed since is not trusted: its chunks are downloaded and the result is still right.
    with open(tmp_path / other / "disk.img", "r+b") as f:
        f.seek(8 * MIB)
        f.write(os.urandom(4 * MIB))
    again = await fetch(pool, store, settings, wanted, tmp_path / "again", local=local)
    assert (tmp_path / "again" / "disk.img").read_bytes() == (tmp_path / wanted / "disk.img").read_bytes()
    assert again.chunks_downloaded > reused.chunks_downloaded


async def test_large_objects_go_up_in_parts(pool: asyncpg.Pool, store: ObjectStore, settings: Settings,
                                            tmp_path: Path) -> None:
    big = settings.model_copy(update={"chunk_size_kib": 12 * 1024})  # 12 MiB chunks > 5 MiB threshold
    tenant, sandbox = await _sandbox(pool)
    snap = await _snapshot(pool, tenant, sandbox)
    (tmp_path / snap).mkdir()
    (tmp_path / snap / "ram").write_bytes(os.urandom(13 * MIB))
    res = await promote(pool, store, big, snap, tmp_path / snap)
    assert res.chunks_uploaded == 2
    first = (await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", snap))["files"][0]["chunks"][0]
    head = await store.client.head_object(Bucket=store.bucket, Key=chunk_key(first))
    assert "-" in head["ETag"]  # a multipart object's ETag is "<md5 of part md5s>-<parts>"
    out = tmp_path / "out"
    await fetch(pool, store, big, snap, out)
    assert (out / "ram").read_bytes() == (tmp_path / snap / "ram").read_bytes()


async def test_corrupt_or_missing_chunk_is_refused_with_a_checksum_error(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path) -> None:
    tenant, sandbox = await _sandbox(pool)
    snap = await _snapshot(pool, tenant, sandbox)
    _make_files(tmp_path / snap, snap.encode())
    await promote(pool, store, settings, snap, tmp_path / snap)
    manifest = await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", snap)
    victim = manifest["files"][0]["chunks"][0]  # first chunk of "state"
    await store.put(chunk_key(victim), compress(b"not what was stored" * 100))

    with pytest.raises(SnapshotCorrupt) as err:
        await fetch(pool, store, settings, snap, tmp_path / "out")
    assert err.value.details["chunk"] == victim and "checksum" in err.value.message
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.part").exists()

    await store.delete([chunk_key(victim)])
    with pytest.raises(SnapshotCorrupt, match="missing"):
        await fetch(pool, store, settings, snap, tmp_path / "out")


async def test_gc_deletes_unreferenced_chunks_and_orphans_but_keeps_referenced_ones(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path) -> None:
    tenant, sandbox = await _sandbox(pool)
    old, kept, promoting = [await _snapshot(pool, tenant, sandbox) for _ in range(3)]
    _make_files(tmp_path / old, old.encode())
    _make_files(tmp_path / kept, kept.encode())
    await promote(pool, store, settings, old, tmp_path / old)
    await promote(pool, store, settings, kept, tmp_path / kept)
    only_old = set((await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", old))["files"][1]["chunks"])
    kept_hashes = {h for f in (await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", kept))["files"]
                   for h in f["chunks"]}
    only_old -= kept_hashes
    assert only_old
    # A snapshot being promoted references one of the old chunks: it must survive.
    shielded = sorted(only_old)[0]
    await pool.execute("UPDATE snapshots SET promotion='promoting' WHERE id=$1", promoting)
    await pool.execute("INSERT INTO snapshot_chunks (snapshot_id, hash) VALUES ($1,$2)", promoting, shielded)
    orphan = "f" * 64
    await store.put(chunk_key(orphan), b"left by a crashed upload")

    await pool.execute("UPDATE snapshots SET state='deleted' WHERE id=$1", old)
    not_yet = await collect_garbage(pool, store, grace_s=3600)
    assert not set(not_yet.deleted_hashes) & only_old  # within the grace period
    res = await collect_garbage(pool, store, grace_s=0)
    assert only_old - {shielded} <= set(res.deleted_hashes)
    assert shielded not in res.deleted_hashes and not kept_hashes & set(res.deleted_hashes)
    for h in list(only_old - {shielded})[:5]:
        assert await store.head(chunk_key(h)) is None
    assert await store.head(chunk_key(shielded)) is not None
    assert await store.head(chunk_key(orphan)) is None
    out = tmp_path / "out"
    await fetch(pool, store, settings, kept, out)  # the kept snapshot is whole
    assert (out / "disk.img").read_bytes() == (tmp_path / kept / "disk.img").read_bytes()


_PROMOTE_IN_CHILD = """
import asyncio, sys
from pathlib import Path
from typing import Any
from podbay import db
from podbay.config import Settings
from podbay.objstore import open_store
from podbay.promotion import promote

async def main():
    s = Settings()
    pool = await db.connect_pool(s.pg_dsn)
    async with open_store(s) as store:
        await promote(pool, store, s, sys.argv[1], Path(sys.argv[2]))
    await pool.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("step", ["promote.manifest", "promote.uploading", "promote.uploaded", "promote.verified"])
async def test_sigkill_at_each_promotion_step_then_retry_completes(
        step: str, pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path,
        s3: S3Endpoint, pg_dsn: str) -> None:
    tenant, sandbox = await _sandbox(pool)
    snap = await _snapshot(pool, tenant, sandbox)
    _make_files(tmp_path / snap, snap.encode())
    env = {**os.environ, **s3.env(), "PODBAY_PG_DSN": pg_dsn, "PODBAY_CHUNK_SIZE_KIB": str(CHUNK_KIB),
           "PODBAY_FAULT_STEP": step}
    proc = subprocess.run([sys.executable, "-c", _PROMOTE_IN_CHILD, snap, str(tmp_path / snap)], env=env,
                          capture_output=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    row = await pool.fetchrow("SELECT promotion FROM snapshots WHERE id=$1", snap)
    assert row["promotion"] == "promoting"  # nothing may rely on it yet
    # A collection meanwhile keeps everything the half-promoted snapshot references.
    res = await collect_garbage(pool, store, grace_s=0)
    manifest = await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", snap)
    assert not {h for f in manifest["files"] for h in f["chunks"]} & set(res.deleted_hashes)

    done = await promote(pool, store, settings, snap, tmp_path / snap)  # what redelivery does
    assert not done.already
    assert await pool.fetchval("SELECT promotion FROM snapshots WHERE id=$1", snap) == "promoted"
    out = tmp_path / "out"
    await fetch(pool, store, settings, snap, out)
    for name in ("ram", "disk.img", "state"):
        assert (out / name).read_bytes() == (tmp_path / snap / name).read_bytes(), name


class _NoRelay:
    def kick(self) -> None:
        pass


async def test_disk_snapshots_are_promoted_on_their_cadence(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path) -> None:
    from podbay_snapshotter.main import Snapshotter

    node = "node-cadence"
    s = settings.model_copy(update={"data_dir": tmp_path, "node_id": node, "promote_disk_interval_s": 300.0})
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1,'x',1,1,'tcg')"
                       " ON CONFLICT DO NOTHING", node)
    tenant, sandbox = await _sandbox(pool)
    ids = []
    for _ in range(2):
        snap = new_id("snap")
        await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, generation)"
                           " VALUES ($1,$2,$3,$4,'disk','ready',1)", snap, tenant, sandbox, node)
        d = tmp_path / "nodes" / node / "store" / "snapshots" / sandbox / snap
        d.mkdir(parents=True)
        with open(d / "disk.img", "wb") as f:
            f.truncate(16 * MIB)
            f.write(os.urandom(MIB))
        ids.append(snap)
    snapshotter = Snapshotter(s, pool, None, store, _NoRelay())  # type: ignore[arg-type]
    assert await snapshotter.cadence_once() == 1
    rows = {r["id"]: r["promotion"] for r in await pool.fetch(
        "SELECT id, promotion FROM snapshots WHERE id = ANY($1::text[])", ids)}
    assert rows == {ids[0]: "local", ids[1]: "promoted"}  # the newest one
    assert await snapshotter.cadence_once() == 0  # promoted within the interval: not due again
    await pool.execute("UPDATE snapshots SET promoted_at = now() - interval '1 hour' WHERE id=$1", ids[1])
    await pool.execute("UPDATE snapshots SET created_at = now() + interval '1 second' WHERE id=$1", ids[0])
    assert await snapshotter.cadence_once() == 1  # the interval passed and a newer disk snapshot is local
    assert await pool.fetchval("SELECT promotion FROM snapshots WHERE id=$1", ids[0]) == "promoted"


async def test_a_snapshot_deleted_before_its_cadence_promotion_is_skipped_not_failed(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    from podbay_snapshotter.main import Snapshotter

    node = "node-cadence-deleted"
    s = settings.model_copy(update={"data_dir": tmp_path, "node_id": node, "promote_disk_interval_s": 300.0})
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1,'x',1,1,'tcg')"
                       " ON CONFLICT DO NOTHING", node)
    tenant, sandbox = await _sandbox(pool)
    snap = new_id("snap")
    await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, generation)"
                       " VALUES ($1,$2,$3,$4,'disk','ready',1)", snap, tenant, sandbox, node)
    # No files on the node either: the sandbox's delete removed them after the cadence listed the snapshot.

    class DeletedMeanwhile(Snapshotter):
        async def promote_one(self, snapshot_id: str) -> Any:
            await pool.execute("UPDATE snapshots SET state='deleted' WHERE id=$1", snapshot_id)
            return await super().promote_one(snapshot_id)

    snapshotter = DeletedMeanwhile(s, pool, None, store, _NoRelay())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="podbay.snapshotter"):
        assert await snapshotter.cadence_once() == 1
    row = await pool.fetchrow("SELECT promotion, promotion_error FROM snapshots WHERE id=$1", snap)
    assert (row["promotion"], row["promotion_error"]) == ("local", None)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "deleted meanwhile" in caplog.text
