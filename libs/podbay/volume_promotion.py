"""Volume snapshots promoted to object storage, and their fetch on another node (docs/ARCHITECTURE.md "Volumes").

A volume (``volumes`` row; its file ``store/volumes/<id>.img`` on its node) has snapshots of its own, apart
from its sandboxes' (a sandbox's rollback leaves its volumes as they are). A snapshot is a reflink of the
volume's file into ``store/volume-snapshots/<volume>/<snapshot>/volume.img``, promoted through the same
content-addressed chunk store as sandbox snapshots (:mod:`podbay.promotion`): chunks the bucket already has
are not sent again, every object written is read back before its ``chunks`` row, and only then does one
transaction mark the ``volume_snapshots`` row ``promoted`` and point ``volumes.snapshot_id`` at it (unless a
newer copy got there first). The local copy is removed afterwards: the volume's own file stays the truth
on its node.

When it is taken:

- on a cadence (``volume_promote_interval_s``, the snapshotter): a volume of the node whose file changed
  since its newest promoted snapshot. The copy is crash-consistent (what the guest had written to its device
  at that moment, as after a power cut; ext4's journal makes it mountable), so a lost node loses at most one
  period of a volume's writes, plus what the guest's page cache still held;
- on suspend (the node agent), while the guest is stopped: consistent with the memory snapshot, so the
  sandbox can wake on any node with the volume fetched there.

:func:`fetch_volume` rebuilds the newest promoted snapshot into a volume's file on a node that lacks it (every
chunk checked against its SHA-256; zero chunks stay holes). Errors: ``NotFound`` (nothing promoted),
``SnapshotCorrupt`` (a missing or corrupt object), ``StorageError`` (object store; retryable).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from podbay import volume_state
from podbay.chunks import Manifest
from podbay.config import Settings
from podbay.errors import NotFound, PodbayError
from podbay.naming import safe_component
from podbay.objstore import ObjectStore
from podbay.outbox import new_id
from podbay.promotion import FetchResult, PromoteResult, _fetch_manifest, _upload_missing, build_manifest
from podbay.reflink import reflink_or_copy

__all__ = [
    "VOLUME_FILE",
    "VolumeSnapshot",
    "volume_path",
    "volume_snapshots_dir",
    "snapshot_volume",
    "fetch_volume",
    "due_volumes",
    "fail_interrupted",
]

log = logging.getLogger("podbay.volume_promotion")

VOLUME_FILE = "volume.img"
"""The one file of a volume snapshot."""


@dataclass
class VolumeSnapshot:
    """A promoted volume snapshot: its id, when its copy was taken, and the promotion's figures."""

    snapshot_id: str
    volume_id: str
    taken_at: datetime
    result: PromoteResult


def _store(data_dir: Path, node_id: str) -> Path:
    return data_dir / "nodes" / safe_component(node_id, "node id") / "store"


def volume_path(data_dir: Path, node_id: str, volume_id: str) -> Path:
    """A volume's file on a node: ``DATA_DIR/nodes/<node>/store/volumes/<volume>.img``."""
    return _store(data_dir, node_id) / "volumes" / f"{safe_component(volume_id, 'volume id')}.img"


def volume_snapshots_dir(data_dir: Path, node_id: str) -> Path:
    """Where a node puts a volume's snapshot while it is promoted: ``store/volume-snapshots``."""
    return _store(data_dir, node_id) / "volume-snapshots"


async def snapshot_volume(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, volume_id: str, *,
                          node_id: str, source: Path, work_dir: Path, reason: str) -> VolumeSnapshot:
    """Reflink ``source`` (the volume's file, or a slot file standing for it) into ``work_dir``, promote the copy
    as a new ``volume_snapshots`` row, point the volume at it when it is the newest, keep the newest
    ``retain_volume_snapshots``, and remove the local copy. ``reason``: ``cadence`` or ``suspend``.

    Raises ``NotFound`` (no such volume or file), ``StorageError`` (retryable), ``SnapshotCorrupt``; the row is
    then ``failed`` with the error, and garbage collection drops its chunk references."""
    if not source.exists():
        raise NotFound(f"volume {volume_id} has no file at {source.name} on node {node_id}")
    snap_id = new_id("vsnap")
    snap_dir = work_dir / safe_component(volume_id, "volume id") / snap_id
    await asyncio.to_thread(snap_dir.mkdir, parents=True, exist_ok=True)
    taken_at = datetime.now(UTC)
    t0 = time.perf_counter()
    await asyncio.to_thread(reflink_or_copy, source, snap_dir / VOLUME_FILE)
    res = PromoteResult(snap_id)
    try:
        inserted = await pool.fetchval(
            "INSERT INTO volume_snapshots (id, volume_id, node_id, reason, state, taken_at)"
            " SELECT $1, id, $3, $4, 'promoting', $5 FROM volumes WHERE id=$2 RETURNING id",
            snap_id, volume_id, node_id, reason, taken_at)
        if inserted is None:
            raise NotFound(f"volume {volume_id} does not exist")
        try:
            await _promote(pool, store, settings, volume_id, snap_id, snap_dir, taken_at, res)
        except BaseException as exc:
            why = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
            await asyncio.shield(pool.execute(
                "UPDATE volume_snapshots SET state='failed', error=$2 WHERE id=$1 AND state='promoting'",
                snap_id, why[:2000]))
            raise
    finally:
        await asyncio.to_thread(shutil.rmtree, snap_dir, True)
    res.seconds = time.perf_counter() - t0
    log.info("volume %s: snapshot %s (%s) promoted: %d chunks, %d uploaded (%.1f MiB of %.1f MiB) in %.1f s",
             volume_id, snap_id, reason, res.chunks, res.chunks_uploaded, res.uploaded_bytes / 2**20,
             res.total_bytes / 2**20, res.seconds)
    return VolumeSnapshot(snap_id, volume_id, taken_at, res)


async def _promote(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, volume_id: str, snap_id: str,
                   snap_dir: Path, taken_at: datetime, res: PromoteResult) -> None:
    """Steps 1-3 of :mod:`podbay.promotion`'s promotion for one volume snapshot, then the volume's pointer and
    retention in the transaction that marks it promoted."""
    manifest, where = await asyncio.to_thread(build_manifest, snap_dir, settings.chunk_size_kib << 10,
                                              (VOLUME_FILE,))
    hashes = sorted(manifest.hashes())
    res.total_bytes, res.chunks = manifest.total_bytes(), len(hashes)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("UPDATE volume_snapshots SET manifest=$2, total_bytes=$3 WHERE id=$1",
                           snap_id, manifest.model_dump(), res.total_bytes)
        await conn.execute("INSERT INTO volume_snapshot_chunks (snapshot_id, hash) SELECT $1, unnest($2::text[])",
                           snap_id, hashes)
        await conn.execute("UPDATE chunks SET last_ref_at=now() WHERE hash = ANY($1::text[])", hashes)
    await _upload_missing(pool, store, settings, hashes, where, res, f"volume snapshot {snap_id}", None)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE volume_snapshots SET state='promoted', promoted_at=now(), uploaded_bytes=$2, stored_bytes=$3"
            " WHERE id=$1", snap_id, res.uploaded_bytes, res.stored_bytes)
        # A later copy (a suspend racing the cadence) may have got there first: the newest copy wins. A copy
        # taken before the volume was released or restored (released_at) is of data that is no longer its.
        await volume_state.record_snapshot(conn, volume_id, snap_id, taken_at)
        await conn.execute(
            "DELETE FROM volume_snapshots WHERE volume_id=$1 AND id NOT IN (SELECT id FROM volume_snapshots"
            " WHERE volume_id=$1 AND state='promoted' ORDER BY taken_at DESC LIMIT $2)"
            " AND id <> (SELECT coalesce(snapshot_id, '') FROM volumes WHERE id=$1) AND state <> 'promoting'",
            volume_id, settings.retain_volume_snapshots)


async def fetch_volume(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, volume_id: str,
                       dest: Path, *, base: Path | None = None) -> FetchResult:
    """Rebuild the volume's current promoted snapshot (``volumes.snapshot_id``: the newest, or the one a
    restore chose) as its file ``dest`` (it appears only when complete). ``base``: an older file of the volume
    on this node; the rebuild starts from a reflink of it and downloads only the chunks that differ (a restore
    on the node that holds the volume). Raises ``NotFound`` (nothing promoted), ``SnapshotCorrupt``,
    ``StorageError``."""
    row = await pool.fetchrow(
        "SELECT s.id, s.manifest FROM volumes v JOIN volume_snapshots s ON s.id = v.snapshot_id"
        " WHERE v.id=$1 AND s.state='promoted'", volume_id)
    if row is None:
        raise NotFound(f"volume {volume_id} has no promoted snapshot")
    manifest = Manifest.model_validate(row["manifest"])
    tmp = dest.with_name(f".fetch-{dest.name}")
    base_dir = None
    if base is not None and base.exists():
        # _fetch_manifest reads a base under the snapshot's file name: a hard link gives it one, no copy.
        base_dir = dest.with_name(f".base-{dest.name}")
        await asyncio.to_thread(shutil.rmtree, base_dir, True)
        base_dir.mkdir(parents=True)
        os.link(base, base_dir / VOLUME_FILE)
    try:
        res = await _fetch_manifest(store, settings, manifest, row["id"], f"volume {volume_id}", tmp,
                                    base_dir=base_dir, names=(VOLUME_FILE,), local=None, progress=None)
        os.replace(tmp / VOLUME_FILE, dest)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        if base_dir is not None:
            await asyncio.to_thread(shutil.rmtree, base_dir, True)
    return res


async def due_volumes(pool: asyncpg.Pool, data_dir: Path, node_id: str, interval_s: float) -> list[str]:
    """Volumes of ``node_id`` due for a cadence snapshot: the file is here, no snapshot of it is being
    promoted, and it changed (mtime) since the newest promoted copy, which is older than ``interval_s``
    (or there is none). Views of fork children are never promoted (they are dropped with their sandbox), nor
    is a file older than the volume's release or restore (``released_at``: stale, rebuilt at its next attach)."""
    rows = await pool.fetch(
        "SELECT v.id, v.snapshot_at, v.released_at FROM volumes v WHERE v.node_id=$1 AND v.state='available'"
        " AND (v.snapshot_at IS NULL OR v.snapshot_at < now() - make_interval(secs => $2))"
        " AND NOT EXISTS (SELECT 1 FROM volume_snapshots s WHERE s.volume_id = v.id AND s.state = 'promoting')"
        " ORDER BY v.snapshot_at NULLS FIRST", node_id, float(interval_s))
    out: list[str] = []
    for r in rows:
        try:
            mtime = volume_path(data_dir, node_id, r["id"]).stat().st_mtime
        except FileNotFoundError:
            continue
        if r["released_at"] is not None and mtime < r["released_at"].timestamp():
            continue
        if r["snapshot_at"] is None or mtime > r["snapshot_at"].timestamp():
            out.append(r["id"])
    return out


async def fail_interrupted(pool: asyncpg.Pool, node_id: str) -> int:
    """Mark this node's volume snapshots left ``promoting`` by a crash ``failed`` (their local copies went
    with the process's work; garbage collection drops their chunk references). Returns how many."""
    return int((await pool.execute(
        "UPDATE volume_snapshots SET state='failed', error='interrupted' WHERE node_id=$1 AND state='promoting'",
        node_id)).split()[-1])
