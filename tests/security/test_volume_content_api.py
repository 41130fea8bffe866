"""E2B's volume content API through the API (services/api/e2b/volumes.py) to a real node
(services/nodeagent/storage/volume_content.py), driven by the unmodified ``e2b`` SDK's ``Volume`` as ``podbay env
--e2b`` points it (``E2B_VOLUME_API_URL`` = the API's ``/e2b``). Tenant vs tenant boundary of docs/SECURITY.md:
a volume's token opens that one volume; another tenant's token, another volume's token, an API key, or none,
open nothing (401), and a volume a live sandbox holds is refused (409). No microVM is needed: the node mounts
the volume's filesystem itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from access_helpers import new_tenant, sql, template_and_sandbox

from podbay.devstack.stack import Stack

e2b = pytest.importorskip("e2b")


def _env(mp: pytest.MonkeyPatch, stack: Stack, key: str) -> None:
    for k, v in {"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_VOLUME_API_URL": f"{stack.api_url}/e2b",
                 "E2B_API_KEY": key}.items():
        mp.setenv(k, v)


@pytest.fixture
def volumes(stack: Stack) -> Iterator[dict[str, Any]]:
    """Tenant A's volume ``a`` and ``a2`` and tenant B's ``b`` (created through E2B's API)."""
    other = new_tenant(stack, "volc")
    mp = pytest.MonkeyPatch()
    made: list[tuple[str, Any]] = []
    try:
        _env(mp, stack, stack.api_key)
        a, a2 = e2b.Volume.create("content-a"), e2b.Volume.create("content-a2")
        made += [(stack.api_key, a), (stack.api_key, a2)]
        _env(mp, stack, other.key)
        b = e2b.Volume.create("content-b")
        made.append((other.key, b))
        _env(mp, stack, stack.api_key)
        yield {"a": a, "a2": a2, "b": b, "other": other}
    finally:
        for key, v in made:
            _env(mp, stack, key)
            e2b.Volume.destroy(v.volume_id)
        mp.undo()


def test_the_sdk_writes_reads_lists_and_changes_a_volume_without_a_sandbox(volumes: dict[str, Any]) -> None:
    vol = volumes["a"]
    assert vol.token  # E2B's volume token: the content API's bearer credential
    info = vol.write_file("/notes/hello.txt", "hello volume", force=True)
    assert (info.name, info.path, info.size) == ("hello.txt", "/notes/hello.txt", 12)
    assert vol.read_file("/notes/hello.txt") == "hello volume"
    assert b"".join(vol.read_file("/notes/hello.txt", format="stream")) == b"hello volume"
    assert vol.exists("/notes/hello.txt") and not vol.exists("/notes/missing.txt")
    made = vol.make_dir("/notes/sub/deeper", force=True)
    assert made.path == "/notes/sub/deeper" and made.type.value == "directory"
    listed = vol.list("/notes", depth=2)
    assert [e.path for e in listed] == ["/notes/hello.txt", "/notes/sub", "/notes/sub/deeper"]
    changed = vol.update_metadata("/notes/hello.txt", uid=1234, mode=0o600)
    assert (changed.uid, changed.mode) == (1234, 0o600)
    with pytest.raises(e2b.VolumeException):
        vol.write_file("/notes/hello.txt", "again")  # exists, and no force: 409
    vol.remove("/notes")
    assert not vol.exists("/notes/hello.txt")
    with pytest.raises(e2b.exceptions.VolumePathNotFoundException):
        vol.read_file("/notes/hello.txt")


def test_a_volume_token_opens_only_its_own_volume(stack: Stack, volumes: dict[str, Any]) -> None:
    a, a2, b = volumes["a"], volumes["a2"], volumes["b"]
    a.write_file("/secret.txt", "tenant a's", force=True)
    url = f"{stack.api_url}/e2b/volumecontent/{a.volume_id}/file"
    for headers in ({"Authorization": f"Bearer {b.token}"},      # tenant B's token for its own volume
                    {"Authorization": f"Bearer {a2.token}"},     # A's token of another volume
                    {"X-API-Key": stack.api_key},                # an API key is no volume credential
                    {"X-API-Key": volumes["other"].key},
                    {"Authorization": f"Bearer {a.token}x"}, {"Authorization": a.token}, {}):
        r = httpx.get(url, params={"path": "/secret.txt"}, headers=headers)
        assert r.status_code == 401 and b"tenant a" not in r.content, (headers, r.status_code, r.text)
        r = httpx.put(url, params={"path": "/secret.txt", "force": "true"}, content=b"x", headers=headers)
        assert r.status_code == 401, r.text
    # B's own volume, by B's own token, with A's volume id in the query or path spellings: nothing of A's.
    for path in (f"/e2b/volumecontent/{b.volume_id}/../{a.volume_id}/file",
                 f"/e2b/volumecontent/{b.volume_id}%2F..%2F{a.volume_id}/file",
                 f"/e2b/volumecontent/{a.volume_id.replace('_', '%5F')}/file"):
        r = httpx.get(stack.api_url + path, params={"path": "/secret.txt"},
                      headers={"Authorization": f"Bearer {b.token}"})
        assert r.status_code in (401, 404) and b"tenant a" not in r.content, (path, r.status_code, r.text)
    r = httpx.get(f"{stack.api_url}/e2b/volumecontent/{b.volume_id}/file",
                  params={"path": f"/../{a.volume_id}/secret.txt"}, headers={"Authorization": f"Bearer {b.token}"})
    assert r.status_code == 404, r.text
    assert a.read_file("/secret.txt") == "tenant a's"


def test_a_volume_a_live_sandbox_holds_is_refused_with_409(stack: Stack, volumes: dict[str, Any]) -> None:
    vol = volumes["a2"]
    tenant = type("T", (), {"tenant_id": stack.tenant_id})()
    _, sbx = template_and_sandbox(stack, tenant, state="paused")
    sql(stack, "INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly) VALUES ($1, $2, 0, '/mnt/v',"
        " false)", sbx, vol.volume_id)
    try:
        r = httpx.get(f"{stack.api_url}/e2b/volumecontent/{vol.volume_id}/path", params={"path": "/"},
                      headers={"Authorization": f"Bearer {vol.token}"})
        assert r.status_code == 409 and sbx in r.json()["message"], r.text
    finally:
        sql(stack, "UPDATE sandboxes SET state='deleted', desired_state='deleted' WHERE id=$1", sbx)
    r = httpx.get(f"{stack.api_url}/e2b/volumecontent/{vol.volume_id}/path", params={"path": "/"},
                  headers={"Authorization": f"Bearer {vol.token}"})
    assert r.status_code == 200 and r.json()["type"] == "directory", r.text
