"""The node agent dies in the middle of a full snapshot: no half snapshot is listed and the sandbox lives on.

The sandbox first dirties ~64 MiB of memory, so that the snapshot's reflink of its RAM file has pages to flush
and lasts long enough to be interrupted. The node agent is SIGKILLed right after the API accepted the
snapshot (``?wait=false``) and started again; JetStream then redelivers the interrupted command
(docs/ARCHITECTURE.md, "Snapshots, rollback and fork" and "Node agent restart and VM death").
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client as _client, sh_output as _sh

pytestmark = pytest.mark.e2e

DIRTY_MIB = 64
# Touches every page of a 64 MiB buffer, says so, then holds it.
DIRTY = (
    f"setsid python3 -c 'b = bytearray({DIRTY_MIB} << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "open(\"/tmp/dirty.done\", \"w\").close()\n"
    "import time\nwhile True: time.sleep(1)' </dev/null >/dev/null 2>&1 &"
)
OP_SETTLE_S = 10.0
# Beyond the node consumer's ack wait (restore_timeout_s * 2 + 30 = 90 s by default), when JetStream redelivers.
OP_DEADLINE_S = 180.0



def _snapshot_dirs(stack: Any, sid: str) -> list[Path]:
    return sorted(Path(stack.data_dir).glob(f"nodes/*/store/snapshots/{sid}/*"))


def _wait_final(c: httpx.Client, op_id: str) -> dict[str, Any]:
    """Poll the operation until succeeded or failed (bounded); its last answer."""
    deadline = time.monotonic() + OP_DEADLINE_S
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = c.get(f"/v1/operations/{op_id}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] in ("succeeded", "failed"):
            return body
        time.sleep(0.5)
    raise AssertionError(f"operation {op_id} did not finish: {body}")


def test_sigkill_nodeagent_mid_full_snapshot_lists_no_half_snapshot(stack: Any) -> None:
    with _client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            _sh(c, sid, "echo before > /root/mark; " + DIRTY)
            deadline = time.monotonic() + 60
            while _sh(c, sid, "test -e /tmp/dirty.done && echo y; true") != "y\n":
                assert time.monotonic() < deadline, "the guest did not dirty its memory in time"
                time.sleep(0.5)

            r = c.post(f"/v1/sandboxes/{sid}/snapshots", params={"wait": "false"}, json={"kind": "full"})
            assert r.status_code == 202, r.text
            snap_id, op_id = r.json()["id"], r.json()["operation_id"]
            # "The middle": the node has taken the command and is writing <snapshot>.part.
            part = f"nodes/*/store/snapshots/{sid}/{snap_id}*"
            deadline = time.monotonic() + 10
            while not list(Path(stack.data_dir).glob(part)) and time.monotonic() < deadline:
                time.sleep(0.002)
            seen = [p.name for p in Path(stack.data_dir).glob(part)]
            stack.kill("nodeagent", signal.SIGKILL)
            stack.restart("nodeagent")
            restarted = time.monotonic()

            listed = c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
            dirs = _snapshot_dirs(stack, sid)
            evidence = {"seen_before_kill": seen, "listed": listed, "dirs": [p.name for p in dirs],
                        "log": stack.log_tail("nodeagent", 40)}
            assert all(s["state"] == "ready" for s in listed), evidence
            for s in listed:
                states = list(Path(stack.data_dir).glob(f"nodes/*/store/snapshots/{sid}/{s['id']}/state"))
                assert len(states) == 1, evidence
            assert [s["id"] for s in listed] in ([], [snap_id]), evidence
            assert not [p for p in dirs if p.name.endswith(".part")], evidence

            info = c.get(f"/v1/sandboxes/{sid}").json()
            assert info["state"] == "running", {"info": info, **evidence}
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["cat", "/root/mark"]})
            assert r.status_code == 200, {"exec": r.text, **evidence}
            assert r.json()["stdout"] == "before\n"

            # A few seconds after the restart the interrupted operation has an outcome that agrees with the
            # snapshot list (the restart failed the half snapshot, or the snapshot was complete).
            time.sleep(max(0.0, restarted + OP_SETTLE_S - time.monotonic()))
            op_settled = c.get(f"/v1/operations/{op_id}").json()
            # JetStream redelivers the interrupted command at the latest after its ack wait; it must not
            # break anything, whatever its outcome.
            op = _wait_final(c, op_id)
            listed_after = c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
            evidence |= {"operation_after_settle": op_settled, "operation": op, "listed_after": listed_after}
            assert [s["id"] for s in listed_after] == [s["id"] for s in listed], evidence
            assert (op["state"] == "succeeded") == ([s["id"] for s in listed] == [snap_id]), evidence
            assert not [p for p in _snapshot_dirs(stack, sid) if p.name.endswith(".part")], evidence
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running", evidence
            assert _sh(c, sid, "cat /root/mark") == "before\n"
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code == 201 and r.json()["state"] == "ready", r.text

            assert op_settled["state"] in ("succeeded", "failed"), evidence
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
