"""Snapshots, rollback and fork with real microVMs (docs/DESIGN.md §5)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client as _client, sh_output as _sh

pytestmark = pytest.mark.e2e

COUNTER = (
    "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i >> /tmp/counter; sleep 0.1; done'"
    " </dev/null >/dev/null 2>&1 & echo $! > /tmp/counter.pid"
)
# A process whose state lives only in its memory: on SIGUSR1 it writes its random secret to a file.
HOLDER = (
    "setsid python3 -c 'import random, signal, time\n"
    "s = random.random()\n"
    "signal.signal(signal.SIGUSR1, lambda *a: open(\"/tmp/secret\", \"w\").write(repr(s)))\n"
    "while True: time.sleep(1)' </dev/null >/dev/null 2>&1 & echo $! > /tmp/holder.pid"
)


def test_full_snapshot_and_rollback_bring_back_disk_and_memory(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "echo before > /tmp/state.txt; " + COUNTER)
            pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
            time.sleep(0.5)
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code == 201, r.text
            snap = r.json()
            assert snap["state"] == "ready" and snap["kind"] == "full" and snap["size_bytes"] > 0
            gen = c.get(f"/v1/sandboxes/{sid}").json()["generation"]

            time.sleep(1.0)
            _sh(c, sid, "echo after > /tmp/state.txt")
            count_before_rollback = len(_sh(c, sid, "cat /tmp/counter").split())

            listed = c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
            assert [s["id"] for s in listed] == [snap["id"]]

            r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": snap["id"]})
            assert r.status_code == 200, r.text
            info = r.json()
            assert info["id"] == sid and info["state"] == "running" and info["generation"] == gen + 1

            assert _sh(c, sid, "cat /tmp/state.txt") == "before\n"
            # the counter process is back at the snapshot's point: same pid, counting on from there
            assert _sh(c, sid, "cat /tmp/counter.pid").strip() == pid
            assert _sh(c, sid, f"kill -0 {pid} && echo alive").strip() == "alive"
            time.sleep(0.5)
            # Disk and memory went back together: had only the disk gone back, the process would go on from
            # its later count and leave a jump in the file.
            counts = [int(x) for x in _sh(c, sid, "cat /tmp/counter").split()]
            assert counts == list(range(1, len(counts) + 1))
            assert count_before_rollback > 0

            r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": "snap_nope"})
            assert r.status_code == 404
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_fork_children_share_memory_then_diverge(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        children: list[str] = []
        try:
            _sh(c, sid, HOLDER)
            time.sleep(1.0)
            pid = _sh(c, sid, "cat /tmp/holder.pid").strip()
            _sh(c, sid, f"kill -USR1 {pid}; sleep 0.5")
            secret = _sh(c, sid, "cat /tmp/secret")
            _sh(c, sid, "rm /tmp/secret")

            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
            assert r.status_code == 200, r.text
            body = r.json()
            children = [ch["sandbox_id"] for ch in body["children"]]
            assert len(children) == 3 and all(ch["state"] == "running" for ch in body["children"]), body

            randoms, hostnames = set(), set()
            for i, child in enumerate(children):
                # the in-memory secret came along
                assert _sh(c, child, f"kill -USR1 {pid}; sleep 0.5; cat /tmp/secret") == secret
                # then each child diverges on its own
                _sh(c, child, f"echo child-{i} > /tmp/mine")
                assert _sh(c, child, "cat /tmp/mine") == f"child-{i}\n"
                randoms.add(_sh(c, child, "head -c 16 /dev/urandom | od -An -tx1"))
                hostnames.add(_sh(c, child, "hostname").strip())
            assert len(randoms) == 3 and len(hostnames) == 3
            assert _sh(c, sid, "ls /tmp/mine 2>/dev/null; true") == ""  # the parent is untouched
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        finally:
            for child in children:
                c.delete(f"/v1/sandboxes/{child}")
            c.delete(f"/v1/sandboxes/{sid}")


def test_disk_snapshot_while_writing_is_a_clean_filesystem(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "setsid sh -c 'while true; do head -c 65536 /dev/urandom >> /tmp/w.bin;"
                        " echo x >> /tmp/w.log; done' </dev/null >/dev/null 2>&1 &")
            time.sleep(1.0)
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"})
            assert r.status_code == 201, r.text
            snap = r.json()
            assert snap["kind"] == "disk" and snap["state"] == "ready" and snap["paused_ms"] is not None
            disks = list(Path(stack.data_dir).glob(f"nodes/*/store/snapshots/{sid}/{snap['id']}/disk.img"))
            assert len(disks) == 1
            fsck = subprocess.run(["e2fsck", "-fn", str(disks[0])], capture_output=True, text=True)
            assert fsck.returncode == 0, fsck.stdout + fsck.stderr
            # the sandbox was thawed and still writes
            assert _sh(c, sid, "touch /tmp/after && echo ok") == "ok\n"
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_retention_keeps_the_newest_full_snapshots(stack: Any) -> None:
    # Defaults: keep 3 full snapshots per sandbox (PODBAY_RETAIN_FULL_SNAPSHOTS).
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            ids = []
            for _ in range(4):
                r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            listed = [s["id"] for s in c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]]
            assert listed == list(reversed(ids[1:]))
            root = next(Path(stack.data_dir).glob(f"nodes/*/store/snapshots/{sid}"))
            assert not (root / ids[0]).exists() and all((root / i / "state").exists() for i in ids[1:])
            # the reclaimed snapshot can no longer be restored
            assert c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": ids[0]}).status_code == 409
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
