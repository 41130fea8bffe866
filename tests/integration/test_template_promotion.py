"""A built template's promotion to object storage and its fetch by another node, against real PostgreSQL and S3.

A template's files are made here: a "root" (the built-in template a build starts from) and a build that
shares most of its chunks with it, so these tests need no VM; tests/e2e/test_template_nodes.py runs the
same path with real microVMs on two node agents.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from podbay.chunks import chunk_key
from podbay.config import Settings
from podbay.devstack.servers import S3Endpoint
from podbay.errors import NotFound
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import new_id
from podbay.promotion import TEMPLATE_FILES, collect_garbage, fetch_template, promote_template, template_root

pytestmark = pytest.mark.integration

CHUNK_KIB = 256
MIB = 1 << 20


@pytest.fixture
def settings(s3: S3Endpoint, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    return Settings(s3_url=s3.url, s3_bucket=s3.bucket, pg_dsn=pg_dsn, chunk_size_kib=CHUNK_KIB)


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[ObjectStore]:
    async with open_store(settings) as st:
        await st.ensure_bucket()
        yield st


def _root(d: Path) -> None:
    """A root template: kernel and initrd, 16 MiB of ram data, a 64 MiB sparse disk with 16 MiB of data."""
    d.mkdir(parents=True)
    (d / "vmlinuz").write_bytes(os.urandom(3 * MIB))
    (d / "initrd.img").write_bytes(os.urandom(2 * MIB))
    (d / "template.json").write_text('{"name": "root"}')
    (d / "state").write_bytes(os.urandom(60_000))
    with open(d / "ram", "wb") as f:
        f.write(os.urandom(16 * MIB))
        f.truncate(32 * MIB)
    with open(d / "disk.img", "wb") as f:
        f.truncate(64 * MIB)
        f.seek(8 * MIB)
        f.write(os.urandom(16 * MIB))


def _build_on(root: Path, d: Path) -> None:
    """A build on ``root``: the same kernel, 1 MiB of new disk data, 2 MiB of ram changed, a moved ram page run."""
    shutil.copytree(root, d)
    (d / "template.json").write_text('{"name": "web"}')
    (d / "state").write_bytes(os.urandom(60_000))
    with open(d / "disk.img", "r+b") as f:
        f.seek(40 * MIB)
        f.write(os.urandom(1 * MIB))
    with open(d / "ram", "r+b") as f:
        moved = (root / "ram").read_bytes()[: 2 * MIB]
        f.seek(20 * MIB)
        f.write(moved)  # chunks of the root at another offset: read locally by the fetch, never uploaded
        f.seek(4 * MIB)
        f.write(os.urandom(2 * MIB))


async def test_a_build_uploads_only_what_its_root_lacks_and_another_node_rebuilds_it(
        pool: asyncpg.Pool, store: ObjectStore, settings: Settings, tmp_path: Path) -> None:
    name, digest, root_digest = f"web-{new_id('t')[-8:]}".lower(), new_id("d"), new_id("r")
    _root(tmp_path / "a-root")
    _build_on(tmp_path / "a-root", tmp_path / "a-build")
    assert await template_root(pool, name, digest) is None

    res = await promote_template(pool, store, settings, name, digest, tmp_path / "a-build", root="base",
                                 root_digest=root_digest, root_dir=tmp_path / "a-root")
    # 1 MiB of disk, 2 MiB of ram and the state are new; everything else is in the root.
    assert 3 * MIB <= res.uploaded_bytes <= 3 * MIB + 2 * CHUNK_KIB * 1024, res
    assert res.total_bytes > 100 * MIB
    assert await template_root(pool, name, digest) == ("base", root_digest)
    assert (await promote_template(pool, store, settings, name, digest, tmp_path / "a-build", root="base",
                                   root_digest=root_digest, root_dir=tmp_path / "a-root")).already

    # "Node B" has its own copy of the root, and nothing of the build.
    shutil.copytree(tmp_path / "a-root", tmp_path / "b-root")
    got = await fetch_template(pool, store, settings, name, digest, tmp_path / "b" / digest,
                               root_dir=tmp_path / "b-root")
    for f in TEMPLATE_FILES:
        assert (tmp_path / "b" / digest / f).read_bytes() == (tmp_path / "a-build" / f).read_bytes(), f
    assert got.downloaded_bytes < 4 * MIB, got
    assert not (tmp_path / "b" / f"{digest}.part").exists()

    # Garbage collection keeps a promoted template's chunks.
    refs = [r["hash"] for r in await pool.fetch("SELECT hash FROM template_chunks WHERE name=$1 AND digest=$2",
                                                name, digest)]
    assert refs
    gone = await collect_garbage(pool, store, grace_s=0)
    assert not set(refs) & set(gone.deleted_hashes)
    assert await store.head(chunk_key(refs[0])) is not None

    with pytest.raises(NotFound):
        await fetch_template(pool, store, settings, name, "not-promoted", tmp_path / "c", root_dir=tmp_path / "b-root")
