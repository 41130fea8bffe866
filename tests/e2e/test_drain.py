"""Drain end to end (issue 8): two nodes in their own network namespaces, real microVMs, live migration.

A running sandbox holds state in memory (a python3 loop counting in memory, writing the count to a file)
and a file on disk; a second sandbox on the same node is paused. ``podbay node drain`` moves both: the
process runs on the other node with the same pid and its count carries on (not reset), the file is intact,
exec works, an HTTP server in it answers at the same port URL and token, the paused one arrives paused and
resumes; the drained node is ``drained`` and a new sandbox
goes to the other node. The downtime is printed and recorded in the operation and the ``migrated`` event.
A sandbox with a read-write volume moves by suspend and wake: its volume is promoted and fetched on the
other node, which becomes the volume's home, its process carries on there, and an HTTP server in it is
reached through the same port URL and token as before the move.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import asyncpg
import httpx
import pytest

from podbay.devstack.procs import run_sync

from e2e_http import api_client, sh, until as _until

# Two nodes start and two guests move (RAM and a 2 GiB disk each) under TCG: minutes.
pytestmark = pytest.mark.timeout(1800)

COUNTER = ("import os,time\n"
           "open('/root/counter.pid','w').write(str(os.getpid()))\n"
           "n=0\n"
           "while True:\n"
           "    n+=1\n"
           "    open('/root/count.tmp','w').write(str(n)); os.replace('/root/count.tmp','/root/count')\n"
           "    time.sleep(0.05)\n")


async def _events(dsn: str, subject_like: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT payload FROM outbox WHERE subject LIKE $1 ORDER BY id", subject_like)
    finally:
        await conn.close()
    return [json.loads(r["payload"]) if isinstance(r["payload"], str) else dict(r["payload"]) for r in rows]


def _count(c: httpx.Client, sid: str) -> tuple[int, int]:
    out = sh(c, sid, "cat /root/counter.pid; echo; cat /root/count; echo; kill -0 $(cat /root/counter.pid) && echo alive")
    pid, count, alive = out.split()
    assert alive == "alive"
    return int(pid), int(count)


async def _node_state(dsn: str, node: str, state: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE nodes SET state=$2 WHERE id=$1", node, state)
    finally:
        await conn.close()


def _create_on(c: httpx.Client, st: Any, node: str, other: str, **body: Any) -> str:
    """A sandbox on ``node``: ``other`` is held out of placement (``draining``) while it is created."""
    run_sync(_node_state(st.pg_dsn, other, "draining"))
    try:
        r = c.post("/v1/sandboxes", json={"template": "base", **body})
        assert r.status_code in (200, 201), r.text
        assert r.json()["node_id"] == node
        return str(r.json()["id"])
    finally:
        run_sync(_node_state(st.pg_dsn, other, "ready"))


def _serve_port(c: httpx.Client, st: Any, sid: str, text: str) -> tuple[str, dict[str, str]]:
    """Start an HTTP server on guest port 8000 serving ``text`` at /index.txt; returns the edge URL and the
    headers (host form, traffic token) that reach it (docs/ARCHITECTURE.md "Ports"), once it answers."""
    sh(c, sid, f"mkdir -p /srv && echo {text} > /srv/index.txt && (setsid python3 -m http.server 8000 "
               "--bind 0.0.0.0 --directory /srv >/dev/null 2>&1 </dev/null &)")
    r = c.get(f"/v1/sandboxes/{sid}/ports/8000/url")
    assert r.status_code == 200, r.text
    headers = {"host": f"8000-{sid.replace('_', '-')}.localhost", "x-podbay-access-token": r.json()["token"]}
    url = f"{st.api_url}/index.txt"
    _until("the guest's server answers through the edge",
           lambda: httpx.get(url, headers=headers, timeout=60).status_code == 200, 60)
    return url, headers


def test_drain_live_migrates_running_and_paused_sandboxes(multinode_stack: Any) -> None:
    st = multinode_stack
    src, dst = "node-a", "node-b"
    with api_client(st, timeout_s=600) as c:
        _until("both nodes ready and live", lambda: (lambda n: n if len(n) == 2 and all(
            x["schedulable"] for x in n) else None)(c.get("/v1/nodes").json()["nodes"]), 120)
        run = _create_on(c, st, src, dst)
        paused = _create_on(c, st, src, dst)
        try:
            import base64

            b64 = base64.b64encode(COUNTER.encode()).decode()
            sh(c, run, f"echo kept > /root/mark && sync && echo {b64} | base64 -d > /root/counter.py && "
                       "(setsid python3 /root/counter.py >/dev/null 2>&1 </dev/null &) ; echo started")
            _until("the counter running", lambda: sh(c, run, "cat /root/count 2>/dev/null || true").strip(), 60)
            pid, before = _count(c, run)
            port_url, port_headers = _serve_port(c, st, run, "live-port")
            sh(c, paused, "echo paused-file > /root/p && sync")
            r = c.post(f"/v1/sandboxes/{paused}/pause")
            assert r.status_code == 200, r.text

            env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
            env.update({"PODBAY_API_URL": st.api_url, "PODBAY_API_KEY": st.api_key})
            out = subprocess.run([sys.executable, "-m", "podbay.cli.main", "node", "drain", src, "--json"],
                                 capture_output=True, text=True, timeout=1200, env=env)
            assert out.returncode == 0, out.stdout + out.stderr
            op = json.loads(out.stdout)
            assert op["state"] == "succeeded" and op["progress"]["moved"] == op["progress"]["total"] == 2
            for m in op["progress"]["moves"]:
                print(f"\nmoved {m['sandbox_id']} -> {m['destination']}: downtime {m['downtime_ms']} ms, "
                      f"total {m['total_ms']} ms")
                assert m["destination"] == dst and m["downtime_ms"] is not None

            info = c.get(f"/v1/sandboxes/{run}").json()
            assert (info["state"], info["node_id"]) == ("running", dst)
            pid_after, after = _count(c, run)
            assert pid_after == pid and after >= before  # the same process, its count carried on
            time.sleep(1.0)
            assert _count(c, run)[1] > after  # and it keeps counting there
            assert sh(c, run, "cat /root/mark").strip() == "kept"
            # The same port URL and token reach the same server on its new node.
            r = httpx.get(port_url, headers=port_headers, timeout=60)
            assert (r.status_code, r.text) == (200, "live-port\n"), r.text

            info = c.get(f"/v1/sandboxes/{paused}").json()
            assert (info["state"], info["node_id"]) == ("paused", dst)
            r = c.post(f"/v1/sandboxes/{paused}/resume")
            assert r.status_code == 200, r.text
            assert sh(c, paused, "cat /root/p").strip() == "paused-file"

            events = run_sync(_events(st.pg_dsn, f"podbay.evt.sandbox.{run}.migrated"))
            assert len(events) == 1
            data = events[0]["data"]
            assert (data["source"], data["destination"]) == (src, dst) and data["downtime_ms"] >= 0
            print(f"migrated event: downtime {data['downtime_ms']} ms, total {data['total_ms']} ms")

            nodes = {n["id"]: n for n in c.get("/v1/nodes").json()["nodes"]}
            assert nodes[src]["state"] == "drained" and not nodes[src]["schedulable"]
            r = c.post("/v1/sandboxes", json={"template": "base"})
            assert r.status_code in (200, 201), r.text
            assert r.json()["node_id"] == dst  # the drained node takes no new sandboxes
            c.delete(f"/v1/sandboxes/{r.json()['id']}")
        finally:
            for sid in (run, paused):
                c.delete(f"/v1/sandboxes/{sid}")


def test_drain_moves_a_sandbox_with_a_volume_by_suspend_and_wake(multinode_stack: Any) -> None:
    st = multinode_stack
    src, dst = "node-b", "node-a"
    with api_client(st, timeout_s=600) as c:
        _until("both nodes live", lambda: (lambda n: n if len(n) == 2 and all(x["live"] for x in n) else None)(
            c.get("/v1/nodes").json()["nodes"]), 120)
        run_sync(_node_state(st.pg_dsn, dst, "ready"))  # the test above drained it
        r = c.post("/v1/volumes", json={"name": "e2e-drained", "size_bytes": 64 << 20})
        assert r.status_code == 201, r.text
        sid = _create_on(c, st, src, dst, volumes=[{"name": "e2e-drained", "path": "/data"}])
        try:
            pid = sh(c, sid, "echo kept > /data/v && sync && echo in-memory > /root/m && "
                             "(setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > /root/bg.pid); "
                             "cat /root/bg.pid").strip()
            assert c.get("/v1/volumes/e2e-drained").json()["node_id"] == src
            # A port of the guest through the edge, before and after the move.
            port_url, headers = _serve_port(c, st, sid, "hello-port")
            r = c.post(f"/v1/nodes/{src}/drain")
            assert r.status_code == 202, r.text
            op_id = r.json()["operation_id"]
            op = _until("the drain finished", lambda: (lambda o: o if o["state"] in ("succeeded", "failed") else None)(
                c.get(f"/v1/operations/{op_id}").json()), 600)
            assert op["state"] == "succeeded", op
            assert op["progress"]["moved"] == op["progress"]["total"] == 1, op
            move = op["progress"]["moves"][0]
            assert (move["sandbox_id"], move["destination"], move["how"]) == (sid, dst, "suspend"), move
            print(f"\nmoved {sid} with its volume {src} -> {dst} by suspend and wake: {move['downtime_ms']} ms")

            info = c.get(f"/v1/sandboxes/{sid}").json()
            assert (info["state"], info["node_id"]) == ("running", dst)
            assert c.get("/v1/volumes/e2e-drained").json()["node_id"] == dst
            assert sh(c, sid, f"cat /data/v /root/m; kill -0 {pid} && echo alive").split() == [
                "kept", "in-memory", "alive"]
            assert sh(c, sid, "echo more >> /data/v && sync && cat /data/v").split() == ["kept", "more"]
            # The same URL and token reach the same server on its new node.
            r = httpx.get(port_url, headers=headers, timeout=60)
            assert (r.status_code, r.text) == (200, "hello-port\n"), r.text
            assert {n["id"]: n["state"] for n in c.get("/v1/nodes").json()["nodes"]}[src] == "drained"
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
            _until("the sandbox deleted", lambda: c.get(f"/v1/sandboxes/{sid}").json()["state"] == "deleted", 120)
            c.delete("/v1/volumes/e2e-drained")
            run_sync(_node_state(st.pg_dsn, src, "ready"))
