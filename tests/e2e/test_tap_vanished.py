"""A tap deleted under a running guest is noticed and repaired (services/nodeagent/net/tapwatch.py): the guest
moves to a new QEMU on a new tap of the same name and address, keeps its memory (a tmpfs file) and its
processes, reaches the gateway again, and the old QEMU is gone rather than left spinning on a dead tap."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client, sh, until

from podbay.contracts.egress import NetBinding, bindings_dir

pytestmark = pytest.mark.e2e

#: Runs in the guest: a TCP connection to the tap's host side (redirected to the gateway) either answers or is
#: turned down at once while the network works; with the tap gone it times out.
_PROBE = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], 80), timeout=3).close()
    print("answered")
except (ConnectionRefusedError, ConnectionResetError):
    print("answered")
except OSError as e:
    print("broken: %r" % e)
"""


def _binding(stack: Any, sandbox: dict[str, Any]) -> NetBinding:
    for f in bindings_dir(Path(stack.data_dir), sandbox["node_id"]).glob("*.json"):
        b = NetBinding.model_validate_json(f.read_text())
        if b.sandbox_id == sandbox["id"]:
            return b
    raise AssertionError(f"no binding for {sandbox['id']}")


def _ifindex(tap: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{tap}/ifindex").read_text())
    except OSError:
        return None


def _qemu_pid(stack: Any, sandbox_id: str) -> int:
    pidfile = next(Path(stack.data_dir).glob(f"nodes/*/store/sandboxes/{sandbox_id}/qemu.pid"))
    return int(pidfile.read_text().split()[0])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_deleted_tap_is_repaired_and_the_guest_carries_on(stack: Any) -> None:
    with api_client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201 and r.json()["state"] == "running", r.text
        sb = r.json()
        sid = sb["id"]
        try:
            b = _binding(stack, sb)
            sh(c, sid, "echo kept-in-memory > /dev/shm/marker")
            pid_in_guest = sh(c, sid, "(setsid sh -c 'echo $$ > /dev/shm/sleeper; exec sleep 900' >/dev/null 2>&1"
                                      " </dev/null &); while [ ! -s /dev/shm/sleeper ]; do sleep 0.05; done;"
                                      " cat /dev/shm/sleeper").strip()
            assert pid_in_guest.isdigit(), pid_in_guest
            assert sh(c, sid, f"python3 -c '{_PROBE}' {b.host_addr}").strip() == "answered"
            before_index, before_qemu = _ifindex(b.tap), _qemu_pid(stack, sid)
            assert before_index is not None

            subprocess.run(["ip", "link", "del", b.tap], check=True)
            t0 = time.monotonic()
            until("the tap is back as a new device",
                  lambda: (i := _ifindex(b.tap)) is not None and i != before_index, timeout_s=60)
            until("the old QEMU is gone", lambda: not _alive(before_qemu), timeout_s=30)
            # The new tap exists before the restore on it finishes: the guest answers once it does.
            until("the guest answers in its new VM",
                  lambda: c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}).status_code == 200,
                  timeout_s=60)
            repaired_s = time.monotonic() - t0

            got = c.get(f"/v1/sandboxes/{sid}").json()
            assert got["state"] == "running", got
            assert _qemu_pid(stack, sid) != before_qemu
            # Memory, processes and the network are all there in the new VM.
            assert sh(c, sid, "cat /dev/shm/marker").strip() == "kept-in-memory"
            assert sh(c, sid, f"kill -0 {pid_in_guest} && echo alive").strip() == "alive"
            assert sh(c, sid, f"python3 -c '{_PROBE}' {b.host_addr}").strip() == "answered"
            assert _binding(stack, sb).guest_addr == b.guest_addr
            print(f"tap repaired in {repaired_s:.1f} s")
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
