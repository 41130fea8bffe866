"""Chunking, checksums and compression of snapshot files (podbay.chunks), and the upload rate limiter."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from podbay.chunks import (
    chunk_file,
    chunk_key,
    compress,
    data_extents,
    decompress_verified,
    file_checksum,
    zero_hash,
)
from podbay.contracts.states import SandboxCommand, SandboxState, check_allowed
from podbay.errors import InvalidState, SnapshotCorrupt
from podbay.objstore import RateLimiter

CS = 64 * 1024


def test_holes_are_hashed_as_zero_chunks_without_being_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.truncate(10 * CS + 100)
        f.seek(3 * CS + 5)
        f.write(b"x" * 10)
    refs = chunk_file(path, CS)
    assert len(refs) == 11 and refs[-1].size == 100
    assert [r.offset for r in refs] == [i * CS for i in range(11)]
    data = path.read_bytes()
    for r in refs:
        assert r.hash == hashlib.sha256(data[r.offset:r.offset + r.size]).hexdigest()
    assert [r.zero for r in refs].count(False) == 1 and not refs[3].zero
    with open(path, "rb") as f:
        ext = data_extents(f.fileno(), os.fstat(f.fileno()).st_size)
    assert all(s <= 3 * CS + 5 < e for s, e in ext[:1]) or ext == [(0, 10 * CS + 100)]


def test_same_content_same_hash_and_file_checksum_follows_order(tmp_path: Path) -> None:
    block = os.urandom(CS)
    (tmp_path / "a").write_bytes(block + block + os.urandom(CS))
    refs = chunk_file(tmp_path / "a", CS)
    assert refs[0].hash == refs[1].hash != refs[2].hash
    hashes = [r.hash for r in refs]
    assert file_checksum(hashes) != file_checksum(list(reversed(hashes)))
    assert chunk_key(hashes[0]) == f"chunks/{hashes[0][:2]}/{hashes[0]}"


def test_decompress_verified_accepts_the_right_bytes_only() -> None:
    data = os.urandom(1000) + bytes(5000)
    digest = hashlib.sha256(data).hexdigest()
    blob = compress(data)
    assert len(blob) < len(data)
    assert decompress_verified(blob, digest, max_size=CS) == data
    with pytest.raises(SnapshotCorrupt, match="checksum") as err:
        decompress_verified(compress(data[:-1] + b"!"), digest, max_size=CS)
    assert err.value.details["chunk"] == digest and err.value.code == "snapshot_corrupt"
    with pytest.raises(SnapshotCorrupt, match="not a valid compressed object"):
        decompress_verified(b"garbage", digest, max_size=CS)
    assert zero_hash(7) == hashlib.sha256(bytes(7)).hexdigest()


def test_rate_limiter_makes_callers_wait_for_bytes_beyond_the_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr("podbay.objstore.asyncio.sleep", fake_sleep)

    async def run(rate: float) -> None:
        lim = RateLimiter(rate)
        for _ in range(4):
            await lim.take(500_000)

    asyncio.run(run(1_000_000))  # 2 MB at 1 MB/s with one second of tokens in the bucket: ~1 s of waiting
    assert 0.9 <= sum(slept) <= 1.01
    slept.clear()
    asyncio.run(run(0))
    assert slept == []


def test_suspend_and_resume_are_allowed_where_the_lifecycle_says() -> None:
    check_allowed(SandboxCommand.SUSPEND, SandboxState.RUNNING)
    check_allowed(SandboxCommand.SUSPEND, SandboxState.PAUSED)
    check_allowed(SandboxCommand.RESUME, SandboxState.SUSPENDED)
    for st in (SandboxState.SUSPENDED, SandboxState.SUSPENDING, SandboxState.RESUMING, SandboxState.STARTING):
        with pytest.raises(InvalidState):
            check_allowed(SandboxCommand.SUSPEND, st)
    with pytest.raises(InvalidState):
        check_allowed(SandboxCommand.EXEC, SandboxState.SUSPENDED)
