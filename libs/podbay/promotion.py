"""Promotion of snapshots to object storage, fetch for restore, and garbage collection (docs/DESIGN.md §5).

Used by the snapshotter (``promote``, ``collect_garbage``) and the node agent (``fetch``).

Promotion of snapshot S (idempotent; a crash at any step is finished by running it again):

1. Hash every file of S into chunks (:mod:`podbay.chunks`) and record the manifest in PostgreSQL with
   ``promotion = 'promoting'`` and one ``snapshot_chunks`` row per chunk, in one transaction. From then on
   garbage collection keeps every chunk S references.
2. Upload the chunks the bucket lacks (``chunks`` rows, read ``FOR SHARE`` so a collection deleting one at
   that moment finishes first and the chunk is uploaded again), compressed, at most ``s3_concurrency``
   at a time; each upload is followed by its ``chunks`` row.
3. Verify every object this promotion wrote (it exists with the size sent) and only then write its
   ``chunks`` row, so a row means "stored and verified"; then one transaction marks S ``promoted`` with
   its event. Nothing may rely on S before that.

Fetch rebuilds a promoted snapshot's files in ``<dest>.part`` (renamed when complete): a file that a local
base (the template's snapshot) has with the same size is reflinked from it first and only the chunks that
differ are written; every downloaded chunk is decompressed and checked against its SHA-256, so a corrupt or
missing object raises :class:`~podbay.errors.SnapshotCorrupt` and nothing is restored silently.

Garbage collection deletes chunks that no live snapshot (of a sandbox, a template or a volume,
:mod:`podbay.volume_promotion`) references once they have been unreferenced for
``gc_grace_s``, and objects without a ``chunks`` row (left by an upload whose process died) older than that.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
from prometheus_client import Histogram

from podbay.contracts.events import EventType
from podbay.chunks import (
    ChunkRef,
    FileManifest,
    Manifest,
    chunk_file,
    chunk_key,
    compress,
    decompress_verified,
    file_checksum,
    read_chunk,
    zero_hash,
)
from podbay.config import Settings
from podbay.errors import NotFound, PodbayError, SnapshotCorrupt
from podbay.faults import fault_point
from podbay.naming import safe_component
from podbay.objstore import ObjectStore
from podbay.outbox import emit_sandbox_event
from podbay.reflink import reflink_or_copy
from podbay.telemetry import CADENCE_SKIPPED, CADENCE_WORK_SECONDS, PROMOTION_BYTES
from podbay import snapshot_state

__all__ = [
    "PromoteResult",
    "FetchResult",
    "GcResult",
    "SNAPSHOT_FILES",
    "snapshot_path",
    "build_manifest",
    "known_hashes",
    "promote",
    "fetch",
    "collect_garbage",
    "TEMPLATE_FILES",
    "promote_template",
    "template_root",
    "fetch_template",
    "chunk_index",
    "local_chunks",
]

log = logging.getLogger("podbay.promotion")

SNAPSHOT_FILES = ("state", "ram", "disk.img")
"""Files a snapshot directory may hold (a disk snapshot has only ``disk.img``)."""
TEMPLATE_FILES = ("template.json", "state", "ram", "disk.img", "vmlinuz", "initrd.img")
"""Files of a built template's directory (its snapshot, its kernel and its ``template.json``)."""

_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_BYTES_BUCKETS = tuple(float(1 << n) for n in range(16, 36, 2))
PROMOTION_SECONDS = Histogram("podbay_promotion_seconds", "Time to promote one snapshot to object storage.",
                              ["outcome"], buckets=_SECONDS_BUCKETS)
FETCH_SECONDS = Histogram("podbay_snapshot_fetch_seconds", "Time to fetch one promoted snapshot for a restore.",
                          ["outcome"], buckets=_SECONDS_BUCKETS)
TRANSFER_BYTES = Histogram("podbay_object_transfer_bytes", "Bytes sent to (up) or read from (down) object "
                           "storage per promotion or fetch (compressed, as on the wire).", ["direction"],
                           buckets=_BYTES_BUCKETS)
TRANSFER_SECONDS = Histogram("podbay_object_transfer_seconds", "Time spent moving chunks to (up) or from (down) "
                             "object storage per promotion or fetch (hashing and verification excluded).",
                             ["direction"], buckets=_SECONDS_BUCKETS)
CHUNK_REUSE_RATIO = Histogram("podbay_chunk_reuse_ratio", "Share of a snapshot's chunks not transferred "
                              "(already stored, or already on the node), per promotion or fetch.", ["op"],
                              buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0))

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``: called as chunks are handled."""


def snapshot_path(data_dir: Path, node_id: str, sandbox_id: str, snapshot_id: str) -> Path:
    """Where a node keeps a snapshot's files: ``DATA_DIR/nodes/<node>/store/snapshots/<sandbox>/<snapshot>``."""
    return (data_dir / "nodes" / safe_component(node_id, "node id") / "store" / "snapshots"
            / safe_component(sandbox_id, "sandbox id") / safe_component(snapshot_id, "snapshot id"))


@dataclass
class PromoteResult:
    """Outcome of one promotion: sizes in bytes (``uploaded_bytes`` uncompressed, ``stored_bytes`` as sent)."""

    snapshot_id: str
    total_bytes: int = 0
    chunks: int = 0
    chunks_uploaded: int = 0
    uploaded_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    hash_seconds: float = 0.0
    upload_seconds: float = 0.0
    verify_seconds: float = 0.0
    hashed_bytes: int = 0
    reused_bytes: int = 0
    already: bool = False


@dataclass
class FetchResult:
    """Outcome of one fetch: chunks downloaded vs reused (from a local base, or repeated in the snapshot)."""

    snapshot_id: str
    total_bytes: int = 0
    chunks: int = 0
    chunks_downloaded: int = 0
    downloaded_bytes: int = 0
    seconds: float = 0.0
    download_seconds: float = 0.0


@dataclass
class GcResult:
    chunks_deleted: int = 0
    orphans_deleted: int = 0
    refs_dropped: int = 0
    deleted_hashes: list[str] = field(default_factory=list)


def known_hashes(path: Path, previous: Path, prev: FileManifest, chunk_size: int) -> list[str | None] | None:
    """Per chunk of ``path``, the hash ``prev`` (the manifest entry of ``previous``, an earlier promoted
    snapshot's file of the same name) gives it when its bytes are certainly those of ``previous`` there: the
    chunk's extents are the very blocks of ``previous``'s (both reflinks of one disk, :mod:`podbay.extents`),
    or holes in both; None for the chunks to hash. None when nothing can be reused (sizes differ, another
    filesystem, no FIEMAP). Blocking."""
    from podbay.extents import fiemap, unchanged_ranges

    try:
        sc, sp = path.stat(), previous.stat()
        if sc.st_size != prev.size or sp.st_size != prev.size or sc.st_dev != sp.st_dev:
            return None
        # FIEMAP_FLAG_SYNC on both: a range written but not yet written back still maps to its old blocks.
        same = unchanged_ranges(fiemap(path), fiemap(previous), prev.size, chunk_size)
    except OSError:
        return None
    if len(same) != len(prev.chunks):
        return None
    return [h if ok else None for h, ok in zip(prev.chunks, same, strict=True)]


def build_manifest(snapshot_dir: Path, chunk_size: int, names: Iterable[str] = SNAPSHOT_FILES, *,
                   previous: tuple[Path, Manifest] | None = None, stats: dict[str, int] | None = None,
                   ) -> tuple[Manifest, dict[str, tuple[Path, ChunkRef]]]:
    """Hash the files ``names`` of ``snapshot_dir`` that exist (blocking). Returns the manifest and, per distinct
    hash, where to read it. ``previous``: an earlier promoted snapshot's directory and manifest, whose chunk
    hashes are reused for chunks whose extents it shares (:func:`known_hashes`), so only changed chunks are
    read. ``stats``: ``hashed`` and ``reused`` bytes are added to it."""
    files: list[FileManifest] = []
    where: dict[str, tuple[Path, ChunkRef]] = {}
    prev_files = {f.name: f for f in previous[1].files} if previous and previous[1].chunk_size == chunk_size else {}
    for name in names:
        path = snapshot_dir / name
        if not path.exists():
            continue
        known = None
        if previous is not None and name in prev_files:
            known = known_hashes(path, previous[0] / name, prev_files[name], chunk_size)
        refs = chunk_file(path, chunk_size, known, stats)
        hashes = [r.hash for r in refs]
        files.append(FileManifest(name=name, size=path.stat().st_size, sha256=file_checksum(hashes), chunks=hashes))
        for r in refs:
            where.setdefault(r.hash, (path, r))
    if not files:
        raise NotFound(f"no snapshot files in {snapshot_dir.name}")
    return Manifest(chunk_size=chunk_size, files=files), where


async def _pool_map(items: Iterable[str], worker: Callable[[str], Awaitable[None]], n: int) -> None:
    """Run ``worker`` over ``items`` with ``n`` at a time; the first error cancels the rest and is raised."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)

    async def run() -> None:
        while True:
            try:
                it = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await worker(it)

    tasks = [asyncio.create_task(run()) for _ in range(max(1, n))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def promote(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, snapshot_id: str,
                  snapshot_dir: Path, *, progress: Progress | None = None) -> PromoteResult:
    """Promote ready snapshot ``snapshot_id`` whose files are in ``snapshot_dir`` (module docstring).

    Idempotent: a promoted snapshot returns at once (``already``); a half-promoted one is finished.
    Raises ``NotFound`` (no such snapshot or files), ``PodbayError`` (not ready), ``StorageError``
    (object store; retryable), ``SnapshotCorrupt`` (an object stays missing after re-upload)."""
    t0 = time.perf_counter()
    res = PromoteResult(snapshot_id)
    row = await pool.fetchrow("SELECT state, promotion, sandbox_id, tenant_id, kind, node_id FROM snapshots"
                              " WHERE id=$1", snapshot_id)
    if row is None:
        raise NotFound(f"snapshot {snapshot_id} does not exist")
    if row["promotion"] == "promoted":
        res.already = True
        return res
    if row["state"] != "ready":
        raise PodbayError(f"snapshot {snapshot_id} is {row['state']}, not ready")
    previous = await _previous_promoted(pool, snapshot_id, row["sandbox_id"], row["node_id"], snapshot_dir)
    stats: dict[str, int] = {}
    t = time.perf_counter()
    manifest, where = await asyncio.to_thread(build_manifest, snapshot_dir, settings.chunk_size_kib << 10,
                                              previous=previous, stats=stats)
    res.hash_seconds = time.perf_counter() - t
    res.hashed_bytes, res.reused_bytes = stats.get("hashed", 0), stats.get("reused", 0)
    PROMOTION_BYTES.labels("hashed").inc(res.hashed_bytes)
    PROMOTION_BYTES.labels("reused").inc(res.reused_bytes)
    CADENCE_WORK_SECONDS.labels("promotion").inc(res.hash_seconds)
    hashes = sorted(manifest.hashes())
    res.total_bytes, res.chunks = manifest.total_bytes(), len(hashes)
    async with pool.acquire() as conn, conn.transaction():
        updated = await snapshot_state.start_promotion(conn, snapshot_id, manifest.model_dump())
        if updated is None:
            raise PodbayError(f"snapshot {snapshot_id} changed while being promoted")
        await conn.execute("DELETE FROM snapshot_chunks WHERE snapshot_id=$1", snapshot_id)
        await conn.execute("INSERT INTO snapshot_chunks (snapshot_id, hash) SELECT $1, unnest($2::text[])",
                           snapshot_id, hashes)
        await conn.execute("UPDATE chunks SET last_ref_at=now() WHERE hash = ANY($1::text[])", hashes)
    fault_point("promote.manifest")
    await _upload_missing(pool, store, settings, hashes, where, res, f"snapshot {snapshot_id}", progress)
    fault_point("promote.verified")
    async with pool.acquire() as conn, conn.transaction():
        marked = await snapshot_state.mark_promoted(conn, snapshot_id, uploaded_bytes=res.uploaded_bytes,
                                                    stored_bytes=res.stored_bytes)
        if marked:
            await emit_sandbox_event(conn, row["sandbox_id"], EventType.PROMOTED, tenant_id=row["tenant_id"],
                                     data={"snapshot_id": snapshot_id, "kind": row["kind"],
                                           "uploaded_bytes": res.uploaded_bytes, "total_bytes": res.total_bytes})
    res.seconds = time.perf_counter() - t0
    PROMOTION_SECONDS.labels("ok").observe(res.seconds)
    PROMOTION_BYTES.labels("uploaded").inc(res.uploaded_bytes)
    CADENCE_WORK_SECONDS.labels("promotion").inc(res.seconds - res.hash_seconds)
    if res.hashed_bytes == 0 and res.uploaded_bytes == 0 and previous is not None:
        CADENCE_SKIPPED.labels("promotion").inc()  # recorded as equal to the previous promoted snapshot
    TRANSFER_BYTES.labels("up").observe(res.stored_bytes)
    TRANSFER_SECONDS.labels("up").observe(res.upload_seconds)
    CHUNK_REUSE_RATIO.labels("promote").observe(1 - res.chunks_uploaded / max(1, res.chunks))
    log.info("promoted %s: %d chunks, %d uploaded (%.1f MiB of %.1f MiB, %.1f MiB stored) in %.1f s (hash %.1f s,"
             " upload %.1f s, verify %.1f s)", snapshot_id, res.chunks, res.chunks_uploaded, res.uploaded_bytes / 2**20,
             res.total_bytes / 2**20, res.stored_bytes / 2**20, res.seconds, res.hash_seconds, res.upload_seconds,
             res.verify_seconds)
    return res


async def _previous_promoted(pool: asyncpg.Pool, snapshot_id: str, sandbox_id: str, node_id: str | None,
                             snapshot_dir: Path) -> tuple[Path, Manifest] | None:
    """The newest other promoted snapshot of the sandbox on the same node whose files are still beside
    ``snapshot_dir`` (retention keeps the newest promoted one): its directory and manifest, or None."""
    if node_id is None:
        return None
    prev = await pool.fetchrow(
        "SELECT id, manifest FROM snapshots WHERE sandbox_id=$1 AND node_id=$2 AND id <> $3 AND state='ready'"
        " AND promotion='promoted' AND manifest IS NOT NULL ORDER BY promoted_at DESC LIMIT 1",
        sandbox_id, node_id, snapshot_id)
    if prev is None:
        return None
    try:
        pdir = snapshot_dir.with_name(safe_component(prev["id"], "snapshot id"))
        manifest = Manifest.model_validate(prev["manifest"])
    except (PodbayError, ValueError):
        return None
    return (pdir, manifest) if pdir.is_dir() else None


async def _upload_missing(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, hashes: list[str],
                          where: dict[str, tuple[Path, ChunkRef]], res: PromoteResult, what: str,
                          progress: Progress | None) -> None:
    """Upload those of the chunks ``hashes`` that have no ``chunks`` row to the bucket (read from ``where``),
    verify each object written, then record their ``chunks`` rows (steps 2 and 3 of the module docstring).
    Adds to ``res``'s counters."""
    async with pool.acquire() as conn, conn.transaction():
        # FOR SHARE waits for a garbage collection that is deleting one of these rows right now.
        stored = {r["hash"]: r["stored_size"] for r in await conn.fetch(
            "SELECT hash, stored_size FROM chunks WHERE hash = ANY($1::text[]) FOR SHARE", hashes)}
    missing = [h for h in hashes if h not in stored]
    done = [0]

    fresh: list[tuple[str, int, int]] = []

    async def record(rows: list[tuple[str, int, int]]) -> None:
        # A row is written only after its object was read back, so a row means "stored and verified"; an
        # object whose row a crash lost is uploaded again by the retry, or deleted by garbage collection
        # after the grace period.
        batch = rows[:]
        rows.clear()
        if batch:
            await pool.executemany(
                "INSERT INTO chunks (hash, size, stored_size) VALUES ($1,$2,$3)"
                " ON CONFLICT (hash) DO UPDATE SET stored_size=EXCLUDED.stored_size, last_ref_at=now()", batch)

    async def upload(h: str) -> None:
        path, ref = where[h]
        data = await asyncio.to_thread(read_chunk, path, ref.offset, ref.size)
        if len(data) != ref.size:
            raise PodbayError(f"{path.name} changed while being promoted")
        blob = await asyncio.to_thread(compress, data, settings.compression_level)
        await store.put(chunk_key(h), blob)
        fresh.append((h, ref.size, len(blob)))
        stored[h] = len(blob)
        res.chunks_uploaded += 1
        res.uploaded_bytes += ref.size
        res.stored_bytes += len(blob)
        done[0] += ref.size
        if progress:
            progress(done[0], res.total_bytes)
        if res.chunks_uploaded == max(1, len(missing) // 2):
            fault_point("promote.uploading")

    t = time.perf_counter()
    await _pool_map(missing, upload, settings.s3_concurrency * 2)
    res.upload_seconds = time.perf_counter() - t
    fault_point("promote.uploaded")
    t = time.perf_counter()
    # Verify every object this promotion wrote (it exists with the size sent; one re-upload for any that does
    # not). The others have rows, written only after their own verification, and the manifest committed
    # above keeps garbage collection off them; a fetch checks every chunk's SHA-256 in any case.
    bad: list[str] = []

    async def verify(h: str) -> None:
        if await store.head(chunk_key(h)) != stored.get(h):
            bad.append(h)

    await _pool_map(missing, verify, settings.s3_concurrency * 2)
    if bad:
        log.warning("%s: %d object(s) missing or of the wrong size; uploading them again", what, len(bad))
        fresh[:] = [r for r in fresh if r[0] not in set(bad)]
        await _pool_map(list(bad), upload, settings.s3_concurrency)
        still = [h for h in bad if await store.head(chunk_key(h)) != stored.get(h)]
        if still:
            raise SnapshotCorrupt(f"{len(still)} object(s) of {what} fail verification",
                                  details={"chunks": still[:10]})
    await record(fresh)
    res.verify_seconds = time.perf_counter() - t


def chunk_index(base_dir: Path, chunk_size: int, names: tuple[str, ...] = SNAPSHOT_FILES) -> dict[str, list[str]]:
    """Chunk hashes of each file ``names`` in ``base_dir`` (a template's snapshot), cached beside them in
    ``.chunks-<size>.json`` (``.chunks-<size>-all.json`` for a template's files) keyed by file size and mtime.
    Blocking."""
    cache = base_dir / (f".chunks-{chunk_size}.json" if names == SNAPSHOT_FILES else f".chunks-{chunk_size}-all.json")
    stamp = {n: [p.stat().st_size, p.stat().st_mtime_ns] for n in names if (p := base_dir / n).exists()}
    try:
        saved = json.loads(cache.read_text())
        if saved.get("stamp") == stamp:
            return {k: list(v) for k, v in saved["files"].items()}
    except (OSError, ValueError, KeyError):
        pass
    files = {n: [r.hash for r in chunk_file(base_dir / n, chunk_size)] for n in stamp}
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"stamp": stamp, "files": files}))
    os.replace(tmp, cache)
    return files


def local_chunks(sources: Iterable[tuple[Manifest, Path]]) -> dict[str, tuple[Path, int, int]]:
    """Where chunks already lie on this node: ``{hash: (file, offset, size)}`` from the manifests of
    snapshots whose files are in the given directories (other sandboxes' promoted snapshots)."""
    out: dict[str, tuple[Path, int, int]] = {}
    for manifest, directory in sources:
        cs = manifest.chunk_size
        for f in manifest.files:
            path = directory / f.name
            if not path.exists():
                continue
            for i, h in enumerate(f.chunks):
                out.setdefault(h, (path, i * cs, min(cs, f.size - i * cs)))
    return out


def _read_local(place: tuple[Path, int, int], digest: str) -> bytes | None:
    """The chunk from a local file, or None when the file changed or is gone (it is then downloaded)."""
    try:
        data = read_chunk(*place)
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == digest else None


async def fetch(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, snapshot_id: str, dest: Path, *,
                base_dir: Path | None = None, local: dict[str, tuple[Path, int, int]] | None = None,
                progress: Progress | None = None) -> FetchResult:
    """Rebuild promoted snapshot ``snapshot_id`` into ``dest`` (module docstring). ``base_dir``: a local
    snapshot (the template's) whose same-sized files are reflinked and whose matching chunks are reused;
    ``local``: other chunks already on the node (:func:`local_chunks`), read and checked instead of fetched.

    Raises ``NotFound`` (no such snapshot, or not promoted), ``SnapshotCorrupt`` (an object is missing or
    fails its checksum; ``details.chunk``, ``details.what``), ``StorageError`` (retryable)."""
    row = await pool.fetchrow("SELECT promotion, manifest FROM snapshots WHERE id=$1", snapshot_id)
    if row is None or row["promotion"] != "promoted" or row["manifest"] is None:
        raise NotFound(f"snapshot {snapshot_id} is not promoted")
    manifest = Manifest.model_validate(row["manifest"])
    return await _fetch_manifest(store, settings, manifest, snapshot_id, f"snapshot {snapshot_id}", dest,
                                 base_dir=base_dir, names=SNAPSHOT_FILES, local=local, progress=progress)


async def _fetch_manifest(store: ObjectStore, settings: Settings, manifest: Manifest, ident: str, what: str,
                          dest: Path, *, base_dir: Path | None, names: tuple[str, ...],
                          local: dict[str, tuple[Path, int, int]] | None, progress: Progress | None) -> FetchResult:
    """Rebuild ``manifest``'s files into ``dest`` (through ``<dest>.part``); ``names``: the files of
    ``base_dir`` that may be reflinked. What :func:`fetch` does once the manifest is read."""
    t0 = time.perf_counter()
    cs = manifest.chunk_size
    res = FetchResult(ident, total_bytes=manifest.total_bytes())
    index: dict[str, list[str]] = {}
    if base_dir is not None and base_dir.exists():
        index = await asyncio.to_thread(chunk_index, base_dir, cs, names)
    part = dest.with_name(dest.name + ".part")
    await asyncio.to_thread(shutil.rmtree, part, True)
    part.mkdir(parents=True)
    # Plan: per hash, the (file, offset) places it goes; whether a place is already right (base) or a hole.
    todo: dict[str, list[tuple[Path, int, int]]] = {}
    done = [0]
    try:
        for f in manifest.files:
            if file_checksum(f.chunks) != f.sha256 or len(f.chunks) != -(-f.size // cs):
                raise SnapshotCorrupt(f"the manifest of {what} is inconsistent for {f.name}",
                                      details={"what": f.name})
            dst = part / f.name
            base_hashes = index.get(f.name)
            base = base_dir / f.name if base_dir is not None and base_hashes is not None else None
            if base is not None and base.stat().st_size == f.size:
                await asyncio.to_thread(reflink_or_copy, base, dst)
            else:
                base_hashes = None
                with open(dst, "wb") as out:
                    out.truncate(f.size)
            for i, h in enumerate(f.chunks):
                off, n = i * cs, min(cs, f.size - i * cs)
                if base_hashes is not None and i < len(base_hashes) and base_hashes[i] == h:
                    continue
                if base_hashes is None and h == zero_hash(n):
                    continue  # a fresh sparse file already reads as zeros there
                todo.setdefault(h, []).append((dst, off, n))
        res.chunks = sum(len(f.chunks) for f in manifest.files)

        async def get(h: str) -> None:
            places = todo[h]
            n = places[0][2]
            data = None
            if h == zero_hash(n):
                data = bytes(n)
            elif local and h in local:
                data = await asyncio.to_thread(_read_local, local[h], h)  # None: changed since, so download
            if data is None:
                blob = await store.get(chunk_key(h))
                if blob is None:
                    raise SnapshotCorrupt(f"chunk {h[:16]} of {places[0][0].name} is missing from object storage",
                                          details={"chunk": h, "what": places[0][0].name})
                data = await asyncio.to_thread(decompress_verified, blob, h, max_size=cs,
                                               what=f"of {places[0][0].name} ")
                res.chunks_downloaded += 1
                res.downloaded_bytes += len(blob)
            await asyncio.to_thread(_write_places, data, places)
            done[0] += n * len(places)
            if progress:
                progress(done[0], res.total_bytes)

        t = time.perf_counter()
        await _pool_map(list(todo), get, settings.s3_concurrency * 2)
        res.download_seconds = time.perf_counter() - t
        if dest.exists():
            await asyncio.to_thread(shutil.rmtree, dest, True)
        os.replace(part, dest)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, part, True)
        FETCH_SECONDS.labels("failed").observe(time.perf_counter() - t0)
        raise
    res.seconds = time.perf_counter() - t0
    FETCH_SECONDS.labels("ok").observe(res.seconds)
    TRANSFER_BYTES.labels("down").observe(res.downloaded_bytes)
    TRANSFER_SECONDS.labels("down").observe(res.download_seconds)
    CHUNK_REUSE_RATIO.labels("fetch").observe(1 - res.chunks_downloaded / max(1, res.chunks))
    log.info("fetched %s: %d chunks, %d downloaded (%.1f MiB) in %.1f s", what, res.chunks,
             res.chunks_downloaded, res.downloaded_bytes / 2**20, res.seconds)
    return res


def _root_chunks(root_dir: Path, chunk_size: int) -> dict[str, tuple[Path, int, int]]:
    """Every chunk of the root template's files: ``{hash: (file, offset, size)}`` (blocking)."""
    out: dict[str, tuple[Path, int, int]] = {}
    for name, hashes in chunk_index(root_dir, chunk_size, TEMPLATE_FILES).items():
        size = (root_dir / name).stat().st_size
        for i, h in enumerate(hashes):
            out.setdefault(h, (root_dir / name, i * chunk_size, min(chunk_size, size - i * chunk_size)))
    return out


async def promote_template(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, name: str, digest: str,
                           template_dir: Path, *, root: str, root_digest: str, root_dir: Path,
                           progress: Progress | None = None) -> PromoteResult:
    """Promote build ``digest`` of built template ``name`` (its files, :data:`TEMPLATE_FILES`, in
    ``template_dir``) as snapshots are promoted (module docstring), into ``template_promotions`` and
    ``template_chunks``. Chunks its root has (the built-in template it was built on, ``root`` at
    ``root_digest``, files in ``root_dir``; every node builds that one itself) are neither uploaded nor
    referenced: a fetching node reads them from its own root. Chunks already stored (a parent template's, a
    sandbox's) are not uploaded again. Idempotent: a promoted build returns ``already``; a half-promoted one is
    finished. Raises ``NotFound`` (no files), ``StorageError`` (retryable), ``SnapshotCorrupt``."""
    t0 = time.perf_counter()
    ident = f"{name}@{digest[:12]}"
    res = PromoteResult(ident)
    if await pool.fetchval("SELECT state FROM template_promotions WHERE name=$1 AND digest=$2",
                           name, digest) == "promoted":
        res.already = True
        return res
    cs = settings.chunk_size_kib << 10
    t = time.perf_counter()
    manifest, where = await asyncio.to_thread(build_manifest, template_dir, cs, TEMPLATE_FILES)
    in_root = set(await asyncio.to_thread(_root_chunks, root_dir, cs))
    res.hash_seconds = time.perf_counter() - t
    hashes = sorted(manifest.hashes() - in_root)
    res.total_bytes, res.chunks = manifest.total_bytes(), len(manifest.hashes())
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO template_promotions (name, digest, root, root_digest, state, manifest, total_bytes)"
            " VALUES ($1,$2,$3,$4,'promoting',$5,$6) ON CONFLICT (name, digest) DO UPDATE SET state='promoting',"
            " root=$3, root_digest=$4, manifest=$5, total_bytes=$6",
            name, digest, root, root_digest, manifest.model_dump(), res.total_bytes)
        await conn.execute("DELETE FROM template_chunks WHERE name=$1 AND digest=$2", name, digest)
        await conn.execute("INSERT INTO template_chunks (name, digest, hash) SELECT $1, $2, unnest($3::text[])",
                           name, digest, hashes)
        await conn.execute("UPDATE chunks SET last_ref_at=now() WHERE hash = ANY($1::text[])", hashes)
    await _upload_missing(pool, store, settings, hashes, where, res, f"template {ident}", progress)
    await pool.execute(
        "UPDATE template_promotions SET state='promoted', promoted_at=now(), uploaded_bytes=$3, stored_bytes=$4"
        " WHERE name=$1 AND digest=$2", name, digest, res.uploaded_bytes, res.stored_bytes)
    res.seconds = time.perf_counter() - t0
    PROMOTION_SECONDS.labels("ok").observe(res.seconds)
    TRANSFER_BYTES.labels("up").observe(res.stored_bytes)
    CHUNK_REUSE_RATIO.labels("promote").observe(1 - res.chunks_uploaded / max(1, res.chunks))
    log.info("promoted template %s: %d chunks, %d in its root %s, %d uploaded (%.1f MiB of %.1f MiB, %.1f MiB"
             " stored) in %.1f s", ident, res.chunks, res.chunks - len(hashes), root, res.chunks_uploaded,
             res.uploaded_bytes / 2**20, res.total_bytes / 2**20, res.stored_bytes / 2**20, res.seconds)
    return res


async def template_root(pool: asyncpg.Pool, name: str, digest: str) -> tuple[str, str] | None:
    """``(root, root_digest)`` of a promoted build of template ``name``; None when it is not promoted."""
    row = await pool.fetchrow("SELECT root, root_digest FROM template_promotions WHERE name=$1 AND digest=$2"
                              " AND state='promoted'", name, digest)
    return None if row is None else (row["root"], row["root_digest"])


async def fetch_template(pool: asyncpg.Pool, store: ObjectStore, settings: Settings, name: str, digest: str,
                         dest: Path, *, root_dir: Path, progress: Progress | None = None) -> FetchResult:
    """Rebuild promoted build ``digest`` of template ``name`` into ``dest``: files of ``root_dir`` (this node's
    build of its root, at the promotion's ``root_digest``) of the same size are reflinked, chunks found
    anywhere in them are read locally, the rest is downloaded and checked. Raises ``NotFound`` (not
    promoted), ``SnapshotCorrupt``, ``StorageError``."""
    row = await pool.fetchrow("SELECT manifest FROM template_promotions WHERE name=$1 AND digest=$2"
                              " AND state='promoted'", name, digest)
    if row is None:
        raise NotFound(f"template {name!r} build {digest[:12]} is not promoted")
    manifest = Manifest.model_validate(row["manifest"])
    local = await asyncio.to_thread(_root_chunks, root_dir, manifest.chunk_size)
    return await _fetch_manifest(store, settings, manifest, f"{name}@{digest[:12]}", f"template {name}", dest,
                                 base_dir=root_dir, names=TEMPLATE_FILES, local=local, progress=progress)


def _write_places(data: bytes, places: list[tuple[Path, int, int]]) -> None:
    for path, off, n in places:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data[:n], off)
        finally:
            os.close(fd)


async def collect_garbage(pool: asyncpg.Pool, store: ObjectStore, grace_s: float, *, batch: int = 1000) -> GcResult:
    """One garbage-collection cycle (module docstring). ``StorageError`` leaves the rows for the next cycle."""
    res = GcResult()
    # Snapshots that can no longer be restored stop referencing their chunks.
    res.refs_dropped = int((await pool.execute(
        "DELETE FROM snapshot_chunks sc USING snapshots s WHERE s.id = sc.snapshot_id"
        " AND (s.state IN ('deleted', 'failed') OR s.promotion IN ('failed', 'local'))")).split()[-1])
    res.refs_dropped += int((await pool.execute(
        "DELETE FROM volume_snapshot_chunks vc USING volume_snapshots s WHERE s.id = vc.snapshot_id"
        " AND s.state = 'failed'")).split()[-1])
    while True:
        async with pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT hash FROM chunks c WHERE c.last_ref_at < now() - make_interval(secs => $1)"
                " AND NOT EXISTS (SELECT 1 FROM snapshot_chunks sc WHERE sc.hash = c.hash)"
                " AND NOT EXISTS (SELECT 1 FROM template_chunks tc WHERE tc.hash = c.hash)"
                " AND NOT EXISTS (SELECT 1 FROM volume_snapshot_chunks vc WHERE vc.hash = c.hash)"
                " ORDER BY hash LIMIT $2 FOR UPDATE SKIP LOCKED", float(grace_s), batch)
            if not rows:
                break
            doomed = [r["hash"] for r in rows]
            await store.delete([chunk_key(h) for h in doomed])
            await conn.execute("DELETE FROM chunks WHERE hash = ANY($1::text[])", doomed)
        res.chunks_deleted += len(doomed)
        res.deleted_hashes.extend(doomed)
        if len(doomed) < batch:
            break
    # Objects without a row: an upload whose process died before recording it.
    cutoff = datetime.now(UTC) - timedelta(seconds=grace_s)
    candidates: list[str] = []
    async for obj in store.list("chunks/"):
        if obj.last_modified < cutoff:
            candidates.append(obj.key)
    if candidates:
        known = {r["hash"] for r in await pool.fetch("SELECT hash FROM chunks WHERE hash = ANY($1::text[])",
                                                     [k.rsplit("/", 1)[-1] for k in candidates])}
        orphans = [k for k in candidates if k.rsplit("/", 1)[-1] not in known]
        if orphans:
            await store.delete(orphans)
            res.orphans_deleted = len(orphans)
    if res.chunks_deleted or res.orphans_deleted:
        log.info("garbage collection: %d chunk(s) and %d orphaned object(s) deleted", res.chunks_deleted,
                 res.orphans_deleted)
    return res
