"""Content-addressed chunks of snapshot files (docs/DESIGN.md §5): what the snapshotter uploads and a node fetches.

A file is cut into fixed-size chunks (``chunk_size_kib``, the last one shorter); each chunk is named by the
SHA-256 of its uncompressed bytes and stored once in the bucket as ``chunks/<hh>/<hash>`` compressed with
zstd. A file's manifest entry lists its size, its chunk hashes in order and a checksum over them
(``sha256`` of the concatenated chunk hashes), so a file is intact exactly when every chunk is.

Holes are not read: chunks that lie wholly in a hole (``SEEK_HOLE``; reflinked RAM and disk files are
sparse) get the hash of a zero chunk without touching the disk. Everything here is blocking and pure
(files in, hashes out): callers run it in threads.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import zstandard
from pydantic import BaseModel, ConfigDict, Field

from podbay.errors import SnapshotCorrupt

__all__ = [
    "ChunkRef",
    "FileManifest",
    "Manifest",
    "chunk_file",
    "chunk_key",
    "compress",
    "decompress_verified",
    "data_extents",
    "file_checksum",
    "read_chunk",
    "zero_hash",
]


class FileManifest(BaseModel):
    """One file of a snapshot: ``name`` relative to the snapshot directory, ``size`` in bytes, ``sha256`` over
    its chunk hashes, ``chunks`` the chunk hashes in file order."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    size: int = Field(ge=0)
    sha256: str
    chunks: list[str]


class Manifest(BaseModel):
    """Every file of a snapshot with sizes and checksums (``snapshots.manifest`` in PostgreSQL)."""

    model_config = ConfigDict(extra="forbid")

    chunk_size: int = Field(ge=4096)
    files: list[FileManifest]

    def hashes(self) -> set[str]:
        """The distinct chunk hashes this manifest references."""
        return {h for f in self.files for h in f.chunks}

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of a local file: its hash, byte ``offset`` and ``size``; ``zero`` when it lies in a hole."""

    hash: str
    offset: int
    size: int
    zero: bool


def chunk_key(digest: str) -> str:
    """Bucket key of a chunk: ``chunks/<first two hex digits>/<hash>``."""
    return f"chunks/{digest[:2]}/{digest}"


@lru_cache(maxsize=16)
def zero_hash(size: int) -> str:
    """SHA-256 hex of ``size`` zero bytes."""
    return hashlib.sha256(bytes(size)).hexdigest()


def file_checksum(chunk_hashes: list[str]) -> str:
    """A file's checksum: SHA-256 of its chunk hashes (hex) joined in order."""
    return hashlib.sha256("".join(chunk_hashes).encode()).hexdigest()


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` byte ranges of ``fd`` that hold data (not holes). A filesystem without
    ``SEEK_DATA`` reports the whole file as data."""
    out: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after pos
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end))
            pos = end
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return [(0, size)] if size else []
        raise
    return out


def _overlaps(extents: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(s < end and e > start for s, e in extents)


def read_chunk(path: Path, offset: int, size: int) -> bytes:
    """``size`` bytes of ``path`` at ``offset`` (short only at end of file)."""
    with open(path, "rb") as f:
        return os.pread(f.fileno(), size, offset)


def chunk_file(path: Path, chunk_size: int, known: Sequence[str | None] | None = None,
               stats: dict[str, int] | None = None) -> list[ChunkRef]:
    """Cut ``path`` into chunks of ``chunk_size`` bytes and hash each (holes are not read). Blocking.

    ``known``: per chunk, its hash when the caller knows it without reading (a chunk whose extents are
    shared with an earlier hashed file, :mod:`podbay.promotion`), else None; such chunks are not read.
    ``stats``: ``hashed`` and ``reused`` bytes are added to it (holes count as neither)."""
    out: list[ChunkRef] = []
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        extents = data_extents(fd, size)
        for i, offset in enumerate(range(0, size, chunk_size)):
            n = min(chunk_size, size - offset)
            have = known[i] if known is not None and i < len(known) else None
            if have is not None:
                out.append(ChunkRef(have, offset, n, have == zero_hash(n)))
                if stats is not None:
                    stats["reused"] = stats.get("reused", 0) + n
                continue
            if not _overlaps(extents, offset, offset + n):
                out.append(ChunkRef(zero_hash(n), offset, n, True))
                continue
            data = os.pread(fd, n, offset)
            if len(data) != n:
                raise OSError(f"{path} shrank while being read")
            if stats is not None:
                stats["hashed"] = stats.get("hashed", 0) + n
            digest = hashlib.sha256(data).hexdigest()
            out.append(ChunkRef(digest, offset, n, digest == zero_hash(n)))
    return out


def compress(data: bytes, level: int = 3) -> bytes:
    """zstd-compress ``data`` (a frame that records its content size)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def decompress_verified(blob: bytes, digest: str, *, max_size: int, what: str = "") -> bytes:
    """Decompress a stored chunk and check it against ``digest``; ``SnapshotCorrupt`` when it does not
    decompress or its SHA-256 differs (``details``: ``chunk``, ``what``)."""
    try:
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise SnapshotCorrupt(f"chunk {digest[:16]} {what}is not a valid compressed object: {exc}",
                              details={"chunk": digest, "what": what.strip()}) from exc
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise SnapshotCorrupt(f"chunk {digest[:16]} {what}failed its checksum (got sha256 {got[:16]})",
                              details={"chunk": digest, "what": what.strip()})
    return data
