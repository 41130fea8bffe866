"""``/v1/volumes`` and the volume checks of ``POST /v1/sandboxes`` against the real API and PostgreSQL: every
refusal is a 4xx with its code and leaves no row behind (no VM is started: each create here is refused)."""

from __future__ import annotations

import secrets

import httpx
import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.config import Settings
from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration

GIB = 1 << 30


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "vol-acme")


@pytest.fixture(scope="module")
def other(stack: Stack) -> Tenant:
    return new_tenant(stack, "vol-other")


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


def _sandboxes(stack: Stack, tenant: Tenant) -> int:
    return int(sql(stack, "SELECT count(*) AS n FROM sandboxes WHERE tenant_id=$1", tenant.tenant_id)[0]["n"])


def test_create_list_get_delete(stack: Stack, acme: Tenant) -> None:
    with acme.http() as http:
        r = http.post("/v1/volumes", json={"name": "data", "size_bytes": 10 * GIB})
        assert r.status_code == 201, r.text
        vol = r.json()
        assert vol["name"] == "data" and vol["size_bytes"] == 10 * GIB and vol["node_id"] is None
        assert vol["attachments"] == [] and vol["id"].startswith("vol_")
        dup = http.post("/v1/volumes", json={"name": "data", "size_bytes": GIB})
        assert dup.status_code == 409 and _code(dup) == "conflict"
        assert [v["name"] for v in http.get("/v1/volumes").json()["volumes"]] == ["data"]
        assert http.get("/v1/volumes/data").json()["id"] == vol["id"]
        assert http.delete("/v1/volumes/data").status_code == 204
        assert http.get("/v1/volumes/data").status_code == 404
        # A volume that never had a file is gone at once, and its name is free again.
        assert sql(stack, "SELECT id FROM volumes WHERE id=$1", vol["id"]) == []
        assert http.post("/v1/volumes", json={"name": "data", "size_bytes": GIB}).status_code == 201


def test_bad_volume_bodies(stack: Stack, acme: Tenant) -> None:
    limit = Settings().volume_max_size_gib  # the stack's services read the same environment
    with acme.http() as http:
        big = http.post("/v1/volumes", json={"name": "huge", "size_bytes": (limit + 1) * GIB})
        assert big.status_code == 400 and _code(big) == "volume_too_large"
        assert big.json()["error"]["details"]["max_bytes"] == limit * GIB
        for body in ({"name": "Bad Name", "size_bytes": GIB}, {"name": "tiny", "size_bytes": 1024},
                     {"name": "x", "size_bytes": GIB, "extra": 1}):
            r = http.post("/v1/volumes", json=body)
            assert 400 <= r.status_code < 500, (body, r.text)
        assert http.get("/v1/volumes/huge").status_code == 404


def test_another_tenants_volume_is_not_found(stack: Stack, acme: Tenant, other: Tenant) -> None:
    with acme.http() as http:
        assert http.post("/v1/volumes", json={"name": "private", "size_bytes": GIB}).status_code == 201
    before = _sandboxes(stack, other)
    with other.http() as http:
        assert http.get("/v1/volumes/private").status_code == 404
        assert http.delete("/v1/volumes/private").status_code == 404
        assert "private" not in [v["name"] for v in http.get("/v1/volumes").json()["volumes"]]
        r = http.post("/v1/sandboxes", json={"template": "base",
                                             "volumes": [{"name": "private", "path": "/mnt/data"}]})
        assert r.status_code == 404 and _code(r) == "not_found", r.text
    assert _sandboxes(stack, other) == before
    with acme.http() as http:
        assert http.get("/v1/volumes/private").status_code == 200


@pytest.mark.parametrize(("path", "code"), [
    ("mnt/data", "invalid_volume_path"), ("/", "invalid_volume_path"), ("/etc", "invalid_volume_path"),
    ("/usr/local/data", "invalid_volume_path"), ("/proc/x", "invalid_volume_path"),
    ("/mnt/../etc", "invalid_volume_path"), ("/mnt/data/", "invalid_volume_path"),
])
def test_a_refused_attach_creates_nothing(stack: Stack, acme: Tenant, path: str, code: str) -> None:
    with acme.http() as http:
        http.post("/v1/volumes", json={"name": "paths", "size_bytes": GIB})
        before = _sandboxes(stack, acme)
        r = http.post("/v1/sandboxes", json={"template": "base", "volumes": [{"name": "paths", "path": path}]})
        assert r.status_code == 400 and _code(r) == code, r.text
        assert _sandboxes(stack, acme) == before
        assert http.get("/v1/volumes/paths").json()["attachments"] == []


def test_missing_doubled_and_too_many_volumes(stack: Stack, acme: Tenant) -> None:
    with acme.http() as http:
        http.post("/v1/volumes", json={"name": "paths", "size_bytes": GIB})
        before = _sandboxes(stack, acme)
        missing = http.post("/v1/sandboxes", json={"template": "base",
                                                   "volumes": [{"name": "nope", "path": "/mnt/data"}]})
        assert missing.status_code == 404 and _code(missing) == "not_found"
        twice = http.post("/v1/sandboxes", json={"template": "base", "volumes": [
            {"name": "paths", "path": "/a"}, {"name": "paths", "path": "/b", "readonly": True}]})
        assert twice.status_code == 400, twice.text
        nested = http.post("/v1/volumes", json={"name": "second", "size_bytes": GIB})
        assert nested.status_code == 201
        overlap = http.post("/v1/sandboxes", json={"template": "base", "volumes": [
            {"name": "paths", "path": "/data"}, {"name": "second", "path": "/data/inner"}]})
        assert overlap.status_code == 400 and _code(overlap) == "invalid_volume_path"
        five = http.post("/v1/sandboxes", json={"template": "base", "volumes": [
            {"name": "paths", "path": f"/v{i}", "readonly": True} for i in range(5)]})
        assert 400 <= five.status_code < 500
        assert _sandboxes(stack, acme) == before


def test_a_node_with_read_only_volume_sandboxes_is_not_drained(stack: Stack, acme: Tenant) -> None:
    # A read-only volume stays on its node (others may read it); read-write ones move by suspend and wake
    # (tests/e2e/test_drain.py).
    # Rows as the API and scheduler write them, on a node of this test's own (no VM is started).
    node, sid = f"vn-{secrets.token_hex(3)}", f"sbx_{secrets.token_hex(10)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
               " ($1, 'http://127.0.0.1:1', 1024, 2, 'tcg', 'ready')", node)
    with acme.http() as http:
        vol = http.post("/v1/volumes", json={"name": "drained", "size_bytes": GIB}).json()
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
               " vcpus, hostname, node_id) VALUES ($1, $2, 'base', 'x', 'running', 'running', 256, 1, 'h', $3)",
        sid, acme.tenant_id, node)
    sql(stack, "INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly) VALUES"
               " ($1, $2, 0, '/mnt/data', true)", sid, vol["id"])
    with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"}) as op:
        r = op.post(f"/v1/nodes/{node}/drain")
    assert r.status_code == 409 and _code(r) == "volume_in_use" and r.json()["error"]["details"]["sandbox_ids"] == [sid]
    assert sql(stack, "SELECT state FROM nodes WHERE id=$1", node)[0]["state"] == "ready"
    sql(stack, "UPDATE sandboxes SET state='deleted' WHERE id=$1", sid)


def test_a_volumes_own_snapshots_are_listed_newest_first(stack: Stack, acme: Tenant, other: Tenant) -> None:
    with acme.http() as http:
        vol = http.post("/v1/volumes", json={"name": "snaps", "size_bytes": GIB}).json()
        assert vol["snapshot_at"] is None
        assert http.get("/v1/volumes/snaps/snapshots").json() == {"snapshots": []}
        old, new = f"vsnap_{secrets.token_hex(10)}", f"vsnap_{secrets.token_hex(10)}"
        for snap, reason, age in ((old, "cadence", 300), (new, "suspend", 1)):
            sql(stack, "INSERT INTO volume_snapshots (id, volume_id, node_id, reason, state, taken_at, promoted_at,"
                " total_bytes, uploaded_bytes) VALUES ($1,$2,'n',$3,'promoted', now() - make_interval(secs => $4),"
                " now(), $5, 4096)", snap, vol["id"], reason, float(age), GIB)
        sql(stack, "UPDATE volumes SET snapshot_id=$2, snapshot_at=now() WHERE id=$1", vol["id"], new)
        listed = http.get("/v1/volumes/snaps/snapshots").json()["snapshots"]
        assert [(s["id"], s["reason"], s["current"]) for s in listed] == [(new, "suspend", True),
                                                                           (old, "cadence", False)]
        assert listed[0]["total_bytes"] == GIB and listed[0]["uploaded_bytes"] == 4096
        assert http.get("/v1/volumes/snaps").json()["snapshot_at"] is not None
    with other.http() as http:
        assert http.get("/v1/volumes/snaps/snapshots").status_code == 404


def test_a_volume_is_restored_to_its_own_promoted_snapshot_only_while_unattached(
        stack: Stack, acme: Tenant, other: Tenant) -> None:
    # Snapshot rows as the snapshotter writes them (the data path runs in tests/e2e/test_volumes.py).
    with acme.http() as http:
        vol = http.post("/v1/volumes", json={"name": "rewind", "size_bytes": GIB}).json()
        mate = http.post("/v1/volumes", json={"name": "rewind-mate", "size_bytes": GIB}).json()
        old, new, failed, foreign = (f"vsnap_{secrets.token_hex(10)}" for _ in range(4))
        for snap, vid, state, age in ((old, vol["id"], "promoted", 300), (new, vol["id"], "promoted", 1),
                                      (failed, vol["id"], "failed", 100), (foreign, mate["id"], "promoted", 1)):
            sql(stack, "INSERT INTO volume_snapshots (id, volume_id, node_id, reason, state, taken_at) VALUES"
                " ($1,$2,'n','cadence',$3, now() - make_interval(secs => $4))", snap, vid, state, float(age))
        sql(stack, "UPDATE volumes SET snapshot_id=$2, snapshot_at=now() WHERE id=$1", vol["id"], new)

        for snap, status, code in ((f"vsnap_{secrets.token_hex(10)}", 404, "not_found"), (foreign, 404, "not_found"),
                                   (failed, 409, "invalid_state")):
            r = http.post("/v1/volumes/rewind/restore", json={"snapshot_id": snap})
            assert r.status_code == status and _code(r) == code, r.text
        assert http.post("/v1/volumes/nope/restore", json={"snapshot_id": old}).status_code == 404
        assert http.post("/v1/volumes/rewind/restore", json={}).status_code == 422

        r = http.post("/v1/volumes/rewind/restore", json={"snapshot_id": old})
        assert r.status_code == 200, r.text
        row = sql(stack, "SELECT snapshot_id, released_at FROM volumes WHERE id=$1", vol["id"])[0]
        assert row["snapshot_id"] == old and row["released_at"] is not None
        listed = http.get("/v1/volumes/rewind/snapshots").json()["snapshots"]
        assert [s["id"] for s in listed if s["current"]] == [old]
        assert sql(stack, "SELECT count(*) AS n FROM audit_log WHERE action='volume.restore' AND target=$1",
                   vol["id"])[0]["n"] == 1

    # Another tenant's volume is not found, and nothing changes.
    with other.http() as http:
        r = http.post("/v1/volumes/rewind/restore", json={"snapshot_id": new})
        assert r.status_code == 404 and _code(r) == "not_found"
    assert sql(stack, "SELECT snapshot_id FROM volumes WHERE id=$1", vol["id"])[0]["snapshot_id"] == old

    # Attached to a sandbox that is not deleted (a suspended one too): refused, and nothing changes.
    sid = f"sbx_{secrets.token_hex(10)}"
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
               " vcpus, hostname) VALUES ($1, $2, 'base', 'x', 'suspended', 'running', 256, 1, 'h')",
        sid, acme.tenant_id)
    sql(stack, "INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly) VALUES"
               " ($1, $2, 0, '/mnt/data', false)", sid, vol["id"])
    with acme.http() as http:
        r = http.post("/v1/volumes/rewind/restore", json={"snapshot_id": new})
        assert r.status_code == 409 and _code(r) == "volume_in_use", r.text
        assert r.json()["error"]["details"]["sandbox_ids"] == [sid]
    assert sql(stack, "SELECT snapshot_id FROM volumes WHERE id=$1", vol["id"])[0]["snapshot_id"] == old
    sql(stack, "UPDATE sandboxes SET state='deleted' WHERE id=$1", sid)
