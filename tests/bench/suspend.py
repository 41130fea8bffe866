"""Benchmark: suspend to object storage and resume from it, through the HTTP API of a running stack.

    .venv/bin/python tests/bench/suspend.py --runs 10 --json suspend.json

One 256 MiB sandbox (the base template) first dirties ``--dirty-mib`` MiB of memory (64) and runs a counter;
then ``--runs`` times: suspend (until ``suspended``), resume (until ``running``, restored from S3).
Metrics (docs/DESIGN.md §7): ``suspend``, ``resume_from_s3`` (API round trips, ms); ``upload_MiB_per_s`` and
``download_MiB_per_s`` (compressed bytes on the wire over the time spent moving chunks, from the
snapshotter's and node agent's ``/metrics``; hashing and verification are not counted);
``first_snapshot_uploaded_MiB``, ``second_snapshot_uploaded_MiB`` (before compression) and
``second_snapshot_upload_fraction`` (second / first). The stack's ports come from ``PODBAY_*`` settings
(``--snapshotter-url``/``--node-url`` override).
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import httpx

from podbay.clientconfig import load_client_config
from podbay.config import Settings

try:
    from tests.bench._stats import report, start_dirty_holder, summarise
except ImportError:  # run as a script from the repository root
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, start_dirty_holder, summarise  # type: ignore[no-redef]


def _metric_sum(url: str, name: str, label: str) -> float:
    """Sum of the samples of ``name`` whose labels contain ``label`` on a ``/metrics`` page (0 if absent)."""
    r = httpx.get(f"{url}/metrics", headers=_scrape_headers(), timeout=10)
    r.raise_for_status()
    text = r.text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", line)
        if m and label in m.group(1):
            total += float(m.group(2))
    return total


def _timed(fn: Any) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    r = fn()
    r.raise_for_status()
    return (time.perf_counter() - t) * 1000, r.json()


def _promoted(c: httpx.Client, sid: str) -> dict[str, Any]:
    snaps = c.get(f"/v1/sandboxes/{sid}/snapshots").raise_for_status().json()["snapshots"]
    return next(s for s in snaps if s["promotion"] == "promoted")


def _scrape_headers() -> dict[str, str]:
    """Credentials of a /metrics read: the node agent's takes the internal token, the other services' the
    metrics token once one is set (docs/operations.md, "Metrics and alerts")."""
    s = Settings()
    headers = {"x-podbay-internal-token": s.internal_token}
    if s.metrics_token:
        headers["authorization"] = f"Bearer {s.metrics_token}"
    return headers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--dirty-mib", type=int, default=64)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--api-url", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--snapshotter-url", default=None)
    ap.add_argument("--node-url", default=None)
    args = ap.parse_args()
    cfg = load_client_config(args.api_url, args.api_key)
    s = Settings()
    snap_url = args.snapshotter_url or f"http://127.0.0.1:{s.snapshotter_port}"
    node_url = args.node_url or f"http://{s.node_host}:{s.node_port}"
    m: dict[str, list[float]] = {"suspend": [], "resume_from_s3": []}
    uploaded: list[int] = []
    up0 = (_metric_sum(snap_url, "podbay_object_transfer_bytes_sum", 'direction="up"'),
           _metric_sum(snap_url, "podbay_object_transfer_seconds_sum", 'direction="up"'))
    down0 = (_metric_sum(node_url, "podbay_object_transfer_bytes_sum", 'direction="down"'),
             _metric_sum(node_url, "podbay_object_transfer_seconds_sum", 'direction="down"'))
    with httpx.Client(base_url=cfg.api_url, headers={"authorization": f"Bearer {cfg.api_key}"}, timeout=900) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).raise_for_status().json()["id"]
        try:
            start_dirty_holder(c, sid, args.dirty_mib)
            time.sleep(3)
            for _ in range(args.runs):
                ms, body = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/suspend"))
                assert body["state"] == "suspended", body
                m["suspend"].append(ms)
                uploaded.append(int(_promoted(c, sid)["uploaded_bytes"] or 0))
                ms, body = _timed(lambda: c.post(f"/v1/sandboxes/{sid}/resume"))
                assert body["state"] == "running", body
                m["resume_from_s3"].append(ms)
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    up1 = (_metric_sum(snap_url, "podbay_object_transfer_bytes_sum", 'direction="up"'),
           _metric_sum(snap_url, "podbay_object_transfer_seconds_sum", 'direction="up"'))
    down1 = (_metric_sum(node_url, "podbay_object_transfer_bytes_sum", 'direction="down"'),
             _metric_sum(node_url, "podbay_object_transfer_seconds_sum", 'direction="down"'))
    results: dict[str, dict[str, Any]] = {k: summarise(v) for k, v in m.items()}

    def rate(b: tuple[float, float], a: tuple[float, float]) -> float:
        return round((a[0] - b[0]) / (1 << 20) / max(a[1] - b[1], 1e-9), 1)

    results["upload_MiB_per_s"] = {"value": rate(up0, up1)}
    results["download_MiB_per_s"] = {"value": rate(down0, down1)}
    results["first_snapshot_uploaded_MiB"] = {"value": round(uploaded[0] / (1 << 20), 1)}
    if len(uploaded) > 1:
        results["second_snapshot_uploaded_MiB"] = {"value": round(uploaded[1] / (1 << 20), 1)}
        results["second_snapshot_upload_fraction"] = {"value": round(uploaded[1] / max(uploaded[0], 1), 4)}
    report(results, args.json_path)


if __name__ == "__main__":
    main()
