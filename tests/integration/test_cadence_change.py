"""Snapshot and promotion work follows change (services/nodeagent/storage/snapshots.py ``unchanged``, libs/podbay/promotion.py
chunk-hash reuse) against real PostgreSQL and S3, on a real loop-mounted btrfs: an unchanged sandbox needs no
snapshot and an unchanged snapshot promotes no bytes; a changed one hashes and uploads only what changed."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import asyncpg
import pytest

from podbay.chunks import chunk_file
from podbay.config import Settings
from podbay.devstack.servers import S3Endpoint
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import new_id
from podbay.promotion import fetch, promote
from podbay.reflink import reflink_or_copy
from podbay_nodeagent.storage.snapshots import SnapshotOps
from tests.btrfs_loop import btrfs_dir

pytestmark = pytest.mark.integration

MIB = 1 << 20
CS = 256 << 10


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with btrfs_dir(tmp_path, 512) as d:
        yield d


@pytest.fixture
def settings(s3: S3Endpoint, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    return Settings(s3_url=s3.url, s3_bucket=s3.bucket, pg_dsn=pg_dsn, chunk_size_kib=CS >> 10)


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[ObjectStore]:
    async with open_store(settings) as st:
        await st.ensure_bucket()
        yield st


async def _sandbox(pool: asyncpg.Pool) -> tuple[str, str, str]:
    tenant, sandbox, node = new_id("tnt"), new_id("sbx"), f"chg-{new_id('n')[-8:].lower()}"
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('chg-test', 'd1', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1,'x',1,1,'tcg')",
                       node)
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, node_id) VALUES ($1,$2,'chg-test','d1','running','running',256,1,'h',$3)", sandbox, tenant, node)
    return tenant, sandbox, node


async def _snapshot(pool: asyncpg.Pool, tenant: str, sandbox: str, node: str, kind: str = "disk") -> str:
    snap = new_id("snap")
    await pool.execute("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, generation)"
                       " VALUES ($1,$2,$3,$4,$5,'ready',1)", snap, tenant, sandbox, node, kind)
    return snap


def _write(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


async def test_promotion_hashes_and_uploads_only_changed_chunks(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, fs: Path, tmp_path: Path) -> None:
    tenant, sandbox, node = await _sandbox(pool)
    disk = fs / "disk.img"  # the sandbox's live disk: 128 MiB, 32 MiB written
    with open(disk, "wb") as f:
        f.truncate(128 * MIB)
        f.seek(16 * MIB)
        f.write(os.urandom(32 * MIB))
    snaps = fs / "snapshots" / sandbox
    ids = []
    for _ in range(3):
        ids.append(await _snapshot(pool, tenant, sandbox, node))
    a, b, c = ids
    (snaps / a).mkdir(parents=True)
    reflink_or_copy(disk, snaps / a / "disk.img")
    r1 = await promote(pool, store, settings, a, snaps / a)
    assert r1.hashed_bytes == 32 * MIB and r1.reused_bytes == 0  # nothing to compare with: all data hashed

    _write(disk, 20 * MIB + 100, os.urandom(MIB))  # 1 MiB written: 5 chunks of 256 KiB touched
    (snaps / b).mkdir()
    reflink_or_copy(disk, snaps / b / "disk.img")
    r2 = await promote(pool, store, settings, b, snaps / b)
    assert r2.hashed_bytes == 5 * CS and r2.reused_bytes == 128 * MIB - 5 * CS
    assert r2.chunks_uploaded == 5 and r2.uploaded_bytes == 5 * CS
    manifest = await pool.fetchval("SELECT manifest FROM snapshots WHERE id=$1", b)
    assert manifest["files"][0]["chunks"] == [r.hash for r in chunk_file(snaps / b / "disk.img", CS)]

    (snaps / c).mkdir()  # no change since b
    reflink_or_copy(disk, snaps / c / "disk.img")
    r3 = await promote(pool, store, settings, c, snaps / c)
    assert r3.hashed_bytes == 0 and r3.uploaded_bytes == 0 and r3.chunks_uploaded == 0
    assert await pool.fetchval("SELECT promotion FROM snapshots WHERE id=$1", c) == "promoted"

    # What was promoted with reused hashes restores byte for byte.
    await fetch(pool, store, settings, b, tmp_path / "restored")
    assert (tmp_path / "restored" / "disk.img").read_bytes() == (snaps / b / "disk.img").read_bytes()


async def test_unchanged_compares_with_the_last_snapshot_or_else_the_template(pool: asyncpg.Pool, fs: Path) -> None:
    tenant, sandbox, node = await _sandbox(pool)
    tpl = fs / "templates" / "chg-test" / "d1"
    tpl.mkdir(parents=True)
    for name, size in (("disk.img", 64 * MIB), ("ram", 32 * MIB)):
        with open(tpl / name, "wb") as f:
            f.write(os.urandom(4 * MIB))
            f.truncate(size)
    vm_dir = fs / "vm"
    vm_dir.mkdir()
    reflink_or_copy(tpl / "disk.img", vm_dir / "disk.img")  # restored from the template snapshot
    reflink_or_copy(tpl / "ram", vm_dir / "ram")
    paths = SimpleNamespace(disk=vm_dir / "disk.img", ram=vm_dir / "ram")
    host = SimpleNamespace(
        pool=pool, node_id=node,
        vms={sandbox: SimpleNamespace(generation=1, handle=SimpleNamespace(process=SimpleNamespace(paths=paths)))},
        store=SimpleNamespace(template_dir=lambda name, digest: fs / "templates" / name / digest,
                              snapshot_dir=lambda sid, snap: fs / "snapshots" / sid / snap))
    ops = SnapshotOps(host)  # type: ignore[arg-type]

    # Nothing recorded, but the files are still the template's: no first snapshot.
    assert await ops.unchanged(sandbox, "disk") and await ops.unchanged(sandbox, "full")
    _write(paths.ram, MIB, b"guest memory")  # the guest wrote some RAM (through the shared mapping)
    assert await ops.unchanged(sandbox, "disk") and not await ops.unchanged(sandbox, "full")

    full = await _snapshot(pool, tenant, sandbox, node, "full")  # a full snapshot: reflinks of both
    (fs / "snapshots" / sandbox / full).mkdir(parents=True)
    reflink_or_copy(paths.disk, fs / "snapshots" / sandbox / full / "disk.img")
    reflink_or_copy(paths.ram, fs / "snapshots" / sandbox / full / "ram")
    assert await ops.unchanged(sandbox, "full") and await ops.unchanged(sandbox, "disk")

    _write(paths.disk, 10 * MIB, b"a file")  # the guest wrote its disk
    assert not await ops.unchanged(sandbox, "disk") and not await ops.unchanged(sandbox, "full")
    disk_snap = await _snapshot(pool, tenant, sandbox, node, "disk")
    (fs / "snapshots" / sandbox / disk_snap).mkdir()
    reflink_or_copy(paths.disk, fs / "snapshots" / sandbox / disk_snap / "disk.img")
    assert await ops.unchanged(sandbox, "disk")  # against the newest disk snapshot
    assert not await ops.unchanged(sandbox, "full")  # a full one compares with the newest full one

    # A write that a full snapshot caught first still takes a disk snapshot: the cadence promotes disk
    # snapshots, so the write must reach one to be in object storage within the promotion interval.
    _write(paths.disk, 12 * MIB, b"another file")
    full2 = await _snapshot(pool, tenant, sandbox, node, "full")
    (fs / "snapshots" / sandbox / full2).mkdir()
    reflink_or_copy(paths.disk, fs / "snapshots" / sandbox / full2 / "disk.img")
    reflink_or_copy(paths.ram, fs / "snapshots" / sandbox / full2 / "ram")
    assert await ops.unchanged(sandbox, "full") and not await ops.unchanged(sandbox, "disk")

    # A frozen disk snapshot's thaw rewrites the superblock (block 0): that alone does not count as a change.
    _write(paths.disk, 14 * MIB, b"more")
    thawed = await _snapshot(pool, tenant, sandbox, node, "disk")
    (fs / "snapshots" / sandbox / thawed).mkdir()
    reflink_or_copy(paths.disk, fs / "snapshots" / sandbox / thawed / "disk.img")
    _write(paths.disk, 1024, b"needs_recovery")  # what ext4_unfreeze writes
    assert not await ops.unchanged(sandbox, "disk")  # without the note: block 0 differs
    ops._note_thaw(sandbox, thawed, paths.disk, fs / "snapshots" / sandbox / thawed / "disk.img")  # noqa: SLF001
    assert await ops.unchanged(sandbox, "disk")
    _write(paths.disk, 1024, b"superblock again")  # block 0 written again later: a change after all
    assert not await ops.unchanged(sandbox, "disk")
    _write(paths.disk, 15 * MIB, b"a write right after the thaw")  # beyond block 0: nothing noted
    ops._note_thaw(sandbox, thawed, paths.disk, fs / "snapshots" / sandbox / thawed / "disk.img")  # noqa: SLF001
    assert not await ops.unchanged(sandbox, "disk")

    # A snapshot of an earlier generation (before a rollback) is no baseline; nor is a missing file.
    host.vms[sandbox].generation = 2
    assert not await ops.unchanged(sandbox, "disk")
    assert not await ops.unchanged("sbx_unknown", "disk")
