"""Soak benchmark: N concurrent sandboxes under a steady rate of lifecycle operations for a long time.

    .venv/bin/python tests/bench/soak.py [--sandboxes 100] [--rate 1000] [--minutes 30] [--runs N]
        [--template base] [--json soak.json] [--pid NAME=PID ...] [--keep]

Runs against a stack that is already up: the API URL and key come from ``--api-url``/``--api-key``, else
``PODBAY_API_URL``/``PODBAY_API_KEY``, else the config file ``podbay up`` writes. It creates
``--sandboxes`` sandboxes, then starts ``--rate`` operations per minute (open loop: an operation starts on
schedule whether or not earlier ones finished, at most one at a time per sandbox) for ``--minutes``
(``--runs`` caps the number of operations instead, whichever comes first), then deletes its sandboxes.

Operations, chosen at random per idle sandbox: ``exec`` of ``true`` (40%), ``pause`` of a running or
``resume`` of a paused one (30%), a ``snapshot`` (disk, 10%) and ``recreate`` (delete, then create a new
one in its place; 20%). An operation on a paused sandbox other than pause/resume resumes it instead.
While fewer than ``--sandboxes`` exist (a create failed), the next scheduled operation is a create.

Metrics (DESIGN.md §7 format): ``op_<kind>`` latencies (``create``, ``exec``, ``pause``, ``resume``,
``snapshot``, ``delete``); ``errors_<kind>`` and ``errors_total`` (answers >= 400 or no answer);
``lost_sandboxes`` (one of ours that ended ``failed`` or vanished without our delete, checked after each
404 and at the end); ``ops_per_min`` achieved; ``rss_<process>_start_MiB``/``_end_MiB`` for each service
process: from ``--pid NAME=PID`` when given, else the pids ``podbay status --json`` reports, else every
process whose command line names a podbay service (all stacks on the host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from podbay.clientconfig import load_client_config

try:
    from tests.bench._stats import report, summarise
except ImportError:  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, summarise  # type: ignore[no-redef]

SERVICES = ("podbay-api", "podbay-scheduler", "podbay-nodeagent", "podbay-snapshotter", "podbay-warmpool",
            "podbay-gateway", "nats-server", "postgres", "weed")
WEIGHTS = (("exec", 40), ("pausetoggle", 30), ("snapshot", 10), ("recreate", 20))


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def find_pids(explicit: list[str]) -> dict[str, int]:
    """Service name -> pid (see the module docstring for where they come from)."""
    if explicit:
        out = {}
        for item in explicit:
            name, _, pid = item.partition("=")
            out[name] = int(pid)
        return out
    exe = Path(sys.executable).with_name("podbay")
    try:
        st = subprocess.run([str(exe), "status", "--json"], capture_output=True, text=True, timeout=30)
        parts = json.loads(st.stdout or "[]")
        found = {str(p["name"]): int(p["pid"]) for p in parts if p.get("pid")}
        if found:
            return found
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name in SERVICES:
            words = cmd.split()
            if words and any(Path(w).name == name or w.endswith(f"/{name}") for w in words[:2]):
                found[f"{name}.{proc.name}"] = int(proc.name)
    return found


def rss(pids: dict[str, int]) -> dict[str, float]:
    return {name: round(v, 1) for name, pid in pids.items() if (v := _rss_mib(pid)) is not None}


class Soak:
    """The run's state: our sandboxes, per-kind samples and errors, lost sandboxes."""

    def __init__(self, http: httpx.AsyncClient, template: str) -> None:
        self.http = http
        self.template = template
        self.state: dict[str, str] = {}  # sandbox id -> "running" | "paused"
        self.busy: set[str] = set()
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.error_examples: list[str] = []
        self.lost: set[str] = set()
        self.ops = 0
        self.creating = 0

    async def _timed(self, kind: str, method: str, path: str, **kw: Any) -> httpx.Response | None:
        t0 = time.perf_counter()
        try:
            r = await self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            self._error(kind, f"{kind} {path}: {type(exc).__name__} {exc}")
            return None
        ms = (time.perf_counter() - t0) * 1000
        if r.status_code >= 400 or r.status_code == 202:
            self._error(kind, f"{kind} {path}: {r.status_code} {r.text[:200]}")
            return r
        self.samples[kind].append(ms)
        return r

    def _error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(what)

    async def create(self) -> str | None:
        r = await self._timed("create", "POST", "/v1/sandboxes", json={"template": self.template})
        if r is None or r.status_code != 201:
            return None
        sid = str(r.json()["id"])
        self.state[sid] = "running"
        return sid

    async def top_up(self) -> None:
        """One create that brings the pool back towards its target."""
        self.creating += 1
        self.ops += 1
        try:
            await self.create()
        finally:
            self.creating -= 1

    async def delete(self, sid: str) -> None:
        self.state.pop(sid, None)
        await self._timed("delete", "DELETE", f"/v1/sandboxes/{sid}")

    async def check_lost(self, sid: str) -> None:
        """After a 404 or a failed answer: is the sandbox gone or failed although we did not delete it?"""
        try:
            r = await self.http.get(f"/v1/sandboxes/{sid}")
        except httpx.HTTPError:
            return
        if r.status_code == 404 or (r.status_code == 200 and r.json().get("state") in ("failed", "deleted")):
            self.lost.add(sid)
            self.state.pop(sid, None)

    async def operate(self, sid: str) -> None:
        self.busy.add(sid)
        self.ops += 1
        try:
            kind = random.choices([k for k, _ in WEIGHTS], [w for _, w in WEIGHTS])[0]
            paused = self.state.get(sid) == "paused"
            if paused and kind != "recreate":
                kind = "resume"
            elif kind == "pausetoggle":
                kind = "pause"
            if kind == "recreate":
                await self.delete(sid)
                await self.create()
                return
            r = None
            if kind == "exec":
                r = await self._timed("exec", "POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            elif kind in ("pause", "resume"):
                r = await self._timed(kind, "POST", f"/v1/sandboxes/{sid}/{kind}")
                if r is not None and r.status_code == 200:
                    self.state[sid] = "paused" if kind == "pause" else "running"
            elif kind == "snapshot":
                r = await self._timed("snapshot", "POST", f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"})
            if r is None or r.status_code >= 400:
                await self.check_lost(sid)
        finally:
            self.busy.discard(sid)

    async def final_check(self) -> None:
        r = await self.http.get("/v1/sandboxes", params={"limit": 1000})
        r.raise_for_status()
        body = r.json()
        listed = {s["id"]: s["state"] for s in body.get("sandboxes", body if isinstance(body, list) else [])}
        for sid in list(self.state):
            if listed.get(sid) in (None, "failed", "deleted"):
                await self.check_lost(sid)


async def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    cfg = load_client_config(args.api_url, args.api_key)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    pids = find_pids(args.pid)
    rss_start = rss(pids)
    limits = httpx.Limits(max_connections=max(64, args.sandboxes * 2))
    async with httpx.AsyncClient(base_url=cfg.api_url, headers=headers, timeout=180, limits=limits) as http:
        soak = Soak(http, args.template)
        sem = asyncio.Semaphore(8)

        async def one() -> None:
            async with sem:
                await soak.create()

        print(f"creating {args.sandboxes} sandboxes ...", file=sys.stderr)
        await asyncio.gather(*(one() for _ in range(args.sandboxes)))
        print(f"{len(soak.state)} sandboxes; {args.rate} ops/min for {args.minutes} min", file=sys.stderr)
        interval = 60.0 / args.rate
        t_start = time.monotonic()
        deadline = t_start + args.minutes * 60
        tasks: set[asyncio.Task[None]] = set()
        next_at = t_start
        started = 0
        skipped = 0
        while time.monotonic() < deadline and (args.runs is None or started < args.runs):
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
            if len(soak.state) + soak.creating < args.sandboxes:
                # Below the target (a create failed, or a recreate's create did): top up first.
                task = asyncio.create_task(soak.top_up())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                started += 1
                continue
            idle = [s for s in soak.state if s not in soak.busy]
            if not idle:
                skipped += 1  # every sandbox busy: the stack is behind the rate
                continue
            task = asyncio.create_task(soak.operate(random.choice(idle)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            started += 1
        if tasks:
            await asyncio.wait(tasks)
        elapsed_min = (time.monotonic() - t_start) / 60
        await soak.final_check()
        rss_end = rss(pids)
        if not args.keep:
            await asyncio.gather(*(soak.delete(s) for s in list(soak.state)))
    results: dict[str, dict[str, Any]] = {}
    for kind in ("create", "exec", "pause", "resume", "snapshot", "delete"):
        if soak.samples[kind]:
            results[f"op_{kind}"] = summarise(soak.samples[kind])
    for kind in sorted(soak.errors):
        results[f"errors_{kind}"] = {"value": soak.errors[kind]}
    results["errors_total"] = {"value": sum(soak.errors.values())}
    results["lost_sandboxes"] = {"value": len(soak.lost)}
    results["ops_per_min"] = {"value": round(soak.ops / elapsed_min, 1) if elapsed_min else 0}
    results["ops_skipped_all_busy"] = {"value": skipped}
    for name in sorted(set(rss_start) | set(rss_end)):
        results[f"rss_{name}_start_MiB"] = {"value": rss_start.get(name)}
        results[f"rss_{name}_end_MiB"] = {"value": rss_end.get(name)}
    for line in soak.error_examples:
        print(f"error: {line}", file=sys.stderr)
    if soak.lost:
        print(f"lost: {' '.join(sorted(soak.lost))}", file=sys.stderr)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=100, help="Concurrent sandboxes kept (default 100).")
    p.add_argument("--rate", type=float, default=1000.0, help="Operations started per minute (default 1000).")
    p.add_argument("--minutes", type=float, default=30.0, help="How long to drive the load (default 30).")
    p.add_argument("--runs", type=int, default=None, help="Stop after this many operations (default: by time).")
    p.add_argument("--template", default="base")
    p.add_argument("--api-url", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", action="append", default=[], metavar="NAME=PID",
                   help="A service process whose RSS to report; repeatable.")
    p.add_argument("--keep", action="store_true", help="Leave the sandboxes running at the end.")
    p.add_argument("--json", default=None, metavar="PATH", help="Write the metrics as JSON.")
    args = p.parse_args()
    if args.sandboxes < 1 or args.rate <= 0 or args.minutes <= 0:
        raise SystemExit("--sandboxes, --rate and --minutes must be positive")
    report(asyncio.run(run(args)), args.json)


if __name__ == "__main__":
    main()
