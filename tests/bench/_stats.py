"""Shared helpers for the benchmarks: percentiles, the table and the JSON file (docs/DESIGN.md §7 format)."""

from __future__ import annotations

import json
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["summarise", "report", "stop_on_sigterm", "start_dirty_holder", "start_stall_logger", "longest_stall"]


def stop_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a CI runner) into ``SystemExit`` so that a benchmark's ``finally`` stops the
    stack it started; Python's default ends the process at once and leaves that stack and its VMs behind."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _pct(sorted_ms: list[float], p: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = (len(sorted_ms) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


def summarise(samples_ms: list[float]) -> dict[str, Any]:
    """``{"p50_ms", "p90_ms", "p99_ms", "mean_ms", "n"}`` of samples in milliseconds."""
    s = sorted(samples_ms)
    return {"p50_ms": round(_pct(s, 0.5), 2), "p90_ms": round(_pct(s, 0.9), 2), "p99_ms": round(_pct(s, 0.99), 2),
            "mean_ms": round(statistics.fmean(s), 2) if s else None, "n": len(s)}


def report(results: dict[str, dict[str, Any]], json_path: str | None) -> None:
    """Print a table of the metrics and write them as JSON when ``json_path`` is given."""
    from rich.console import Console
    from rich.table import Table

    table = Table("metric", "p50 ms", "p90 ms", "p99 ms", "n / value")
    for name, m in results.items():
        if "value" in m:
            table.add_row(name, "", "", "", str(m["value"]))
        else:
            table.add_row(name, f"{m['p50_ms']:.1f}", f"{m['p90_ms']:.1f}", f"{m['p99_ms']:.1f}", str(m["n"]))
    Console().print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2, sort_keys=True))


def start_dirty_holder(client: Any, sandbox_id: str, dirty_mib: int) -> None:
    """Start a guest process that dirties ``dirty_mib`` MiB (one byte per 4 KiB page) and keeps it, detached
    from the exec, so snapshots and suspends have that much changed memory to carry. ``client`` is an
    ``httpx.Client`` on the API."""
    client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"shell": (
        f"setsid python3 -c 'b = bytearray({dirty_mib} << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"
        "import time\nwhile True: time.sleep(1)' </dev/null >/dev/null 2>&1 &")}).raise_for_status()


#: Writes a page of its own 16 MiB every step (as a guest that works does) and appends to ``path`` each gap in
#: its guest's monotonic clock over 4 ms beyond the 1 ms naps it takes every 64 steps: the times its work made
#: no progress, whatever held it (a stop of the guest shows in part: under TCG its clock neither stands still
#: nor keeps pace across one; a write fault blocked on the host; a host CPU busy elsewhere).
_STALL_LOGGER = """
import sys, time
b = bytearray(16 << 20)
out = open(sys.argv[1], "a", buffering=1)
i, prev = 0, time.monotonic()
while True:
    b[(i * 4096) % len(b)] = i & 255
    i += 1
    nap = 0.001 if i % 64 == 0 else 0.0
    if nap:
        time.sleep(nap)
    now = time.monotonic()
    if now - prev - nap > 0.004:
        out.write("%.2f\\n" % ((now - prev - nap) * 1000))
    prev = now
"""

STALL_LOG = "/tmp/podbay-bench-stalls"


def start_stall_logger(client: Any, sandbox_id: str) -> None:
    """Start :data:`_STALL_LOGGER` in the guest, detached, logging to :data:`STALL_LOG`. ``client``: an
    ``httpx.Client`` on the API."""
    client.put(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "/tmp/podbay-bench-stalls.py"},
               content=_STALL_LOGGER.encode()).raise_for_status()
    client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"shell": (
        f"setsid python3 /tmp/podbay-bench-stalls.py {STALL_LOG} </dev/null >/dev/null 2>&1 &")}).raise_for_status()


def longest_stall(client: Any, sandbox_id: str, *, reset: bool = True) -> float:
    """The longest gap (ms) the stall logger recorded since the last reset, 0.0 for none; then resets it."""
    r = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"shell": (
        f"cat {STALL_LOG} 2>/dev/null" + (f"; : > {STALL_LOG}" if reset else ""))}).raise_for_status().json()
    return max((float(x) for x in r["stdout"].split()), default=0.0)
