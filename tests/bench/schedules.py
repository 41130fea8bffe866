"""Benchmark: schedules, on a stack of its own (real processes, free ports, a temporary directory).

    .venv/bin/python tests/bench/schedules.py --runs 5 --same-minute 500 --sandboxes 25 --json schedules.json

Metrics (docs/DESIGN.md §7), all from the run rows the API records (``fire_at``, ``command_started_at``):

- ``fire_to_command_suspended``: a one-shot schedule's time to its command's start (``true``), the sandbox
  suspended to object storage (the run wakes it from S3 on the node, runs the command, suspends it again);
  ``--runs`` times, the same sandbox (each run leaves it suspended for the next).
- ``fire_to_command_paused``: the same for a sandbox paused in memory.
- ``lateness_same_minute``: ``--same-minute`` one-shot schedules with the same time, spread over
  ``--sandboxes`` running sandboxes on one node; each run's command start against that time. Runs are
  one at a time per sandbox and ``PODBAY_SCHEDULE_NODE_WAKES_MAX`` at once per node, so this measures the
  firer's throughput and fairness, not a wake.

The stack runs with ``PODBAY_SCHEDULE_JITTER_S=--jitter-s`` (default 0: lateness without spread) and
``PODBAY_SCHEDULE_TICK_S=--tick-s`` (default 0.2: the firer looks this often, so up to that is waiting for
the tick). 500 running sandboxes do not fit on a 2-core TCG host (docs/SPECIFICATION.md: ~70), so the
same-minute schedules share ``--sandboxes`` sandboxes (the per-sandbox limit is raised to fit them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays

try:
    from tests.bench._stats import report, stop_on_sigterm, summarise
except ImportError:  # run as a script from the repository root
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, stop_on_sigterm, summarise  # type: ignore[no-redef]


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _create(c: httpx.Client) -> str:
    r = c.post("/v1/sandboxes", json={"template": "base"})
    r.raise_for_status()
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _finished_runs(c: httpx.Client, sid: str, sch: str, n: int, deadline_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        runs = c.get(f"/v1/sandboxes/{sid}/schedules/{sch}/runs", params={"limit": n}).raise_for_status().json()
        done = [r for r in runs["runs"] if r["state"] not in ("queued", "running")]
        if len(done) >= n:
            return list(done)
        time.sleep(0.2)
    raise TimeoutError(f"runs of {sch} not finished within {deadline_s} s")


def _one_shot_lateness(c: httpx.Client, sid: str, runs: int, expect_state: str) -> list[float]:
    """Fire-to-command-start of ``runs`` one-shots on one sandbox, one after another, in ms."""
    out = []
    for _ in range(runs):
        at = datetime.now(UTC) + timedelta(seconds=2)
        sch = c.post(f"/v1/sandboxes/{sid}/schedules", json={"at": at.isoformat(), "command": {"argv": ["true"]}})
        sch.raise_for_status()
        [run] = _finished_runs(c, sid, sch.json()["id"], 1, 300)
        if run["state"] != "succeeded" or not run["command_started_at"]:
            raise RuntimeError(f"run did not succeed: {run}")
        out.append((_ts(run["command_started_at"]) - _ts(run["fire_at"])).total_seconds() * 1000)
        state = c.get(f"/v1/sandboxes/{sid}").raise_for_status().json()["state"]
        if state != expect_state:
            raise RuntimeError(f"sandbox {sid} is {state} after the run, not {expect_state}")
        c.delete(f"/v1/sandboxes/{sid}/schedules/{sch.json()['id']}").raise_for_status()
    return out


def _same_minute(c: httpx.Client, count: int, sandboxes: int) -> list[float]:
    sids = [_create(c) for _ in range(sandboxes)]
    at = (datetime.now(UTC) + timedelta(seconds=15 + count * 0.03)).replace(microsecond=0)
    placed: list[tuple[str, str]] = []
    for i in range(count):
        sid = sids[i % sandboxes]
        r = c.post(f"/v1/sandboxes/{sid}/schedules", json={"at": at.isoformat(), "command": {"argv": ["true"]}})
        r.raise_for_status()
        placed.append((sid, r.json()["id"]))
    if datetime.now(UTC) >= at:
        raise RuntimeError("adding the schedules took past their time; lower --same-minute")
    out = []
    for sid, sch in placed:
        [run] = _finished_runs(c, sid, sch, 1, 600)
        if run["state"] != "succeeded":
            raise RuntimeError(f"run did not succeed: {run}")
        out.append((_ts(run["command_started_at"]) - at).total_seconds() * 1000)
    for sid in sids:
        c.delete(f"/v1/sandboxes/{sid}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="one-shots per wake kind (default 5)")
    ap.add_argument("--same-minute", type=int, default=500, help="schedules with the same time (default 500)")
    ap.add_argument("--sandboxes", type=int, default=25, help="running sandboxes they share (default 25)")
    ap.add_argument("--jitter-s", type=float, default=0.0)
    ap.add_argument("--tick-s", type=float, default=0.2)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    per_sandbox = max(20, -(-args.same_minute // max(1, args.sandboxes)) + 1)
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False,
                  base_env={**os.environ, "PODBAY_SCHEDULE_JITTER_S": str(args.jitter_s),
                            "PODBAY_SCHEDULE_TICK_S": str(args.tick_s), "PODBAY_PAUSED_RELEASE_S": "0",
                            "PODBAY_SCHEDULES_PER_SANDBOX_MAX": str(per_sandbox)})
    results: dict[str, dict[str, Any]] = {}
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"},
                          timeout=900) as c:
            print(f"load average at start: {os.getloadavg()}")
            sid = _create(c)
            c.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
            results["fire_to_command_suspended"] = summarise(_one_shot_lateness(c, sid, args.runs, "suspended"))
            c.delete(f"/v1/sandboxes/{sid}")
            sid = _create(c)
            c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
            results["fire_to_command_paused"] = summarise(_one_shot_lateness(c, sid, args.runs, "paused"))
            c.delete(f"/v1/sandboxes/{sid}")
            if args.same_minute:
                results["lateness_same_minute"] = summarise(_same_minute(c, args.same_minute, args.sandboxes))
            print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root)
        shutil.rmtree(root, ignore_errors=True)  # its PostgreSQL, S3 and node store: over 1 GiB
    report(results, args.json_path)


if __name__ == "__main__":
    main()
