"""Suspend to object storage and resume anywhere, with real microVMs, PostgreSQL, JetStream and SeaweedFS.

- a counter process and a file survive suspend and resume (same pid, count goes on); no QEMU is left
  while suspended and the snapshot's objects are in the bucket;
- a second suspend of an idle sandbox uploads a small fraction of the first snapshot;
- retention keeps the suspend's promoted full snapshot beside the newest node-local ones;
- a corrupt chunk in the bucket makes the resume refuse with ``snapshot_corrupt`` and leaves the sandbox
  suspended; once the object is whole again the resume works;
- the resume lands on a second node agent (own data directory and node id) while the first is stopped,
  with the sandbox's volume fetched there from its promoted snapshot (the volume's home moves);
- SIGKILL of the snapshotter, the node agent or the API at named steps (``PODBAY_FAULT_STEP``) ends with
  the operation completed after a restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from podbay.chunks import chunk_key
from podbay.config import Settings
from podbay.devstack.netns import purge_networks
from podbay.devstack.procs import free_port, stop_process
from podbay.devstack.vms import kill_strays, unmount_node_stores
from podbay.objstore import open_store
from e2e_http import api_client, sh_output as _sh, new_sandbox, until

pytestmark = pytest.mark.e2e

COUNTER = (
    "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.tmp; mv /tmp/count.tmp /tmp/count;"
    " sleep 0.2; done' </dev/null >/dev/null 2>&1 & echo $! > /tmp/counter.pid"
)
OP_DEADLINE_S = 300.0


def _client(stack: Any) -> httpx.Client:
    return api_client(stack, timeout_s=600)



def _qemu_for(sid: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu" in cmd and sid.encode() in cmd:
                out.append(int(p.name))
    return out


def _wait_state(c: httpx.Client, sid: str, states: set[str], deadline_s: float = OP_DEADLINE_S) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = c.get(f"/v1/sandboxes/{sid}").json()
        if body["state"] in states:
            return body
        time.sleep(0.5)
    raise AssertionError(f"sandbox {sid} did not reach {states}: {body}")


def _suspend_snapshot(c: httpx.Client, sid: str) -> dict[str, Any]:
    snaps = [s for s in c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"] if s["promotion"] == "promoted"]
    assert snaps, "no promoted snapshot listed"
    return snaps[0]


def _s3(stack: Any) -> Settings:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", stack.env["AWS_ACCESS_KEY_ID"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", stack.env["AWS_SECRET_ACCESS_KEY"])
    return Settings(s3_url=stack.env["PODBAY_S3_URL"], s3_bucket=stack.env["PODBAY_S3_BUCKET"])


async def _manifest(stack: Any, snapshot_id: str) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(stack.pg_dsn)
    try:
        import json

        return json.loads(await conn.fetchval("SELECT manifest::text FROM snapshots WHERE id=$1", snapshot_id))
    finally:
        await conn.close()


def test_suspend_and_resume_keep_the_process_and_files(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        _sh(c, sid, "echo kept > /root/note; " + COUNTER)
        pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
        time.sleep(1.0)
        before = int(_sh(c, sid, "cat /tmp/count"))

        r = c.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "suspended" and r.json()["node_id"] is None
        assert _qemu_for(sid) == []
        assert not list(Path(stack.data_dir).glob(f"nodes/*/store/sandboxes/{sid}"))
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
        assert r.status_code == 409 and r.json()["error"]["details"]["state"] == "suspended"
        snap = _suspend_snapshot(c, sid)
        manifest = asyncio.run(_manifest(stack, snap["id"]))
        assert {f["name"] for f in manifest["files"]} == {"state", "ram", "disk.img"}

        async def heads() -> list[int | None]:
            async with open_store(_s3(stack)) as st:
                return [await st.head(chunk_key(f["chunks"][0])) for f in manifest["files"]]

        assert all(h is not None for h in asyncio.run(heads()))

        # Auto-resume on an exec call: the process carries on with its memory.
        r = c.post(f"/v1/sandboxes/{sid}/exec", params={"auto_resume": "true"},
                   json={"shell": f"cat /tmp/counter.pid; cat /root/note; kill -0 {pid} && echo alive"})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"].split() == [pid, "kept", "alive"]
        time.sleep(1.0)
        after = int(_sh(c, sid, "cat /tmp/count"))
        assert after > before
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"

        # Visible: promotion and restore durations, bytes up and down, chunk reuse as histograms.
        up = httpx.get(f"http://127.0.0.1:{stack.ports.snapshotter}/metrics").text
        # The node's /metrics needs the stack's internal token (services/nodeagent/dataplane/grant_check.py).
        down = httpx.get(f"http://127.0.0.1:{stack.ports.node}/metrics",
                         headers={"x-podbay-internal-token": stack.env.get("PODBAY_INTERNAL_TOKEN", "")}).text
        for text, names in ((up, ("podbay_promotion_seconds_count", "podbay_object_transfer_bytes_count",
                                   "podbay_chunk_reuse_ratio_count")),
                            (down, ("podbay_snapshot_fetch_seconds_count", "podbay_object_transfer_bytes_count",
                                    "podbay_chunk_reuse_ratio_count"))):
            for name in names:
                counts = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{")]
                assert counts and max(counts) >= 1, name


def test_a_long_paused_sandbox_whose_ram_was_released_suspends_and_resumes(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        _sh(c, sid, "echo slept > /root/z; " + COUNTER)
        pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
        assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        deadline = time.monotonic() + 60  # the stack fixture releases paused RAM after 6 s
        while _qemu_for(sid):
            assert time.monotonic() < deadline, "the paused sandbox's QEMU did not exit"
            time.sleep(0.5)
        r = c.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
        assert _qemu_for(sid) == []
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert _sh(c, sid, f"cat /root/z; kill -0 {pid} && echo alive").split() == ["slept", "alive"]


def test_a_failed_promotion_leaves_the_sandbox_paused_and_intact_with_the_error(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        _sh(c, sid, "echo intact > /root/i; " + COUNTER)
        pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
        stack.kill("s3")  # the object store is gone for the whole promotion and its retries
        try:
            r = c.post(f"/v1/sandboxes/{sid}/suspend")
        finally:
            stack.restart("s3")
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "suspend_failed" and "promotion failed" in err["message"]
        op = c.get(f"/v1/operations/{err['details']['operation_id']}").json()
        assert op["state"] == "failed" and op["error"]["code"] == "suspend_failed"
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert _sh(c, sid, f"cat /root/i; kill -0 {pid} && echo alive").split() == ["intact", "alive"]


def test_second_suspend_of_an_idle_sandbox_uploads_a_small_fraction(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
        first = _suspend_snapshot(c, sid)
        assert c.post(f"/v1/sandboxes/{sid}/resume").status_code == 200
        assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
        second = _suspend_snapshot(c, sid)
        assert second["id"] != first["id"]
        total = sum(f["size"] for f in asyncio.run(_manifest(stack, first["id"]))["files"])
        assert second["uploaded_bytes"] < 0.10 * total, (first, second, total)



def test_newer_local_full_snapshots_never_reclaim_the_only_promoted_one(stack: Any) -> None:
    # Defaults keep 3 full snapshots (PODBAY_RETAIN_FULL_SNAPSHOTS); the suspend's promoted one is kept as a
    # fourth, since the three newer ones are node-local and a node loss restores only from a promoted one.
    with _client(stack) as c, new_sandbox(c) as sid:
        assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
        durable = _suspend_snapshot(c, sid)
        assert c.post(f"/v1/sandboxes/{sid}/resume").status_code == 200
        newer = []
        for _ in range(3):
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code == 201, r.text
            newer.append(r.json()["id"])
        full = [s for s in c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"] if s["kind"] == "full"]
        assert [s["id"] for s in full] == [*reversed(newer), durable["id"]]
        assert full[-1]["promotion"] == "promoted"


def test_a_corrupt_chunk_is_refused_and_the_sandbox_stays_suspended(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        _sh(c, sid, "echo whole > /root/w")
        assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
        snap = _suspend_snapshot(c, sid)
        manifest = asyncio.run(_manifest(stack, snap["id"]))
        victim = next(f for f in manifest["files"] if f["name"] == "state")["chunks"][0]

        async def swap(data: bytes | None) -> bytes:
            async with open_store(_s3(stack)) as st:
                old = await st.get(chunk_key(victim))
                assert old is not None
                await st.put(chunk_key(victim), data if data is not None else old[:-8] + b"corrupt!")
                return old

        original = asyncio.run(swap(None))
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "snapshot_corrupt" and victim[:16] in err["message"]
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "suspended"
        op = c.get(f"/v1/operations/{err['details']['operation_id']}").json()
        assert op["state"] == "failed" and op["error"]["code"] == "snapshot_corrupt"

        asyncio.run(swap(original))
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert _sh(c, sid, "cat /root/w") == "whole\n"


def test_fallback_restores_the_newest_intact_snapshot_only_when_asked(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        _sh(c, sid, "echo one > /root/one; sync")
        assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
        first = _suspend_snapshot(c, sid)
        assert c.post(f"/v1/sandboxes/{sid}/resume").status_code == 200
        _sh(c, sid, "echo two > /root/two; sync")
        assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
        second = _suspend_snapshot(c, sid)
        assert second["id"] != first["id"]
        older = {h for f in asyncio.run(_manifest(stack, first["id"]))["files"] for h in f["chunks"]}
        newer = next(f for f in asyncio.run(_manifest(stack, second["id"]))["files"] if f["name"] == "state")
        victim = next(h for h in newer["chunks"] if h not in older)

        async def corrupt() -> None:
            async with open_store(_s3(stack)) as st:
                await st.put(chunk_key(victim), b"\x28\xb5\x2f\xfd" + b"not zstd at all")

        asyncio.run(corrupt())
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 502 and r.json()["error"]["code"] == "snapshot_corrupt", r.text
        r = c.post(f"/v1/sandboxes/{sid}/resume", params={"fallback": "true"})
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert _sh(c, sid, "cat /root/one; test -e /root/two && echo two-present || echo two-absent").split() == [
            "one", "two-absent"]


def test_resume_on_a_second_node_while_the_first_is_stopped(stack: Any, tmp_path: Path) -> None:
    node2_dir = Path(stack.data_dir) / "node2"
    port = free_port()
    with _client(stack) as c:
        vol = c.post("/v1/volumes", json={"name": "e2e-travel", "size_bytes": 64 << 20})
        assert vol.status_code == 201, vol.text
        r = c.post("/v1/sandboxes", json={"template": "base", "volumes": [{"name": "e2e-travel", "path": "/data"}]})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        node2: subprocess.Popen[bytes] | None = None
        try:
            # The second node gets the build cache's copy of this sandbox's template (the cache may hold newer
            # builds of "base", and a node takes the newest).
            digest = next(t["digest"] for t in c.get("/v1/templates").json()["templates"] if t["name"] == "base")
            cache = tmp_path / "cache"
            (cache / "templates").mkdir(parents=True)
            for meta in (Path(stack.env["PODBAY_CACHE_DIR"]) / "templates").glob("*/template.json"):
                if f'"{digest}"' in meta.read_text() or meta.parent.name.endswith(digest[:16]):
                    (cache / "templates" / meta.parent.name).symlink_to(meta.parent)
            env = {**stack.env, "PODBAY_NODE_ID": "node-2", "PODBAY_NODE_PORT": str(port),
                   "PODBAY_DATA_DIR": str(node2_dir), "PODBAY_CACHE_DIR": str(cache),
                   "PODBAY_SNAPSHOT_DISK_INTERVAL_S": "0"}
            first_node = c.get(f"/v1/sandboxes/{sid}").json()["node_id"]
            # The last line stays in the guest's page cache: the memory snapshot carries it, the volume's copy
            # has what was synced.
            _sh(c, sid, "echo travelled > /root/t; echo on-volume > /data/v; sync; echo unsynced >> /data/v; "
                + COUNTER)
            pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
            assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
            stack.kill("nodeagent", signal.SIGTERM)
            log = open(tmp_path / "node2.log", "wb")
            node2 = subprocess.Popen([str(Path(stack.bin_dir) / "podbay-nodeagent")], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert node2.poll() is None, (tmp_path / "node2.log").read_text()[-3000:]
                time.sleep(0.5)
            # The first node's heartbeat expires (TTL), so only node-2 is live: waited for as the API sees it
            # (every process computes a heartbeat's expiry from its stored time alike), plus a second.
            until("only node-2 is live", lambda: [n["id"] for n in c.get("/v1/nodes").json()["nodes"] if n["live"]]
                  == ["node-2"], 60)
            time.sleep(1)
            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200, r.text + (tmp_path / "node2.log").read_text()[-3000:]
            assert r.json()["node_id"] == "node-2" != first_node
            assert _sh(c, sid, f"cat /root/t; kill -0 {pid} && echo alive").split() == ["travelled", "alive"]
            assert _sh(c, sid, "cat /data/v; echo more >> /data/v; sync; cat /data/v").split() == [
                "on-volume", "unsynced", "on-volume", "unsynced", "more"]
            assert c.get("/v1/volumes/e2e-travel").json()["node_id"] == "node-2"
            c.delete(f"/v1/sandboxes/{sid}")
            until("the sandbox is deleted", lambda: c.get(f"/v1/sandboxes/{sid}").json()["state"] == "deleted", 60)
            assert c.delete("/v1/volumes/e2e-travel").status_code == 204
        finally:
            if node2 is not None:
                stop_process(node2, grace_s=10)
            # node-2's data dir is not the stack's, so the stack's purge would miss what it made on the host:
            # its VMs, its loop-mounted store and its nftables table (named after its data dir).
            kill_strays(node2_dir)
            unmount_node_stores(node2_dir)
            purge_networks(node2_dir)
            stack.restart("nodeagent")
            c.delete(f"/v1/sandboxes/{sid}")
            c.delete("/v1/volumes/e2e-travel")  # when an assertion failed above; refused while still attached


def _with_fault(stack: Any, service: str, step: str) -> None:
    svc = stack.services[service]
    svc.env = {**stack.env, "PODBAY_FAULT_STEP": step}
    stack.restart(service)


def _without_fault(stack: Any, service: str) -> None:
    svc = stack.services[service]
    svc.env = stack.env
    if svc.alive():
        stack.kill(service, signal.SIGKILL)
    stack.restart(service)


@pytest.mark.parametrize("service,step", [
    ("snapshotter", "promote.uploading"),
    ("snapshotter", "promote.verified"),
    ("nodeagent", "suspend.snapshotted"),
    ("nodeagent", "suspend.promoted"),
])
def test_sigkill_during_suspend_then_restart_completes_it(stack: Any, service: str, step: str) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "echo survived > /root/s; " + COUNTER)
            pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
            _with_fault(stack, service, step)
            r = c.post(f"/v1/sandboxes/{sid}/suspend", params={"wait": "false"})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + OP_DEADLINE_S
            while stack.services[service].alive():
                assert time.monotonic() < deadline, f"{service} never reached {step}"
                time.sleep(0.2)
            _without_fault(stack, service)
            body = _wait_state(c, sid, {"suspended", "paused", "failed"})
            assert body["state"] == "suspended", body
            assert _qemu_for(sid) == []
            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200, r.text
            assert _sh(c, sid, f"cat /root/s; kill -0 {pid} && echo alive").split() == ["survived", "alive"]
        finally:
            stack.services[service].env = stack.env
            c.delete(f"/v1/sandboxes/{sid}")


def test_sigkill_of_the_node_during_resume_then_restart_completes_it(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "echo back > /root/b")
            assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
            _with_fault(stack, "nodeagent", "resume.fetched")
            r = c.post(f"/v1/sandboxes/{sid}/resume", params={"wait": "false"})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + OP_DEADLINE_S
            while stack.services["nodeagent"].alive():
                assert time.monotonic() < deadline, "the node agent never reached resume.fetched"
                time.sleep(0.2)
            _without_fault(stack, "nodeagent")
            body = _wait_state(c, sid, {"running", "failed"})
            assert body["state"] == "running", body
            assert _sh(c, sid, "cat /root/b") == "back\n"
        finally:
            stack.services["nodeagent"].env = stack.env
            c.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("step", ["suspend.recorded", "resume.recorded"])
def test_sigkill_of_the_api_between_commit_and_publish_is_finished_by_its_restart(stack: Any, step: str) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "echo api > /root/a")
            if step == "resume.recorded":
                assert c.post(f"/v1/sandboxes/{sid}/suspend").status_code == 200
            _with_fault(stack, "api", step)
            verb = step.split(".")[0]
            with pytest.raises(httpx.HTTPError):
                c.post(f"/v1/sandboxes/{sid}/{verb}")
            deadline = time.monotonic() + 30
            while stack.services["api"].alive():  # the client may see the reset before the process is reaped
                assert time.monotonic() < deadline, "the API did not die at its fault step"
                time.sleep(0.1)
            _without_fault(stack, "api")
            want = "suspended" if verb == "suspend" else "running"
            body = _wait_state(c, sid, {want, "failed", "paused"})
            assert body["state"] == want, body
            if want == "running":
                assert _sh(c, sid, "cat /root/a") == "api\n"
        finally:
            stack.services["api"].env = stack.env
            if not stack.services["api"].alive():
                stack.restart("api")
            with _client(stack) as fresh:  # the old client's pooled connection went with the killed API
                fresh.delete(f"/v1/sandboxes/{sid}")


def test_sigkill_of_the_api_during_suspend_leaves_the_work_to_finish(stack: Any) -> None:
    with _client(stack) as c, new_sandbox(c) as sid:
        r = c.post(f"/v1/sandboxes/{sid}/suspend", params={"wait": "false"})
        assert r.status_code == 202, r.text
        op = r.json()["operation_id"]
        stack.kill("api", signal.SIGKILL)
        stack.restart("api")
        assert _wait_state(c, sid, {"suspended", "paused", "failed"})["state"] == "suspended"
        assert c.get(f"/v1/operations/{op}").json()["state"] == "succeeded"
