"""Crash behaviour: the node agent dies and comes back; a VM dies on its own."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client as _client

pytestmark = pytest.mark.e2e



def test_sigkill_nodeagent_then_restart_reattaches(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "echo before > /tmp/mark"})
        stack.kill("nodeagent", signal.SIGKILL)
        stack.restart("nodeagent")
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["cat", "/tmp/mark"]})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == "before\n"
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")


def _qemu_pid(stack: Any, sid: str) -> int:
    pid_files = list(Path(stack.data_dir).glob(f"nodes/*/store/sandboxes/{sid}/qemu.pid"))
    assert pid_files, "the sandbox has a qemu.pid in its VM directory"
    return int(pid_files[0].read_text().strip())


def _wait_failed(c: httpx.Client, sid: str) -> dict[str, Any]:
    """The sandbox's info once it is ``failed``, or as it is after 30 s."""
    deadline = time.monotonic() + 30
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = c.get(f"/v1/sandboxes/{sid}").json()
        if info["state"] == "failed":
            break
        time.sleep(0.2)
    return info


def test_dead_qemu_marks_sandbox_failed_with_event(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        os.kill(_qemu_pid(stack, sid), signal.SIGKILL)
        info = _wait_failed(c, sid)
        assert info["state"] == "failed"
        assert "exited unexpectedly" in (info["failure_reason"] or "")
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
        assert r.status_code == 409
        assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"


def test_failed_sandbox_restores_from_a_full_snapshot(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "echo kept > /root/kept.txt"})
            assert r.status_code == 200, r.text
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code == 201, r.text
            snap = r.json()["id"]
            c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "echo later > /root/kept.txt"})
            os.kill(_qemu_pid(stack, sid), signal.SIGKILL)
            info = _wait_failed(c, sid)
            assert info["state"] == "failed", info

            r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": snap})
            assert r.status_code == 200, r.text
            back = r.json()
            assert back["state"] == "running" and back["generation"] == info["generation"] + 1
            assert back["failure_reason"] is None
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["cat", "/root/kept.txt"]})
            assert r.status_code == 200, r.text
            assert r.json()["stdout"] == "kept\n"
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
