"""Node loss end to end (issue 8): two nodes in their own network namespaces, real microVMs.

A sandbox with a file written and a full snapshot promoted to S3 loses its node (the node agent SIGKILLed,
its link cut). After the heartbeat TTL and the lost-node grace, the scheduler marks the node ``lost``, fences
the sandbox and restores it on the other node from that snapshot: the file is there, what was written after
the snapshot is not, and the ``rescheduled`` event says how much work was lost. The lost node's agent,
restarted with its link back, stops its stale copy (its QEMU is gone, the VM directory removed) and only then
becomes ``ready`` again; ``GET /v1/nodes`` shows the states on the way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import pytest

from podbay.contracts import subjects
from podbay.contracts.messages import PromoteCmd
from podbay.devstack.procs import run_sync
from podbay.devstack.vms import find_strays

from e2e_http import api_client, sh, until as _until

# Two nodes start (each its agent, snapshotter and gateway), a promotion, a loss and a restart: minutes on TCG.
pytestmark = pytest.mark.timeout(1500)


async def _publish_promote(nats_url: str, node: str, sandbox_id: str, snapshot_id: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        cmd = PromoteCmd(snapshot_id=snapshot_id, sandbox_id=sandbox_id, reason="request")
        await nc.jetstream().publish(subjects.snapshotter_promote(node), cmd.model_dump_json().encode(),
                                     headers={"Nats-Msg-Id": f"promote.{snapshot_id}"})
    finally:
        await nc.close()


async def _events(dsn: str, subject_like: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT payload FROM outbox WHERE subject LIKE $1 ORDER BY id", subject_like)
    finally:
        await conn.close()
    return [json.loads(r["payload"]) if isinstance(r["payload"], str) else dict(r["payload"]) for r in rows]


def _nodes(c: httpx.Client) -> dict[str, dict[str, Any]]:
    r = c.get("/v1/nodes")
    assert r.status_code == 200, r.text
    return {n["id"]: n for n in r.json()["nodes"]}


def _vm_pids(data_dir: Path, sandbox_id: str) -> list[int]:
    out = []
    for pid in find_strays(data_dir):
        try:
            if sandbox_id in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                out.append(pid)
        except OSError:
            continue
    return out


def test_a_lost_node_s_sandbox_comes_back_elsewhere_from_its_promoted_snapshot(multinode_stack: Any) -> None:
    st = multinode_stack
    with api_client(st, timeout_s=600) as c:
        both = _until("both nodes ready and live", lambda: (lambda n: n if len(n) == 2 and all(
            x["schedulable"] for x in n.values()) else None)(_nodes(c)), 120)
        assert set(both) == {"node-a", "node-b"}
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code in (200, 201), r.text
        sid, lost = r.json()["id"], r.json()["node_id"]
        survivor = "node-b" if lost == "node-a" else "node-a"
        try:
            sh(c, sid, "echo kept-by-the-snapshot > /root/keep && sync")
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code == 201, r.text
            snap = r.json()["id"]
            run_sync(_publish_promote(st.nats_url, lost, sid, snap))

            def promoted() -> bool:
                snaps = c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
                return any(s["id"] == snap and s["promotion"] == "promoted" for s in snaps)

            _until("the full snapshot promoted", promoted, 300)
            sh(c, sid, "echo written-after-the-snapshot > /root/after && sync")
            old_pids = _vm_pids(Path(st.data_dir), sid)
            assert old_pids, "the sandbox's QEMU should be found by its VM directory"

            t_loss = time.monotonic()
            st.kill_node(lost, only="nodeagent")
            st.cut_link(lost)
            t_lost = _until("the node declared lost", lambda: _nodes(c)[lost]["state"] == "lost" and time.monotonic(),
                            300)

            def moved() -> dict[str, Any] | None:
                info = c.get(f"/v1/sandboxes/{sid}").json()
                return info if info["state"] == "running" and info["node_id"] == survivor else None

            info = _until("the sandbox running on the surviving node", moved, 300, every_s=0.5)
            t_back = time.monotonic()
            # Figures for the report (not asserted): detection is TTL + grace; the rest is fetch and restore.
            print(f"\nnode loss: declared lost {t_lost - t_loss:.1f} s after the kill; sandbox running on "
                  f"{survivor} {t_back - t_loss:.1f} s after the kill ({t_back - t_lost:.1f} s after the loss)")
            assert info["generation"] >= 3  # fenced (+1), then placed again (+1)
            out = sh(c, sid, "cat /root/keep; test -e /root/after && echo after-present || echo after-absent")
            assert out.split() == ["kept-by-the-snapshot", "after-absent"]

            events = run_sync(_events(st.pg_dsn, f"podbay.evt.sandbox.{sid}.rescheduled"))
            assert len(events) == 1, events
            data = events[0]["data"]
            assert data["lost_node"] == lost and data["snapshot_id"] == snap and data["lost_work_s"] >= 0
            assert lost in events[0]["reason"] and snap in events[0]["reason"]
            node_events = run_sync(_events(st.pg_dsn, f"podbay.evt.node.{lost}.lost"))
            assert len(node_events) == 1 and sid in node_events[0]["data"]["rescheduled"]

            seen = _nodes(c)
            assert seen[lost]["state"] == "lost" and not seen[lost]["live"] and not seen[lost]["schedulable"]
            assert seen[lost]["lost_at"] is not None and seen[lost]["heartbeat_age_s"] is None
            assert seen[survivor]["state"] == "ready" and seen[survivor]["schedulable"]
            assert seen[survivor]["running"] >= 1 and seen[survivor]["used"]["memory_mib"] >= 256

            # The lost node comes back: its stale copy is stopped, never resumed, and then it is ready again.
            st.restore_link(lost)
            st.restart_node(lost)
            _until("the lost node ready again", lambda: _nodes(c)[lost]["state"] == "ready", 120)
            assert not any(os.path.exists(f"/proc/{pid}") and sid in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                errors="replace") for pid in old_pids), "the stale QEMU still runs"
            assert not (Path(st.data_dir) / "nodes" / lost / "store" / "sandboxes" / sid).exists()
            assert _vm_pids(Path(st.data_dir), sid) and all(p not in old_pids for p in _vm_pids(Path(st.data_dir), sid))
            seen = _nodes(c)
            assert seen[lost]["live"] and seen[lost]["running"] == 0
            info = c.get(f"/v1/sandboxes/{sid}").json()
            assert info["node_id"] == survivor and info["state"] == "running"
            assert sh(c, sid, "cat /root/keep").strip() == "kept-by-the-snapshot"
        finally:
            st.restore_link(lost)
            c.delete(f"/v1/sandboxes/{sid}")


def test_a_partitioned_node_stops_its_stale_copy_when_the_link_comes_back(multinode_stack: Any) -> None:
    """No restart this time: the node agent runs on behind a cut link; once the link is back its fence loop
    stops the copy whose sandbox moved on (the QEMU killed, the VM directory removed) and the node rejoins."""
    st = multinode_stack
    with api_client(st, timeout_s=600) as c:
        _until("both nodes ready and live", lambda: all(n["schedulable"] for n in _nodes(c).values()), 180)
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code in (200, 201), r.text
        sid, cut = r.json()["id"], r.json()["node_id"]
        other = "node-b" if cut == "node-a" else "node-a"
        try:
            sh(c, sid, "echo partitioned > /root/p && sync")
            snap = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"}).json()["id"]
            run_sync(_publish_promote(st.nats_url, cut, sid, snap))
            _until("the full snapshot promoted", lambda: any(
                s["id"] == snap and s["promotion"] == "promoted"
                for s in c.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]), 300)
            old_pids = _vm_pids(Path(st.data_dir), sid)
            assert old_pids
            st.cut_link(cut)
            try:
                _until("the sandbox running on the other node", lambda: (lambda i: i["state"] == "running" and i[
                    "node_id"] == other)(c.get(f"/v1/sandboxes/{sid}").json()), 300, every_s=1.0)
                # Cut off, the old copy still runs (nothing could tell it): it is stopped only once it hears.
                assert any(os.path.exists(f"/proc/{p}") for p in old_pids)
            finally:
                st.restore_link(cut)
            _until("the partitioned node ready again", lambda: _nodes(c)[cut]["state"] == "ready", 120)
            assert not any(os.path.exists(f"/proc/{p}") for p in old_pids), "the stale QEMU still runs"
            assert not (Path(st.data_dir) / "nodes" / cut / "store" / "sandboxes" / sid).exists()
            assert all(s.alive() for s in st.node_services(cut))  # no restart was needed
            assert sh(c, sid, "cat /root/p").strip() == "partitioned"
        finally:
            st.restore_link(cut)
            c.delete(f"/v1/sandboxes/{sid}")
