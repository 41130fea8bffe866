"""Volumes with real microVMs (docs/ARCHITECTURE.md "Volumes"): data written by one sandbox is read by the
next after the first is deleted; one read-write attach at a time, read-only by many; a volume in use cannot
be deleted; suspend (which promotes the volume to the object store) and wake (fetched back) and a rollback
to a disk snapshot have the volume back at its path, as it is now; a full-snapshot rollback is refused unless
the volume is asked to roll back with it (then it goes back to its copy in the snapshot); a fork
child sees the volume read-only as of the fork, or gets its own read-write copy when asked; a deleted
volume's file leaves the node. A volume no sandbox holds is restored to an older snapshot of its own (SDK
and CLI), on the node that holds its file and from object storage once no node does.
tests/e2e/test_suspend.py wakes a sandbox with a volume on another node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from podbay.sdk import Client

from e2e_http import api_client, sh, sh_output, until

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def _create(c: httpx.Client, *volumes: dict[str, Any]) -> httpx.Response:
    return c.post("/v1/sandboxes", json={"template": "base", "volumes": list(volumes)})


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


def test_a_volume_outlives_its_sandbox_one_writer_many_readers(stack: Any) -> None:
    with api_client(stack) as c:
        r = c.post("/v1/volumes", json={"name": "e2e-data", "size_bytes": 256 * MIB})
        assert r.status_code == 201, r.text
        vol_id = r.json()["id"]
        first = _create(c, {"name": "e2e-data", "path": "/mnt/data"})
        assert first.status_code == 201, first.text
        a = first.json()["id"]
        # The guest sees the volume's capacity and an ext4 filesystem at the path.
        df = sh(c, a, "df -P -k /mnt/data | tail -1; stat -f -c %T /mnt/data; cat /proc/mounts | grep ' /mnt/data '")
        assert "/mnt/data" in df and "ext2/ext3" in df and " rw," in df, df
        assert 200_000 < int(df.split()[1]) <= 256 * 1024, df  # KiB: ext4's overhead aside, the whole volume
        sh(c, a, "echo written-by-a > /mnt/data/note && mkdir -p /mnt/data/dir && head -c 1048576 /dev/urandom"
                 " > /mnt/data/dir/blob && sha256sum /mnt/data/dir/blob > /mnt/data/blob.sum && sync")
        info = c.get("/v1/volumes/e2e-data").json()
        assert info["node_id"] == first.json()["node_id"] and info["attachments"] == [
            {"sandbox_id": a, "path": "/mnt/data", "readonly": False}]

        # One writer at a time: a second attach, read-write or read-only, is refused and creates nothing.
        count = len(c.get("/v1/sandboxes").json()["sandboxes"])
        for ro in (False, True):
            again = _create(c, {"name": "e2e-data", "path": "/data", "readonly": ro})
            assert again.status_code == 409 and _code(again) == "volume_in_use", again.text
            assert again.json()["error"]["details"]["sandbox_ids"] == [a]
        assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == count
        busy = c.delete("/v1/volumes/e2e-data")
        assert busy.status_code == 409 and _code(busy) == "volume_in_use"

        # Suspend (to the object store) and wake: the guest's memory has the volume mounted, and the wake puts
        # the volume back under it (the same node: the volume's file lives there).
        r = c.post(f"/v1/sandboxes/{a}/suspend")
        assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
        r = c.post(f"/v1/sandboxes/{a}/resume")
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert sh(c, a, "cat /mnt/data/note") == "written-by-a\n"
        # The suspend promoted the volume's own snapshot (the wake fetched it back).
        snaps = c.get("/v1/volumes/e2e-data/snapshots").json()["snapshots"]
        assert (snaps[0]["reason"], snaps[0]["state"], snaps[0]["current"]) == ("suspend", "promoted", True), snaps
        assert sh(c, a, "echo after-wake >> /mnt/data/note; sync; cat /mnt/data/note") == "written-by-a\nafter-wake\n"

        # Volumes are not rolled back with their sandbox: a rollback to a disk snapshot boots the guest and
        # mounts the volume as it is now; one to a full snapshot (memory with a stale mount) is refused.
        disk = c.post(f"/v1/sandboxes/{a}/snapshots", json={"kind": "disk"})
        assert disk.status_code in (200, 201), disk.text
        full = c.post(f"/v1/sandboxes/{a}/snapshots", json={"kind": "full"})
        assert full.status_code in (200, 201), full.text
        sh(c, a, "echo after-snapshot > /mnt/data/later && sync")
        refused = c.post(f"/v1/sandboxes/{a}/restore", json={"snapshot_id": full.json()["id"]})
        assert refused.status_code == 409 and refused.json()["error"]["details"]["volumes"] == ["e2e-data"]
        # A fork child sees the volume read-only, as it was at the fork; the parent's later writes are not in it.
        fork = c.post(f"/v1/sandboxes/{a}/fork", json={"count": 1})
        assert fork.status_code == 200, fork.text
        child = fork.json()["children"][0]
        assert child["state"] == "running", child
        sh(c, a, "echo after-fork > /mnt/data/parent-only && sync")
        out = sh_output(c, child["sandbox_id"], "cat /mnt/data/later; grep ' /mnt/data ' /proc/mounts;"
                        " (echo x > /mnt/data/child) 2>&1; echo rc=$?; ls /mnt/data")
        assert out.startswith("after-snapshot\n") and " ro," in out, out
        assert "Read-only file system" in out and "rc=0" not in out and "parent-only" not in out, out
        # Asked for: a copy of its own, read-write, that the parent never sees and that outlives the child.
        fork = c.post(f"/v1/sandboxes/{a}/fork", json={"count": 1, "volumes": "copy"})
        assert fork.status_code == 200 and fork.json()["children"][0]["state"] == "running", fork.text
        copier = fork.json()["children"][0]["sandbox_id"]
        assert sh(c, copier, "cat /mnt/data/parent-only; echo mine > /mnt/data/child && sync && cat /mnt/data/child"
                  ) == "after-fork\nmine\n"
        copy_name = f"e2e-data-{copier.removeprefix('sbx_')[:12]}"
        copies = [v for v in c.get("/v1/volumes").json()["volumes"] if v["name"] == copy_name]
        assert copies and copies[0]["attachments"] == [{"sandbox_id": copier, "path": "/mnt/data", "readonly": False}]
        assert "child" not in sh(c, a, "ls /mnt/data")
        for sid in (child["sandbox_id"], copier):
            assert c.delete(f"/v1/sandboxes/{sid}").status_code in (200, 202)
        assert c.get(f"/v1/volumes/{copy_name}").status_code == 200
        assert c.delete(f"/v1/volumes/{copy_name}").status_code == 204
        back = c.post(f"/v1/sandboxes/{a}/restore", json={"snapshot_id": disk.json()["id"]})
        assert back.status_code == 200, back.text
        assert sh(c, a, "cat /mnt/data/later /mnt/data/note") == "after-snapshot\nwritten-by-a\nafter-wake\n"
        # Asked for, a rollback to a full snapshot takes the read-write volume back with it, to its copy in the
        # snapshot (a disk snapshot holds none).
        r = c.post(f"/v1/sandboxes/{a}/restore", json={"snapshot_id": disk.json()["id"], "volumes": True})
        assert r.status_code == 400, r.text
        sh(c, a, "echo in-snapshot > /mnt/data/mark && sync")
        full = c.post(f"/v1/sandboxes/{a}/snapshots", json={"kind": "full"})
        assert full.status_code in (200, 201), full.text
        sh(c, a, "echo after > /mnt/data/mark2 && rm /mnt/data/mark && sync")
        back = c.post(f"/v1/sandboxes/{a}/restore", json={"snapshot_id": full.json()["id"], "volumes": True})
        assert back.status_code == 200 and back.json()["state"] == "running", back.text
        assert sh(c, a, "cat /mnt/data/mark; test -e /mnt/data/mark2 && echo kept || echo gone") == "in-snapshot\ngone\n"
        names = [v["name"] for v in c.get("/v1/volumes").json()["volumes"]]
        assert names.count("e2e-data") == 1, names  # a fork child's view is not listed

        assert c.delete(f"/v1/sandboxes/{a}").status_code in (200, 202)
        # The next sandbox reads what the first wrote (the volume survived its deletion).
        second = _create(c, {"name": "e2e-data", "path": "/work/data"})
        assert second.status_code == 201, second.text
        b = second.json()["id"]
        assert sh(c, b, "cat /work/data/note") == "written-by-a\nafter-wake\n"
        assert "OK" in sh(c, b, "cd /work/data && sed 's#/mnt/data#/work/data#' blob.sum | sha256sum -c")
        assert c.delete(f"/v1/sandboxes/{b}").status_code in (200, 202)

        # Read-only by many at once: both read, neither can write.
        readers = [_create(c, {"name": "e2e-data", "path": "/ro", "readonly": True}) for _ in range(2)]
        assert all(r.status_code == 201 for r in readers), [r.text for r in readers]
        rw = _create(c, {"name": "e2e-data", "path": "/rw"})
        assert rw.status_code == 409 and _code(rw) == "volume_in_use"
        for r in readers:
            sid = r.json()["id"]
            assert sh(c, sid, "cat /ro/later") == "after-snapshot\n"
            out = sh_output(c, sid, "(echo x > /ro/new) 2>&1; echo rc=$?")
            assert "Read-only file system" in out and "rc=0" not in out, out
            assert c.delete(f"/v1/sandboxes/{sid}").status_code in (200, 202)

        # Deleted: the row goes and so does its file on the node.
        assert c.delete("/v1/volumes/e2e-data").status_code == 204
        vol_file = Path(stack.data_dir) / "nodes" / info["node_id"] / "store" / "volumes" / f"{vol_id}.img"
        until("the deleted volume's file is removed", lambda: not vol_file.exists(), 60)
        assert c.get("/v1/volumes/e2e-data").status_code == 404


def _current_snapshot(c: httpx.Client, name: str) -> str:
    return next(s["id"] for s in c.get(f"/v1/volumes/{name}/snapshots").json()["snapshots"] if s["current"])


def _deleted(c: httpx.Client, sid: str) -> None:
    assert c.delete(f"/v1/sandboxes/{sid}").status_code in (200, 202)
    until(f"{sid} deleted", lambda: c.get(f"/v1/sandboxes/{sid}").json()["state"] == "deleted", 120)


def test_a_volume_is_restored_to_an_older_snapshot_on_its_node_and_from_object_storage(stack: Any) -> None:
    mount = {"name": "e2e-rewind", "path": "/mnt/r"}
    with api_client(stack, timeout_s=600) as c, Client(stack.api_url, stack.api_key, timeout_s=600) as sdk:
        assert c.post("/v1/volumes", json={"name": "e2e-rewind", "size_bytes": 64 * MIB}).status_code == 201
        r = _create(c, mount)
        assert r.status_code == 201, r.text
        a = r.json()["id"]
        sh(c, a, "echo one > /mnt/r/f && sync")
        # A suspend promotes the volume's own snapshot (it holds "one"); the wake fetches it back.
        assert c.post(f"/v1/sandboxes/{a}/suspend").status_code == 200
        one = _current_snapshot(c, "e2e-rewind")
        assert c.post(f"/v1/sandboxes/{a}/resume").status_code == 200
        sh(c, a, "echo two > /mnt/r/f && sync")
        busy = c.post("/v1/volumes/e2e-rewind/restore", json={"snapshot_id": one})
        assert busy.status_code == 409 and _code(busy) == "volume_in_use" and a in busy.text
        _deleted(c, a)

        # On its node: the file there holds "two"; the restore rebuilds it from that file at the next attach.
        node = c.get("/v1/volumes/e2e-rewind").json()["node_id"]
        assert node is not None
        assert sdk.volumes.restore("e2e-rewind", one).name == "e2e-rewind"
        r = _create(c, mount)
        assert r.status_code == 201, r.text
        b = r.json()
        assert b["node_id"] == node
        assert sh(c, b["id"], "cat /mnt/r/f") == "one\n"
        sh(c, b["id"], "echo three > /mnt/r/f && sync")
        # Suspended, the volume leaves every node (its truth is in object storage) and the sandbox is deleted.
        assert c.post(f"/v1/sandboxes/{b['id']}/suspend").status_code == 200
        assert _current_snapshot(c, "e2e-rewind") != one
        _deleted(c, b["id"])
        assert c.get("/v1/volumes/e2e-rewind").json()["node_id"] is None

        # From object storage, through the CLI: the next sandbox fetches the chosen snapshot.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
        env.update({"PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": stack.api_key})
        out = subprocess.run([sys.executable, "-m", "podbay.cli.main", "volume", "restore", "e2e-rewind", one],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0 and out.stdout.strip() == "e2e-rewind", out.stdout + out.stderr
        assert _current_snapshot(c, "e2e-rewind") == one
        r = _create(c, mount)
        assert r.status_code == 201, r.text
        d = r.json()["id"]
        assert sh(c, d, "cat /mnt/r/f") == "one\n"
        _deleted(c, d)
        assert c.delete("/v1/volumes/e2e-rewind").status_code == 204
