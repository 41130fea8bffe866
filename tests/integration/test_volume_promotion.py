"""Volume snapshots promoted through the chunk store and fetched back, against real PostgreSQL and S3.

The volume's file is made here (a sparse file with a few MiB of data), so no VM is needed;
tests/e2e/test_volumes.py wakes a sandbox with its volume on another node.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from podbay.chunks import zero_hash
from podbay.config import Settings
from podbay.devstack.servers import S3Endpoint
from podbay.errors import NotFound
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import new_id
from podbay.promotion import collect_garbage
from podbay.volume_promotion import due_volumes, fetch_volume, snapshot_volume, volume_path, volume_snapshots_dir

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture
def settings(s3: S3Endpoint, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    return Settings(s3_url=s3.url, s3_bucket=s3.bucket, pg_dsn=pg_dsn, chunk_size_kib=256, data_dir=tmp_path,
                    retain_volume_snapshots=2)


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[ObjectStore]:
    async with open_store(settings) as st:
        await st.ensure_bucket()
        yield st


async def _volume(pool: asyncpg.Pool, node: str, size: int) -> str:
    tenant, vol = new_id("tnt"), new_id("vol")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO volumes (id, tenant_id, name, size_bytes, node_id) VALUES ($1,$2,'data',$3,$4)",
                       vol, tenant, size, node)
    return vol


def _write(path: Path, offset: int, seed: bytes, n: int) -> None:
    data = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(n // 32))
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_volume_snapshot_promotes_fetches_elsewhere_and_keeps_the_newest(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings) -> None:
    node_a, node_b = new_id("node"), new_id("node")
    size = 32 * MIB
    vol = await _volume(pool, node_a, size)
    src = volume_path(settings.data_dir, node_a, vol)
    src.parent.mkdir(parents=True)
    with open(src, "wb") as f:
        f.truncate(size)
    _write(src, 0, b"one", 2 * MIB)
    assert await due_volumes(pool, settings.data_dir, node_a, 300) == [vol]
    work = volume_snapshots_dir(settings.data_dir, node_a)
    # The all-zero chunk is stored once for everything in the bucket: an earlier test may have sent it.
    zero_stored = await pool.fetchval("SELECT count(*) FROM chunks WHERE hash=$1", zero_hash(settings.chunk_size_kib << 10))
    first = await snapshot_volume(pool, store, settings, vol, node_id=node_a, source=src, work_dir=work,
                                  reason="cadence")
    # 2 MiB of data in 256 KiB chunks, plus the zero chunk unless it was there already.
    assert first.result.chunks_uploaded == 8 + (0 if zero_stored else 1)
    row = await pool.fetchrow("SELECT snapshot_id, snapshot_at FROM volumes WHERE id=$1", vol)
    assert row["snapshot_id"] == first.snapshot_id
    assert not any(work.rglob("*.img")), "the local copy is removed once promoted"
    # Not due again within the period, whatever the file does.
    assert vol not in await due_volumes(pool, settings.data_dir, node_a, 300)

    # A second snapshot after a 1 MiB write sends only the changed chunks.
    _write(src, 8 * MIB, b"two", MIB)
    second = await snapshot_volume(pool, store, settings, vol, node_id=node_a, source=src, work_dir=work,
                                   reason="suspend")
    assert second.result.chunks_uploaded == 4
    assert await pool.fetchval("SELECT snapshot_id FROM volumes WHERE id=$1", vol) == second.snapshot_id

    # Another node that lacks the file rebuilds it from object storage: same bytes, holes stay holes.
    dest = volume_path(settings.data_dir, node_b, vol)
    dest.parent.mkdir(parents=True)
    res = await fetch_volume(pool, store, settings, vol, dest)
    assert _digest(dest) == _digest(src)
    assert dest.stat().st_size == size
    assert dest.stat().st_blocks * 512 < 8 * MIB
    assert res.chunks_downloaded == 12

    # Retention keeps the newest two promoted snapshots; a third drops the first and its chunk references.
    _write(src, 16 * MIB, b"three", MIB)
    third = await snapshot_volume(pool, store, settings, vol, node_id=node_a, source=src, work_dir=work,
                                  reason="cadence")
    ids = [r["id"] for r in await pool.fetch("SELECT id FROM volume_snapshots WHERE volume_id=$1"
                                             " ORDER BY taken_at", vol)]
    assert ids == [second.snapshot_id, third.snapshot_id]
    assert await pool.fetchval("SELECT count(*) FROM volume_snapshot_chunks WHERE snapshot_id=$1",
                               first.snapshot_id) == 0

    # Garbage collection keeps every chunk a volume snapshot references.
    await collect_garbage(pool, store, 0.0)
    again = volume_path(settings.data_dir, node_b, vol)
    again.unlink()
    await fetch_volume(pool, store, settings, vol, again)
    assert _digest(again) == _digest(src)


async def test_nothing_promoted_or_no_file_is_refused(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings) -> None:
    node = new_id("node")
    vol = await _volume(pool, node, 4 * MIB)
    with pytest.raises(NotFound):
        await fetch_volume(pool, store, settings, vol, settings.data_dir / "x.img")
    src = volume_path(settings.data_dir, node, vol)
    with pytest.raises(NotFound):
        await snapshot_volume(pool, store, settings, vol, node_id=node, source=src,
                              work_dir=volume_snapshots_dir(settings.data_dir, node), reason="cadence")
    src.parent.mkdir(parents=True)
    with open(src, "wb") as f:
        f.truncate(4 * MIB)
    _write(src, 0, b"x", MIB)
    snap = await snapshot_volume(pool, store, settings, vol, node_id=node, source=src,
                                 work_dir=volume_snapshots_dir(settings.data_dir, node), reason="cadence")
    assert await pool.fetchval("SELECT snapshot_id FROM volumes WHERE id=$1", vol) == snap.snapshot_id


class _NoRelay:
    def kick(self) -> None:
        pass


async def test_the_snapshotter_promotes_changed_volumes_of_its_node_once_per_period(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings) -> None:
    from podbay_snapshotter.main import Snapshotter

    node = new_id("node")
    s = settings.model_copy(update={"node_id": node, "volume_promote_interval_s": 300.0})
    vol = await _volume(pool, node, 8 * MIB)
    elsewhere = await _volume(pool, new_id("node"), 8 * MIB)  # another node's: not this snapshotter's
    for v, n in ((vol, node), (elsewhere, node)):
        path = volume_path(settings.data_dir, n, v)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(8 * MIB)
        _write(path, 0, v.encode(), MIB)
    snapshotter = Snapshotter(s, pool, None, store, _NoRelay())  # type: ignore[arg-type]
    assert await snapshotter.volume_cadence_once() == 1
    assert await pool.fetchval("SELECT reason FROM volume_snapshots WHERE volume_id=$1", vol) == "cadence"
    assert await pool.fetchval("SELECT count(*) FROM volume_snapshots WHERE volume_id=$1", elsewhere) == 0
    assert await snapshotter.volume_cadence_once() == 0  # promoted within the period
    # A period later: promoted again only when the file changed since its newest copy.
    await pool.execute("UPDATE volumes SET snapshot_at = now() - interval '1 hour' WHERE id=$1", vol)
    os.utime(volume_path(settings.data_dir, node, vol), (1, 1))
    assert await snapshotter.volume_cadence_once() == 0
    _write(volume_path(settings.data_dir, node, vol), MIB, b"more", MIB)
    assert await snapshotter.volume_cadence_once() == 1
    assert await pool.fetchval("SELECT count(*) FROM volume_snapshots WHERE volume_id=$1 AND state='promoted'",
                               vol) == 2


async def test_a_restored_volume_is_rebuilt_from_its_stale_file_and_the_stale_file_is_never_promoted(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings) -> None:
    # What POST /v1/volumes/{name}/restore records (services/api/services/volume_service.py), then what its node does.
    node = new_id("node")
    size = 32 * MIB
    vol = await _volume(pool, node, size)
    src = volume_path(settings.data_dir, node, vol)
    src.parent.mkdir(parents=True)
    with open(src, "wb") as f:
        f.truncate(size)
    work = volume_snapshots_dir(settings.data_dir, node)
    _write(src, 0, b"restore-one", 2 * MIB)
    first = await snapshot_volume(pool, store, settings, vol, node_id=node, source=src, work_dir=work,
                                  reason="cadence")
    as_first = _digest(src)
    _write(src, 8 * MIB, b"restore-two", MIB)
    _write(src, 0, b"restore-three", 256 << 10)
    second = await snapshot_volume(pool, store, settings, vol, node_id=node, source=src, work_dir=work,
                                   reason="cadence")
    os.utime(src)  # written after the second copy, as a guest would
    await pool.execute("UPDATE volumes SET snapshot_id=$2, snapshot_at=$3, released_at=now() WHERE id=$1",
                       vol, first.snapshot_id, first.taken_at)

    # The file here is stale now: the cadence never promotes it, whatever the period.
    assert vol not in await due_volumes(pool, settings.data_dir, node, 0)
    # A copy taken before the restore committed (here: released_at in its future) does not become current.
    await pool.execute("UPDATE volumes SET released_at = now() + interval '1 hour' WHERE id=$1", vol)
    late = await snapshot_volume(pool, store, settings, vol, node_id=node, source=src, work_dir=work,
                                 reason="cadence")
    assert late.snapshot_id != second.snapshot_id
    assert await pool.fetchval("SELECT snapshot_id FROM volumes WHERE id=$1", vol) == first.snapshot_id

    # Rebuilt from the stale file as its base: the first snapshot's bytes, and only the one data chunk that
    # differs is downloaded (the other changed region is zeros in the first snapshot: no download).
    res = await fetch_volume(pool, store, settings, vol, src, base=src)
    assert _digest(src) == as_first
    assert res.chunks_downloaded == 1
    assert not any(p.name.startswith((".base-", ".fetch-")) for p in src.parent.iterdir())


async def test_a_fork_copy_volume_with_a_promoted_snapshot_is_fetched_not_copied_from_its_fork_again(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings) -> None:
    # A fork's copy volume (volumes.origin) written, suspended (promoted, released), then attached again on a
    # node that still has the fork's copy: its promoted snapshot wins, so the writes since the fork are kept.
    from podbay_nodeagent.storage.volumes import VolumeStore

    node = new_id("node")
    size = 4 * MIB
    vol = await _volume(pool, node, size)
    tenant = await pool.fetchval("SELECT tenant_id FROM volumes WHERE id=$1", vol)
    store_dir = volume_path(settings.data_dir, node, vol).parent.parent
    origin = store_dir / "snapshots" / "sbx_parent" / "snap_fork" / "vol0.img"
    origin.parent.mkdir(parents=True)
    with open(origin, "wb") as f:
        f.truncate(size)
    _write(origin, 0, b"at-the-fork", MIB)
    await pool.execute("UPDATE volumes SET origin=$2 WHERE id=$1", vol, str(origin.relative_to(store_dir)))
    sid, tpl = new_id("sbx"), new_id("tpl")
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'd', 256, 1)", tpl)
    await pool.execute("INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state,"
                       " memory_mib, vcpus, hostname) VALUES ($1,$2,$3,'d','running','running',256,1,'h')",
                       sid, tenant, tpl)
    await pool.execute("INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly)"
                       " VALUES ($1,$2,0,'/data',false)", sid, vol)
    vs = VolumeStore(store_dir / "volumes", pool, node, objects=store, settings=settings)
    await vs.prepare(sid)  # first attach: the fork's copy
    src = vs.path(vol)
    assert _digest(src) == _digest(origin)
    _write(src, 0, b"after-the-fork", MIB)
    written = _digest(src)
    assert await vs.promote_for_suspend(sid) is None
    await vs.release_after_suspend(sid)
    assert not src.exists()
    await vs.prepare(sid)  # the wake, on a node that still has the fork's copy
    assert _digest(src) == written
