"""Exact change detection by extent maps (libs/podbay/extents.py) and chunk-hash reuse in promotion manifests
(libs/podbay/promotion.py ``build_manifest(previous=...)``), on a real loop-mounted btrfs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from podbay.chunks import chunk_file
from podbay.extents import extents_equal_files, fiemap, same_extents, unchanged_ranges
from podbay.promotion import build_manifest
from podbay.reflink import reflink_or_copy
from tests.btrfs_loop import btrfs_dir

CS = 256 << 10  # chunk size


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with btrfs_dir(tmp_path) as d:
        yield d


def _disk(path: Path, size: int = 32 << 20, data: tuple[int, int] = (1 << 20, 9 << 20)) -> None:
    """A sparse file with random bytes over [data[0], data[1])."""
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(data[0])
        f.write(os.urandom(data[1] - data[0]))


def _write(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_a_reflink_is_unchanged_until_either_file_is_written(fs: Path) -> None:
    disk, snap = fs / "disk.img", fs / "snap.img"
    _disk(disk)
    assert reflink_or_copy(disk, snap) == "reflink"
    assert extents_equal_files(disk, snap)
    _write(disk, 5 << 20, b"x" * 4096)  # a write through the page cache: FIEMAP_FLAG_SYNC writes it back first
    assert not extents_equal_files(disk, snap)
    # The same bytes written again still count as changed (copy-on-write moved them): the safe side.
    snap2 = fs / "snap2.img"
    reflink_or_copy(disk, snap2)
    _write(disk, 5 << 20, b"x" * 4096)
    assert not extents_equal_files(disk, snap2)


def test_a_write_into_a_hole_or_a_grown_file_is_a_change(fs: Path) -> None:
    disk, snap = fs / "disk.img", fs / "snap.img"
    _disk(disk)
    reflink_or_copy(disk, snap)
    _write(disk, 20 << 20, b"y")  # in a hole
    assert not extents_equal_files(disk, snap)
    reflink_or_copy(disk, snap2 := fs / "snap2.img")
    os.truncate(disk, 40 << 20)  # grown (a disk resize): same extents, other size
    assert not extents_equal_files(disk, snap2)


def test_a_plain_copy_or_a_missing_file_is_never_unchanged(fs: Path, tmp_path: Path) -> None:
    disk = fs / "disk.img"
    _disk(disk)
    copy = fs / "copy.img"
    copy.write_bytes(disk.read_bytes())  # same bytes, other blocks: cannot be told without reading
    assert not extents_equal_files(disk, copy)
    assert not extents_equal_files(disk, fs / "gone.img")
    elsewhere = tmp_path / "other.img"  # another filesystem
    elsewhere.write_bytes(b"")
    assert not extents_equal_files(disk, elsewhere)


def test_unchanged_ranges_names_the_written_chunks(fs: Path) -> None:
    disk, snap = fs / "disk.img", fs / "snap.img"
    size = 32 << 20
    _disk(disk, size)
    reflink_or_copy(disk, snap)
    _write(disk, 5 * CS + 100, b"z" * 10)  # chunk 5
    _write(disk, 100 * CS - 1, b"zz")  # straddles chunks 99 and 100 (100: a hole before)
    same = unchanged_ranges(fiemap(disk), fiemap(snap), size, CS)
    assert len(same) == size // CS
    assert [i for i, ok in enumerate(same) if not ok] == [5, 99, 100]
    assert same_extents(fiemap(snap), fiemap(snap))


def test_manifest_reuses_hashes_of_shared_chunks_and_hashes_only_the_changed(fs: Path) -> None:
    prev, cur = fs / "snap_a", fs / "snap_b"
    prev.mkdir()
    cur.mkdir()
    size = 32 << 20
    _disk(prev / "disk.img", size, (0, 16 << 20))
    before, _ = build_manifest(prev, CS)
    reflink_or_copy(prev / "disk.img", cur / "disk.img")

    stats: dict[str, int] = {}
    unchanged, _ = build_manifest(cur, CS, previous=(prev, before), stats=stats)
    assert unchanged == before
    assert stats.get("hashed", 0) == 0 and stats["reused"] == size

    _write(cur / "disk.img", 3 * CS + 7, os.urandom(1 << 20))  # 1 MiB across 5 chunks
    stats = {}
    after, where = build_manifest(cur, CS, previous=(prev, before), stats=stats)
    assert stats["hashed"] == 5 * CS and stats["reused"] == size - 5 * CS
    # Exactly what hashing every byte gives.
    assert after.files[0].chunks == [r.hash for r in chunk_file(cur / "disk.img", CS)]
    assert after.files[0].chunks != before.files[0].chunks
    for h in set(after.files[0].chunks) - set(before.files[0].chunks):
        assert where[h][0] == cur / "disk.img"


def test_manifest_without_a_usable_previous_hashes_everything(fs: Path) -> None:
    prev, cur = fs / "snap_a", fs / "snap_b"
    prev.mkdir()
    cur.mkdir()
    _disk(prev / "disk.img", 8 << 20, (0, 8 << 20))
    before, _ = build_manifest(prev, CS)
    (cur / "disk.img").write_bytes((prev / "disk.img").read_bytes())  # a copy: no shared extents
    stats: dict[str, int] = {}
    again, _ = build_manifest(cur, CS, previous=(prev, before), stats=stats)
    assert again == before and stats["hashed"] == 8 << 20
    other, _ = build_manifest(cur, 64 << 10, previous=(prev, before), stats=(s2 := {}))  # another chunk size
    assert s2["hashed"] == 8 << 20 and other.chunk_size == 64 << 10


def test_differing_ranges_are_the_written_blocks(fs: Path) -> None:
    from podbay.extents import differing_ranges

    disk, snap = fs / "disk.img", fs / "snap.img"
    size = 32 << 20
    _disk(disk, size)
    reflink_or_copy(disk, snap)
    assert differing_ranges(fiemap(disk), fiemap(snap), size) == []
    _write(disk, 1024, b"superblock")  # block 0 (what a filesystem thaw rewrites)
    _write(disk, 20 << 20, b"into a hole")
    assert differing_ranges(fiemap(disk), fiemap(snap), size) == [(0, 4096), (20 << 20, (20 << 20) + 4096)]
