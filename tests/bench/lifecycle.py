"""Benchmark: pause, resume, snapshots, rollback and fork through the HTTP API of a running stack.

    .venv/bin/python tests/bench/lifecycle.py --runs 30 --json lifecycle.json

Metrics (docs/DESIGN.md §7): ``pause``, ``resume`` (API round trips), ``disk_snapshot_held`` (guest frozen),
``disk_snapshot`` (API round trip), ``full_snapshot_paused`` (guest paused), ``full_snapshot``, ``rollback``
(to the full snapshot, until the API answers with the sandbox running), ``fork_1`` and ``fork_10`` (whole
call; ``fork_10_per_child`` divides by 10), and ``fork_parent_paused``: the time the parent is stopped during
a fork of the running sandbox (no ``snapshot_id``, so the node takes a full snapshot first), as the node
measures it (the snapshot's ``paused_ms``, from QMP ``stop`` to ``cont``), ``--runs`` forks of one child each
(issue "first command in 25 ms, forks in 150 ms"). The guest first dirties ``--dirty-mib`` MiB of memory (64).

Then the same forks again with a process in the parent that writes memory without pause and logs every gap
in its own clock (``tests/bench/_stats.py``, ``start_stall_logger``): ``fork_parent_paused_busy`` is the
pause of such a busy parent, ``fork_parent_stall`` the longest gap its process saw while a fork call ran, and
``idle_parent_stall`` the longest over one second without an operation just before it. A gap is what the
parent's own work feels, whatever held it: the pause in part (across a QMP ``stop`` under TCG the guest's
clock neither stands still nor keeps pace: stops of 300 ms showed as gaps of 95-201 ms), writes blocked on the
host by the snapshot's write-back or reflink while the guest counted as running, and a host CPU busy elsewhere.

With ``--stack`` the benchmark starts a stack of its own (as ``create.py`` does) instead of using the running
one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

import httpx

from podbay.clientconfig import load_client_config

try:
    from tests.bench._benchstack import own_stack
    from tests.bench._stats import (longest_stall, report, start_dirty_holder, start_stall_logger,
                                   stop_on_sigterm, summarise)
except ImportError:  # run as a script from the repository root
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _benchstack import own_stack  # type: ignore[no-redef]
    from _stats import (longest_stall, report, start_dirty_holder,  # type: ignore[no-redef]
                        start_stall_logger, stop_on_sigterm, summarise)


def _timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    r = fn()
    r.raise_for_status()
    return (time.perf_counter() - t) * 1000, r.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--fork-runs", type=int, default=3, help="runs of fork_10 (each starts 10 VMs)")
    ap.add_argument("--dirty-mib", type=int, default=64)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--stack", action="store_true", help="start a stack of its own for the run")
    args = ap.parse_args()
    stop_on_sigterm()
    with contextlib.ExitStack() as cleanup:
        if args.stack:
            stack = cleanup.enter_context(own_stack())
            os.environ.update(PODBAY_API_URL=stack.api_url, PODBAY_API_KEY=stack.api_key)
        print(f"load average at start: {os.getloadavg()}")
        results = _run(args)
        print(f"load average at end: {os.getloadavg()}")
    report(results, args.json_path)


def _fork_parent(c: httpx.Client, sid: str) -> float:
    """Fork one child of the running ``sid`` without a snapshot id, delete the child; returns the parent's
    ``paused_ms`` in the full snapshot the node took for it."""
    _, body = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1}))
    snaps = c.get(f"/v1/sandboxes/{sid}/snapshots").raise_for_status().json()["snapshots"]
    taken = next(s for s in snaps if s["id"] == body["snapshot_id"])
    for child in body["children"]:
        c.delete(f"/v1/sandboxes/{child['sandbox_id']}")
    return float(taken["paused_ms"])


def _run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    cfg = load_client_config()
    m: dict[str, list[float]] = {k: [] for k in ("pause", "resume", "disk_snapshot_held", "disk_snapshot",
                                                 "full_snapshot_paused", "full_snapshot", "rollback", "fork_1",
                                                 "fork_10", "fork_10_per_child", "fork_parent_paused",
                                                 "fork_parent_paused_busy", "fork_parent_stall",
                                                 "idle_parent_stall")}
    with httpx.Client(base_url=cfg.api_url, headers={"authorization": f"Bearer {cfg.api_key}"}, timeout=600) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).raise_for_status().json()["id"]
        try:
            start_dirty_holder(c, sid, args.dirty_mib)
            time.sleep(3)
            snap_id = ""
            for _ in range(args.runs):
                ms, _ = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/pause"))
                m["pause"].append(ms)
                ms, _ = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/resume"))
                m["resume"].append(ms)
                ms, body = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"}))
                m["disk_snapshot"].append(ms)
                m["disk_snapshot_held"].append(body["paused_ms"])
                ms, body = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"}))
                m["full_snapshot"].append(ms)
                m["full_snapshot_paused"].append(body["paused_ms"])
                snap_id = body["id"]
            for _ in range(args.runs):
                ms, _ = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": snap_id}))
                m["rollback"].append(ms)
            for count, runs in ((1, args.runs), (10, args.fork_runs)):
                for _ in range(runs):
                    # The lambda runs at once, inside this iteration, so it sees this count.
                    ms, body = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/fork",
                                                     json={"count": count, "snapshot_id": snap_id}))  # noqa: B023
                    m[f"fork_{count}"].append(ms)
                    if count == 10:
                        m["fork_10_per_child"].append(ms / 10)
                    for child in body["children"]:
                        c.delete(f"/v1/sandboxes/{child['sandbox_id']}")
            for _ in range(args.runs):
                # No snapshot_id: the node stops the running parent for a full snapshot of its own, and
                # records how long it held it in that snapshot's paused_ms.
                m["fork_parent_paused"].append(_fork_parent(c, sid))
            start_stall_logger(c, sid)
            time.sleep(2)
            for _ in range(args.runs):
                longest_stall(c, sid)
                time.sleep(1)
                m["idle_parent_stall"].append(longest_stall(c, sid))
                m["fork_parent_paused_busy"].append(_fork_parent(c, sid))
                m["fork_parent_stall"].append(longest_stall(c, sid))
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    return {k: summarise(v) for k, v in m.items()}


if __name__ == "__main__":
    main()
