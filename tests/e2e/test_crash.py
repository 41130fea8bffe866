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


def _vm_processes(sid: str, names: tuple[str, ...] = ("qemu-system", "bwrap")) -> list[int]:
    """Processes named ``names`` (QEMU and its bubblewrap) whose arguments name the sandbox."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "comm").read_text().startswith(names) and \
                    sid.encode() in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except OSError:
            continue
    return out


def test_a_create_cut_short_before_its_pidfile_is_finished_by_the_restarted_agent(stack: Any) -> None:
    """The node agent dies right after starting a sandbox's QEMU, before it records QEMU's pid: the QEMU
    keeps running and holds the sandbox's tap. The restarted agent finds it by its VM directory, kills it and
    its bubblewrap, and restores the sandbox again on the freed tap; one VM is left."""
    svc = stack.services["nodeagent"]
    with _client(stack) as c:
        try:
            svc.env = {**stack.env, "PODBAY_FAULT_STEP": "vm.spawned"}
            stack.restart("nodeagent")
            r = c.post("/v1/sandboxes", json={"template": "base"}, params={"wait": "false"})
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            deadline = time.monotonic() + 120
            while svc.alive():
                assert time.monotonic() < deadline, "the node agent never reached vm.spawned"
                time.sleep(0.1)
            assert _vm_processes(sid), "the interrupted start left no QEMU behind to clean up"
        finally:
            svc.env = stack.env
            if not svc.alive():
                stack.restart("nodeagent")
        try:
            info: dict[str, Any] = {}
            while time.monotonic() < deadline:
                info = c.get(f"/v1/sandboxes/{sid}").json()
                if info["state"] in ("running", "failed"):
                    break
                time.sleep(0.2)
            assert info["state"] == "running", info
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "ok"]})
            assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text
            assert len(_vm_processes(sid, ("qemu-system",))) == 1
        finally:
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
