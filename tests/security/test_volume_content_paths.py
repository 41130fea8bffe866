"""The volume content API on the node (services/nodeagent/storage/volume_content.py): a volume's files, reached without
a sandbox, never lead out of the volume. Client vs node boundary of docs/SECURITY.md.

The node's routes run in-process over ASGI on a real volume (an ext4 file made by ``VolumeStore`` and
loop-mounted for each call, so this needs root) with the session's PostgreSQL for the volume's row. Tried
against every operation: ``..`` in every position, absolute and relative symlinks inside the volume that point
at a canary file of the host (by its host path, and up through ``..``), a symlinked directory on the way, a
symlink as the last component of a write, NUL bytes; and a volume a VM directory holds (409).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from podbay.errors import PodbayError
from podbay_nodeagent.dataplane.grant_check import route_of
from podbay_nodeagent.storage.volume_content import add_volume_content_routes
from podbay_nodeagent.storage.volumes import VolumeStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop-mounts a volume's filesystem: needs root")

NODE = "node-vc-test"


@pytest.fixture
async def world(pool: asyncpg.Pool, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    tenant = "tnt_vc_" + secrets.token_hex(4)
    vol = "vol_" + secrets.token_hex(8)
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await pool.execute("INSERT INTO volumes (id, tenant_id, name, size_bytes) VALUES ($1, $2, 'data', $3)",
                       vol, tenant, 64 << 20)
    store = VolumeStore(tmp_path / "store" / "volumes", pool, NODE)
    app = FastAPI()

    @app.exception_handler(PodbayError)
    async def _err(_: Any, exc: PodbayError) -> Any:
        from fastapi.responses import JSONResponse
        return JSONResponse(exc.to_wire(), status_code=exc.http_status)

    add_volume_content_routes(app, store, tmp_path / "store" / "volume-mounts")
    canary = tmp_path / "canary.txt"
    canary.write_text("host secret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
        yield {"c": c, "vol": vol, "store": store, "canary": canary, "base": f"/internal/v1/volumes/{vol}/content",
               "tmp": tmp_path}
    await pool.execute("DELETE FROM volumes WHERE id=$1", vol)


async def test_files_dirs_metadata_and_removal_round_trip(world: dict[str, Any], pool: asyncpg.Pool) -> None:
    c, base = world["c"], world["base"]
    r = await c.put(f"{base}/file", params={"path": "/docs/a.txt", "force": "true"}, content=b"hello volume")
    assert r.status_code == 201, r.text
    assert (r.json()["type"], r.json()["size"], r.json()["uid"], r.json()["mode"]) == ("file", 12, 1000, 0o666)
    assert await pool.fetchval("SELECT node_id FROM volumes WHERE id=$1", world["vol"]) == NODE
    r = await c.put(f"{base}/file", params={"path": "/docs/a.txt"}, content=b"again")
    assert r.status_code == 409  # without force an existing file stays
    assert (await c.get(f"{base}/file", params={"path": "docs/../docs/a.txt"})).content == b"hello volume"
    r = await c.post(f"{base}/dir", params={"path": "/docs/sub/deeper", "force": "true", "mode": 0o750})
    assert r.status_code == 201 and r.json()["type"] == "directory" and r.json()["mode"] == 0o750, r.text
    assert (await c.post(f"{base}/dir", params={"path": "/docs/sub/deeper"})).status_code == 409
    assert (await c.post(f"{base}/dir", params={"path": "/nope/x"})).status_code == 404
    r = await c.get(f"{base}/dir", params={"path": "/docs", "depth": 2})
    assert [e["path"] for e in r.json()] == ["/docs/a.txt", "/docs/sub", "/docs/sub/deeper"]
    r = await c.patch(f"{base}/path", params={"path": "/docs/a.txt"}, json={"uid": 1234, "mode": 0o600})
    assert (r.json()["uid"], r.json()["gid"], r.json()["mode"]) == (1234, 1000, 0o600), r.text
    assert (await c.get(f"{base}/path", params={"path": "/missing"})).status_code == 404
    assert (await c.delete(f"{base}/path", params={"path": "/docs"})).status_code == 204
    assert (await c.get(f"{base}/path", params={"path": "/docs"})).status_code == 404
    assert (await c.delete(f"{base}/path", params={"path": "/"})).status_code == 400
    assert (await c.get(f"{base}/dir", params={"path": "/", "depth": 11})).status_code == 400
    # Nothing stays mounted between calls.
    assert not os.path.ismount(world["tmp"] / "store" / "volume-mounts" / world["vol"])


async def test_no_path_leads_out_of_the_volume(world: dict[str, Any]) -> None:
    c, base, canary = world["c"], world["base"], world["canary"]
    # Links made inside the volume (as a sandbox that mounts it could make them).
    assert (await c.post(f"{base}/dir", params={"path": "/in"})).status_code == 201
    store: VolumeStore = world["store"]
    point = world["tmp"] / "mnt-setup"
    point.mkdir()
    os.system(f"mount -o loop {store.path(world['vol'])} {point}")  # noqa: S605 - test setup of a file we made
    try:
        os.symlink(str(canary), point / "abs-link")
        os.symlink("../../../../../../../../" + str(canary).lstrip("/"), point / "in" / "up-link")
        os.symlink(str(canary.parent), point / "dir-link")
        os.symlink("/", point / "root-link")
    finally:
        os.system(f"umount {point}")  # noqa: S605
    name = canary.name
    for path in ("/abs-link", "/in/up-link", f"/dir-link/{name}", f"/root-link/{str(canary).lstrip('/')}",
                 f"/../../../../{str(canary).lstrip('/')}", f"../{name}", f"/in/../../{name}",
                 f"/%2e%2e/{name}", f"{canary}"):
        r = await c.get(f"{base}/file", params={"path": path})
        assert r.status_code in (400, 404) and b"host secret" not in r.content, (path, r.status_code, r.text)
        r = await c.get(f"{base}/dir", params={"path": path.rsplit("/", 1)[0] or "/"})
        assert all(e["name"] != name or e["type"] == "symlink" for e in r.json()) if r.status_code == 200 else True
    # Writes through a link: a link as the last component is refused (never written through); a linked
    # directory on the way resolves inside the volume: missing there (404), or, for the link to "/", made
    # there with force (201: a file of the volume, at the canary's path under the volume's top).
    for path in ("/abs-link", "/in/up-link", f"/dir-link/{name}", f"/root-link/{str(canary).lstrip('/')}"):
        for force in ("true", "false"):
            r = await c.put(f"{base}/file", params={"path": path, "force": force}, content=b"overwritten")
            inside = path.startswith("/root-link/") and force == "true"
            assert r.status_code == (201 if inside else r.status_code) and r.status_code in (
                (201,) if inside else (400, 404, 409)), (path, force, r.status_code, r.text)
    r = await c.get(f"{base}/file", params={"path": str(canary)})
    assert r.status_code == 200 and r.content == b"overwritten"  # the volume's own file at that path
    for path in ("/abs-link", "/dir-link"):
        r = await c.patch(f"{base}/path", params={"path": path}, json={"mode": 0o777, "uid": 0})
        assert r.status_code == 200 and r.json()["type"] == "symlink", r.text
    assert (await c.delete(f"{base}/path", params={"path": "/dir-link"})).status_code == 204
    assert canary.read_text() == "host secret" and canary.parent.is_dir()
    assert canary.stat().st_mode & 0o777 != 0o777 and canary.stat().st_uid == os.getuid()
    r = await c.get(f"{base}/path", params={"path": "/abs-link"})
    assert r.json()["target"] == str(canary)  # shown as text, never followed
    r = await c.get(f"{base}/file", params={"path": "/a\x00b"})
    assert r.status_code in (400, 422)


async def test_a_volume_a_vm_holds_is_refused(world: dict[str, Any]) -> None:
    c, base = world["c"], world["base"]
    assert (await c.get(f"{base}/path", params={"path": "/"})).status_code == 200  # its file is made
    store: VolumeStore = world["store"]
    vm_dir = world["tmp"] / "vm"
    vm_dir.mkdir()
    os.link(store.path(world["vol"]), vm_dir / "vol0.img")  # as VolumeStore.attach links it
    r = await c.get(f"{base}/path", params={"path": "/"})
    assert r.status_code == 409 and "attached" in r.text


def test_the_node_gate_maps_only_plain_volume_routes() -> None:
    from podbay.grants import GrantKind

    assert route_of("/internal/v1/volumes/vol_abc/content/file", {}) == (GrantKind.VOLUME, "vol_abc")
    for bad in ("/internal/v1/volumes/vol_abc/content/other", "/internal/v1/volumes/../content/file",
                "/internal/v1/volumes/vol_abc/content/file/x", "/internal/v1/volumes/vol%2e/content/path",
                "/internal/v1/volumes/vol_abc/content", "/internal/v1/volumes//content/dir"):
        with pytest.raises(PodbayError):
            route_of(bad, {})
