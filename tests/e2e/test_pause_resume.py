"""Pause and resume in memory: processes carry on as if nothing happened (real microVMs)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from e2e_http import api_client as _client, sh_output as _sh

pytestmark = pytest.mark.e2e

COUNTER = (
    "setsid sh -c 'i=0; while true; do i=$((i+1)); echo \"$i $(date +%s.%N)\" >> /tmp/counter; sleep 0.1; done'"
    " </dev/null >/dev/null 2>&1 & echo $! > /tmp/counter.pid"
)


def test_counter_process_carries_on_after_pause(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, COUNTER)
            pid = _sh(c, sid, "cat /tmp/counter.pid").strip()
            time.sleep(1.0)
            r = c.post(f"/v1/sandboxes/{sid}/pause")
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "paused"
            paused_at = time.time()

            # While paused: no exec, no second pause, and the VM is stopped.
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            assert r.status_code == 409 and r.json()["error"]["details"]["state"] == "paused"
            assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 409
            time.sleep(2.0)

            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            resumed_at = time.time()
            assert c.post(f"/v1/sandboxes/{sid}/resume").status_code == 409
            time.sleep(1.0)

            assert _sh(c, sid, "cat /tmp/counter.pid").strip() == pid
            assert _sh(c, sid, f"kill -0 {pid} && echo alive").strip() == "alive"
            lines = [ln.split() for ln in _sh(c, sid, "cat /tmp/counter").splitlines() if ln.strip()]
            counts = [int(n) for n, _ in lines]
            stamps = [float(t) for _, t in lines]
            # Same process, same memory: the count goes on by one with no restart ...
            assert counts == list(range(1, len(counts) + 1))
            # ... and the largest gap between two ticks spans the pause.
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            assert max(gaps) >= (resumed_at - paused_at) * 0.8
            assert sum(1 for g in gaps if g > 1.0) == 1
        finally:
            c.delete(f"/v1/sandboxes/{sid}")

    from nats.aio.client import Client  # noqa: F401  # events are checked in test_sandbox_api


def test_long_paused_sandbox_releases_its_ram_and_resumes_intact(stack: Any) -> None:
    import os
    from pathlib import Path

    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "echo kept > /root/kept.txt; " + COUNTER.replace("/tmp/counter", "/root/counter"))
            pid = _sh(c, sid, "cat /root/counter.pid").strip()
            time.sleep(1.0)
            vm_dir = next(Path(stack.data_dir).glob(f"nodes/*/store/sandboxes/{sid}"))
            qemu_pid = int((vm_dir / "qemu.pid").read_text())
            assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
            # After the grace period (6 s in the test stack) QEMU exits and the state waits on disk.
            # The state is complete (hib/ in place) before QEMU is stopped and the live RAM file removed, so wait
            # for the whole release, not just its first step.
            def qemu_gone() -> bool:
                try:
                    return b"qemu" not in Path(f"/proc/{qemu_pid}/cmdline").read_bytes()
                except OSError:
                    return True

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not ((vm_dir / "hib" / "state").exists() and qemu_gone()
                                                       and not (vm_dir / "ram").exists()):
                time.sleep(0.5)
            assert (vm_dir / "hib" / "state").exists()
            assert qemu_gone()
            assert not (vm_dir / "ram").exists()
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
            assert c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}).status_code == 409

            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            assert not (vm_dir / "hib").exists()
            assert _sh(c, sid, "cat /root/kept.txt") == "kept\n"
            assert _sh(c, sid, f"kill -0 {pid} && echo alive").strip() == "alive"
            time.sleep(0.5)
            lines = [ln.split() for ln in _sh(c, sid, "cat /root/counter").splitlines() if ln.strip()]
            counts = [int(n) for n, _ in lines]
            assert counts == list(range(1, len(counts) + 1))  # the same process went on counting
            assert os.path.exists(vm_dir / "qemu.pid")
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_a_released_paused_sandbox_can_be_snapshotted_and_forked(stack: Any) -> None:
    """A long-paused sandbox whose RAM was released (QEMU gone) still takes disk and full snapshots and forks:
    the node restores it, still paused, for the snapshot. Before, each was refused with 409 (seen in the soak)."""
    from pathlib import Path

    children: list[str] = []
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            _sh(c, sid, "echo kept > /root/kept.txt")
            vm_dir = next(Path(stack.data_dir).glob(f"nodes/*/store/sandboxes/{sid}"))
            qemu_pid = int((vm_dir / "qemu.pid").read_text())
            assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200

            def released() -> bool:
                try:
                    alive = b"qemu" in Path(f"/proc/{qemu_pid}/cmdline").read_bytes()
                except OSError:
                    alive = False
                return not alive and (vm_dir / "hib" / "state").exists() and not (vm_dir / "ram").exists()

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not released():
                time.sleep(0.5)
            assert released()

            snaps = {}
            for kind in ("disk", "full"):
                r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": kind})
                assert r.status_code == 201, r.text
                assert r.json()["state"] == "ready", r.json()
                snaps[kind] = r.json()["id"]
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"  # still paused for its owner

            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
            assert r.status_code == 200, r.text
            children = [ch["sandbox_id"] for ch in r.json()["children"]]
            assert _sh(c, children[0], "cat /root/kept.txt") == "kept\n"

            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            _sh(c, sid, "echo later > /root/kept.txt")
            r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": snaps["full"]})
            assert r.status_code in (200, 202), r.text
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and c.get(f"/v1/sandboxes/{sid}").json()["state"] != "running":
                time.sleep(0.5)
            assert _sh(c, sid, "cat /root/kept.txt") == "kept\n"
        finally:
            for child in children:
                c.delete(f"/v1/sandboxes/{child}")
            c.delete(f"/v1/sandboxes/{sid}")
