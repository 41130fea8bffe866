"""Change sets between two snapshots of one sandbox, with real microVMs (docs/ARCHITECTURE.md, snapshots)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from e2e_http import api_client as _client, sh as _sh

pytestmark = pytest.mark.e2e

# /tmp is a tmpfs in the guest and never reaches the disk: work under /root.
SETUP = ("mkdir -p /root/diffcase && echo keep > /root/diffcase/changed.txt"
         " && echo doomed > /root/diffcase/removed.txt && sync")
STEP = ("echo brand-new-file > /root/diffcase/added.txt && echo 'changed, and longer' > /root/diffcase/changed.txt"
        " && rm /root/diffcase/removed.txt && sync")


def _snapshot(c: httpx.Client, sid: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"})
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "ready"
    return str(r.json()["id"])


def test_diff_between_two_disk_snapshots_lists_the_step(stack: Any) -> None:
    with _client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            _sh(c, sid, SETUP)
            snap_a = _snapshot(c, sid)
            _sh(c, sid, STEP)
            snap_b = _snapshot(c, sid)

            r = c.get(f"/v1/sandboxes/{sid}/snapshots/{snap_a}/diff/{snap_b}")
            assert r.status_code == 200, r.text
            diff = r.json()
            assert diff["from_snapshot_id"] == snap_a and diff["to_snapshot_id"] == snap_b
            by_path = {e["path"]: e for e in diff["entries"]}
            assert by_path["/root/diffcase/added.txt"] == {
                "path": "/root/diffcase/added.txt", "change": "added", "kind": "file",
                "size": len("brand-new-file\n")}
            assert by_path["/root/diffcase/changed.txt"] == {
                "path": "/root/diffcase/changed.txt", "change": "changed", "kind": "file",
                "size": len("changed, and longer\n")}
            assert by_path["/root/diffcase/removed.txt"] == {
                "path": "/root/diffcase/removed.txt", "change": "removed", "kind": "file", "size": len("doomed\n")}
            paths = [e["path"] for e in diff["entries"]]
            assert paths == sorted(paths)
            assert diff["truncated"] is False
            assert diff["added"] + diff["changed"] + diff["removed"] == len(paths)
            assert diff["added"] >= 1 and diff["changed"] >= 1 and diff["removed"] >= 1

            # the other way round, the roles swap
            back = c.get(f"/v1/sandboxes/{sid}/snapshots/{snap_b}/diff/{snap_a}").json()
            back_by_path = {e["path"]: e["change"] for e in back["entries"]}
            assert back_by_path["/root/diffcase/added.txt"] == "removed"
            assert back_by_path["/root/diffcase/removed.txt"] == "added"
            assert back_by_path["/root/diffcase/changed.txt"] == "changed"

            # a snapshot against itself is empty
            same = c.get(f"/v1/sandboxes/{sid}/snapshots/{snap_a}/diff/{snap_a}").json()
            assert same["entries"] == [] and same["added"] == same["changed"] == same["removed"] == 0

            # still available while the sandbox is paused
            assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
            r = c.get(f"/v1/sandboxes/{sid}/snapshots/{snap_a}/diff/{snap_b}")
            assert r.status_code == 200, r.text
            assert r.json()["entries"] == diff["entries"]

            r = c.get(f"/v1/sandboxes/{sid}/snapshots/{snap_a}/diff/snap_nope")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = c.get(f"/v1/sandboxes/sbx_nope/snapshots/{snap_a}/diff/{snap_b}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
