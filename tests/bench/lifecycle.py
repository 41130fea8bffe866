"""Benchmark: pause, resume, snapshots, rollback and fork through the HTTP API of a running stack.

    .venv/bin/python tests/bench/lifecycle.py --runs 30 --json lifecycle.json

Metrics (docs/DESIGN.md §7): ``pause``, ``resume`` (API round trips), ``disk_snapshot_held`` (guest frozen),
``disk_snapshot`` (API round trip), ``full_snapshot_paused`` (guest paused), ``full_snapshot``, ``rollback``
(to the full snapshot, until the API answers with the sandbox running), ``fork_1`` and ``fork_10`` (whole
call; ``fork_10_per_child`` divides by 10). The guest first dirties ``--dirty-mib`` MiB of memory (64).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx

from podbay.clientconfig import load_client_config

try:
    from tests.bench._stats import report, start_dirty_holder, summarise
except ImportError:  # run as a script from the repository root
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, start_dirty_holder, summarise  # type: ignore[no-redef]


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
    args = ap.parse_args()
    cfg = load_client_config()
    m: dict[str, list[float]] = {k: [] for k in ("pause", "resume", "disk_snapshot_held", "disk_snapshot",
                                                 "full_snapshot_paused", "full_snapshot", "rollback", "fork_1",
                                                 "fork_10", "fork_10_per_child")}
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
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    report({k: summarise(v) for k, v in m.items()}, args.json_path)


if __name__ == "__main__":
    main()
