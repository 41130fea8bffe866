"""Soak benchmark: N sandboxes under a steady rate of lifecycle operations for a long time (docs/DESIGN.md §7).

    .venv/bin/python tests/bench/soak.py [--own-stack --nodes 2] [--sandboxes 100] [--rate 1000]
        [--minutes 30] [--max-inflight 16] [--mix exec=30,...] [--runs N] [--json soak.json]

With ``--own-stack`` it starts a stack of its own in a temporary directory on free ports (``--nodes 2``: two
nodes, each in its own network namespace with its own node agent, snapshotter and gateway) and purges it at
the end; ``PODBAY_*`` variables in the environment reach every service. Without it, it drives a stack that is
already up: the API URL and key come from ``--api-url``/``--api-key``, else ``PODBAY_API_URL``/
``PODBAY_API_KEY``, else the config file ``podbay up`` writes. It talks to that API only.

It creates ``--sandboxes`` sandboxes, then starts ``--rate`` operations per minute for ``--minutes``
(``--runs`` caps their number instead, whichever comes first). Each tick of the schedule starts one
operation on a random idle sandbox, drawn from the ``--mix`` among those its state allows (_soakbook.py):
exec of ``true``, pause, resume, disk and full snapshot, suspend, resume from S3 (of a suspended sandbox),
fork (the child joins the set) and delete. While fewer than N sandboxes exist the tick creates one; while
more exist (after a fork) it deletes one. Work never piles up: at most one operation runs per sandbox, and
when ``--max-inflight`` operations run (default 8 per core) the tick is skipped and counted as
``skipped_backpressure``, so the achieved rate is honest. A 202 is a slow answer, not an error: the soak
follows ``GET /v1/operations/{id}`` until the operation ends (bounded by ``--op-timeout``).

At the end (also on Ctrl-C or SIGTERM) it deletes every sandbox it made, fork children and failed ones too.
Everything is bounded: the load stops at its deadline, running operations get ``--drain-s`` to finish, the
final checks and the cleanup have bounds of their own.

Metrics (docs/DESIGN.md §7 format):

- ``op_<op>``: latency of each successful operation, request to end (following a 202), for ``create``,
  ``exec``, ``pause``, ``resume``, ``snapshot_disk``, ``snapshot_full``, ``suspend``, ``resume_s3``, ``fork``,
  ``delete``; ``setup_create`` for the creates before the load;
- ``errors_<op>_<status>_<code>`` per kind (HTTP status and error code, ``noanswer_<exception>``,
  ``opfailed_<code>`` for a followed operation that failed, ``timeout_follow``), and ``errors_total``;
- ``answers_202_<op>``: slow answers followed; ``state_drift``: sandboxes the stack moved on its own;
- ``lost_sandboxes`` (ours that ended ``failed`` or vanished without our delete) and ``lost_snapshots``
  (listed before, gone without a delete, retention or a suspend explaining it), both with goal 0;
  ``snapshots_retired`` and ``snapshots_dropped_by_suspend`` for the explained ones;
- ``ops_started``, ``ops_ok``, ``ops_failed``, ``ops_per_min`` (started), ``ops_ok_per_min``,
  ``target_ops_per_min``, ``skipped_backpressure``, ``skipped_all_busy``, ``skipped_late`` (the schedule
  fell behind by more than a second), ``ops_cut_at_end`` (still running after ``--drain-s``),
  ``max_inflight``, ``load_minutes``, ``sandboxes_made``, ``sandboxes_left`` (ours not deleted after the
  cleanup; goal 0);
- ``rss_<process>_MiB``: ``value`` at the end, ``start``, ``max`` and ``samples`` (``{"min", "MiB"}``, minutes
  from the start of the load: before the setup, at the start, every ``--rss-every-min`` and at the end) of
  every service process: API, scheduler, warm pool, each node's agent, snapshotter and gateway, NATS,
  PostgreSQL (the PSS of the postmaster and its backends) and SeaweedFS (_soakrss.py). With ``--own-stack``
  from the stack's own processes; else from ``--pid NAME=PID``, else ``podbay status --json``, else every
  process whose command line names a podbay service. Printed as a table of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from podbay.clientconfig import load_client_config
from podbay.config import Settings

try:
    from tests.bench._soakbook import DEFAULT_MIX, STABLE, Books, Box, Snap, parse_mix, pick_op, snapshot_losses
    from tests.bench._soakrss import RssLog, find_pids, print_rss_table, stack_pids
    from tests.bench._stats import report, summarise
except ImportError:  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _soakbook import (  # type: ignore[no-redef]
        DEFAULT_MIX, STABLE, Books, Box, Snap, parse_mix, pick_op, snapshot_losses)
    from _soakrss import RssLog, find_pids, print_rss_table, stack_pids  # type: ignore[no-redef]
    from _stats import report, summarise  # type: ignore[no-redef]
OP_NAMES = ("create", "exec", "pause", "resume", "snapshot_disk", "snapshot_full", "suspend", "resume_s3", "fork",
            "delete")
SETTLE_S = 60.0  # how long to wait for a sandbox in a transitional state to come to rest after an error


# --- the run ------------------------------------------------------------------------------------------------

class Soak:
    """Our sandboxes and the operations on them; every outcome goes into :class:`Books`."""

    def __init__(self, http: httpx.AsyncClient, args: argparse.Namespace) -> None:
        self.http = http
        self.args = args
        self.mix = parse_mix(args.mix)
        self.rng = random.Random(args.seed)
        self.books = Books()
        self.pool: dict[str, Box] = {}  # our live sandboxes
        self.busy: set[str] = set()  # sandboxes with an operation (or a check) in flight
        self.limbo: set[str] = set()  # ours that did not come to rest in time; checked again at each audit
        self.tasks: set[asyncio.Task[None]] = set()
        self.auditing: asyncio.Task[None] | None = None
        self.creating = 0
        self.create_backoff_until = 0.0
        # Every sandbox of this run carries it (fork children inherit it), so the cleanup finds even one whose
        # create was cut off before it answered.
        self.run_tag = {"podbay-soak": f"{os.getpid()}-{int(time.time())}"}
        s = Settings()
        self.keep = {"disk": s.retain_disk_snapshots, "full": s.retain_full_snapshots}

    # -- one HTTP call, followed to its end --

    async def call(self, op: str, method: str, path: str, *, body: Any = None, record: bool = True,
                   ) -> tuple[bool, dict[str, Any], float]:
        """Send one request; a 202 is followed through ``GET /v1/operations/{id}`` until the operation ends.
        Returns ``(ok, answer body, ms from request to end)``; failures are counted under their kind."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.args.op_timeout
        try:
            r = await self.http.request(method, path, json=body, timeout=self.args.op_timeout)
        except httpx.HTTPError as exc:
            self.books.error(op, "noanswer", type(exc).__name__, f"{method} {path}: {type(exc).__name__} {exc}")
            return False, {}, 0.0
        try:
            data = r.json() if r.content else {}
        except ValueError:
            data = {}
        if r.status_code >= 400:
            err = data.get("error") or {} if isinstance(data, dict) else {}
            self.books.error(op, r.status_code, err.get("code"), f"{r.status_code} {method} {path}: {r.text[:300]}")
            if r.status_code in (429, 503):
                try:
                    wait = float(r.headers.get("retry-after", "2"))
                except ValueError:
                    wait = 2.0
                self.create_backoff_until = time.monotonic() + min(wait, 10.0)
            return False, data if isinstance(data, dict) else {}, 0.0
        if r.status_code == 202:
            self.books.slow[op] += 1
            if not await self.follow(op, str(data.get("operation_id") or ""), deadline):
                return False, data, 0.0
        ms = (time.perf_counter() - t0) * 1000
        if record:
            self.books.samples[op].append(ms)
        return True, data, ms

    async def follow(self, op: str, op_id: str, deadline: float) -> bool:
        """Poll the operation until it succeeds (True), fails or the deadline passes (counted, False)."""
        if not op_id:
            self.books.error(op, "202", "no_operation_id", "202 without an operation id")
            return False
        delay = 0.02
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 1.5)
            try:
                r = await self.http.get(f"/v1/operations/{op_id}", timeout=30)
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                continue
            info = r.json()
            if info["state"] == "succeeded":
                return True
            if info["state"] == "failed":
                err = info.get("error") or {}
                self.books.error(op, "opfailed", err.get("code"), f"operation {op_id}: {err.get('message')}")
                return False
        self.books.error(op, "timeout", "follow", f"operation {op_id} still running after {self.args.op_timeout} s")
        return False

    # -- state of a sandbox --

    async def look(self, sid: str) -> str | None:
        """The sandbox's state now; ``"gone"`` for a 404; None when the API did not answer."""
        try:
            r = await self.http.get(f"/v1/sandboxes/{sid}", timeout=30)
        except httpx.HTTPError:
            return None
        if r.status_code == 404:
            return "gone"
        return str(r.json()["state"]) if r.status_code == 200 else None

    async def settle(self, box: Box, *, ours: bool = True) -> None:
        """After an unclear outcome: wait (bounded) until the sandbox rests, and take its state as ours; one
        that failed or vanished leaves the set, counted as lost when it was ``ours`` (running before; a create
        or fork child that never ran is its call's error), and a failed one is deleted at once, so its VM
        does not linger. One that does not come to rest goes to limbo (checked again at each audit)."""
        deadline = time.monotonic() + SETTLE_S
        state = None
        while time.monotonic() < deadline:
            state = await self.look(box.id)
            if state is not None and (state in STABLE or state in ("failed", "deleted", "gone")):
                break
            await asyncio.sleep(0.5)
        if state in STABLE:
            box.state = state  # type: ignore[assignment]
        elif state in ("failed", "deleted", "gone"):
            self.lose(box, state, counted=ours)
        else:
            self.pool.pop(box.id, None)
            self.limbo.add(box.id)

    def lose(self, box: Box, state: str | None, *, counted: bool = True) -> None:
        """Drop a sandbox that failed or vanished; it is lost when ``counted`` unless we deleted it ourselves.
        A gone one needs no cleanup; a failed one is deleted now."""
        self.pool.pop(box.id, None)
        self.limbo.discard(box.id)
        if counted and box.id not in self.books.deleted:
            self.books.lost.add(box.id)
            if len(self.books.examples) < 30:
                self.books.examples.append(f"lost {box.id}: {state}")
        if state in ("deleted", "gone"):
            self.books.deleted.add(box.id)
        elif state == "failed":
            self.spawn(self.remove(box.id))

    async def remove(self, sid: str) -> None:
        """Delete one of ours outside the books (a failed one, or the cleanup)."""
        try:
            r = await self.http.delete(f"/v1/sandboxes/{sid}", timeout=self.args.op_timeout)
            if r.status_code < 300 or r.status_code in (404, 409):
                self.books.deleted.add(sid)
        except httpx.HTTPError:
            pass

    async def check_snaps(self, box: Box) -> None:
        """List the sandbox's snapshots; one listed before that is gone unexplained is lost."""
        try:
            r = await self.http.get(f"/v1/sandboxes/{box.id}/snapshots", timeout=30)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        listed = {s["id"]: Snap(s["kind"], str(s["created_at"]), s.get("promotion")) for s in r.json()["snapshots"]}
        lost, retired, dropped = snapshot_losses(box.snaps, listed, self.keep, box.suspended_since_list)
        for sid in lost:
            self.books.lost_snapshots.add(sid)
            if len(self.books.examples) < 30:
                self.books.examples.append(f"lost snapshot {sid} of {box.id} ({box.snaps[sid].kind})")
        self.books.retired_snapshots += retired
        self.books.suspend_dropped_snapshots += dropped
        box.snaps, box.suspended_since_list = listed, False

    # -- operations --

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def create(self, op: str = "create") -> None:
        self.creating += 1
        try:
            ok, data, _ = await self.call(op, "POST", "/v1/sandboxes",
                                          body={"template": self.args.template, "metadata": self.run_tag})
            sid = data.get("id") or (data.get("error") or {}).get("details", {}).get("sandbox_id")
            if sid:
                self.books.made.add(str(sid))
            if op == "create":  # a top-up during the load (the setup's creates are not operations of the rate)
                self.books.ok += ok
                self.books.failed += not ok
            if ok and sid:
                self.pool[sid] = Box(sid, "running")
            elif sid:
                box = Box(sid, "pending")
                self.pool[sid] = box
                self.busy.add(sid)
                try:
                    await self.settle(box, ours=False)
                finally:
                    self.busy.discard(sid)
        finally:
            self.creating -= 1

    async def operate(self, box: Box, op: str) -> None:
        """Run ``op`` on ``box`` (marked busy by the caller) and keep our view of it right."""
        sid, base = box.id, f"/v1/sandboxes/{box.id}"
        try:
            ok, data = False, {}
            if op == "exec":
                ok, data, ms = await self.call(op, "POST", f"{base}/exec", body={"argv": ["true"]}, record=False)
                if ok and data.get("exit_code") != 0:
                    self.books.error(op, "exit", str(data.get("exit_code")), f"exec true in {sid}: {data}")
                    ok = False
                elif ok:
                    self.books.samples[op].append(ms)
            elif op in ("pause", "resume", "resume_s3", "suspend"):
                verb = "resume" if op == "resume_s3" else op
                ok, data, _ = await self.call(op, "POST", f"{base}/{verb}")
                if ok:
                    box.state = {"pause": "paused", "suspend": "suspended"}.get(op, "running")
                    box.suspended_since_list |= op == "suspend"
            elif op in ("snapshot_disk", "snapshot_full"):
                ok, data, _ = await self.call(op, "POST", f"{base}/snapshots", body={"kind": op.split("_")[1]})
            elif op == "fork":
                ok, data, _ = await self.call(op, "POST", f"{base}/fork", body={"count": 1})
                for child in data.get("children", []):
                    await self._adopt(child)
            elif op == "delete":
                ok, data, _ = await self.call(op, "DELETE", base)
                if ok or (data.get("error") or {}).get("code") == "not_found":
                    self.books.deleted.add(sid)
                    self.pool.pop(sid, None)
                    ok = True
            if ok:
                self.books.ok += 1
            else:
                self.books.failed += 1
            if sid in self.pool:
                if not ok:  # a failed delete that went through anyway is not a loss
                    await self.settle(box, ours=op != "delete")
                if sid in self.pool and op in ("snapshot_disk", "snapshot_full", "suspend", "resume_s3", "fork"):
                    await self.check_snaps(box)
        finally:
            self.busy.discard(sid)

    async def _adopt(self, child: dict[str, Any]) -> None:
        """A fork child joins our set when it runs; one that does not is counted and deleted."""
        cid = str(child["sandbox_id"])
        self.books.made.add(cid)
        state = child.get("state")
        if state not in STABLE:
            box = Box(cid, str(state))
            self.pool[cid] = box
            self.busy.add(cid)
            try:
                await self.settle(box, ours=False)
            finally:
                self.busy.discard(cid)
            state = box.state if cid in self.pool else state
        if state == "running":
            self.pool.setdefault(cid, Box(cid, "running")).state = "running"
        elif cid in self.pool or state == "failed":
            self.books.error("fork", "child", str(state), f"fork child {cid} is {state}: {child.get('failure_reason')}")
            self.pool.pop(cid, None)
            self.spawn(self.remove(cid))

    # -- audits --

    async def audit(self) -> None:
        """Look at every idle sandbox of ours (one at a time, marked busy meanwhile, so no operation changes
        it under the look) and list its snapshots; take back those in limbo that came to rest."""
        for sid in list(self.limbo):
            state = await self.look(sid)
            if state in STABLE:
                self.limbo.discard(sid)
                self.pool[sid] = Box(sid, str(state))
            elif state in ("failed", "deleted", "gone"):
                self.lose(Box(sid, str(state)), state)
        for box in list(self.pool.values()):
            if box.id in self.busy:
                continue
            self.busy.add(box.id)
            try:
                state = await self.look(box.id)
                if state in ("failed", "deleted", "gone"):
                    self.lose(box, state)
                    continue
                if state in STABLE and state != box.state:
                    self.books.state_drift += 1
                    box.state = str(state)
                await self.check_snaps(box)
            finally:
                self.busy.discard(box.id)

    async def cleanup(self) -> None:
        """Stop what still runs, then delete every sandbox we made that we have not deleted: those we know
        and those the API lists with this run's tag (bounded by ``--cleanup-s``)."""
        running = [t for t in (*self.tasks, self.auditing) if t is not None and not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=10)
        sem = asyncio.Semaphore(self.args.max_inflight)

        async def one(sid: str) -> None:
            async with sem:
                await self.remove(sid)

        try:
            r = await self.http.get("/v1/sandboxes", params={"limit": 1000}, timeout=60)
            if r.status_code == 200:
                tag = next(iter(self.run_tag.items()))
                self.books.made |= {s["id"] for s in r.json()["sandboxes"]
                                    if (s.get("metadata") or {}).get(tag[0]) == tag[1]}
        except httpx.HTTPError:
            pass
        todo = sorted(self.books.made - self.books.deleted)
        if todo:
            print(f"deleting {len(todo)} sandboxes ...", file=sys.stderr)
            await asyncio.wait_for(asyncio.gather(*(one(s) for s in todo)), self.args.cleanup_s)

    # -- the schedule --

    def tick(self) -> str:
        """Start what this tick of the schedule calls for; returns what it did (for the counters)."""
        if len(self.tasks) >= self.args.max_inflight:
            return "skipped_backpressure"
        if len(self.pool) + self.creating + len(self.limbo) < self.args.sandboxes \
                and time.monotonic() >= self.create_backoff_until:
            self.spawn(self.create())
            return "started"
        idle = [b for b in self.pool.values() if b.id not in self.busy and b.state in STABLE]
        if not idle:
            return "skipped_all_busy"
        box = self.rng.choice(idle)
        op = "delete" if len(self.pool) > self.args.sandboxes else pick_op(box.state, self.mix, self.rng)
        if op is None:
            return "skipped_all_busy"
        self.busy.add(box.id)
        self.spawn(self.operate(box, op))
        return "started"


async def drive(soak: Soak, args: argparse.Namespace, rss: RssLog, counts: dict[str, int]) -> float:
    """The load phase: returns its length in minutes."""
    interval = 60.0 / args.rate
    t_start = time.monotonic()
    rss.t0 = t_start
    rss.sample()
    deadline = t_start + args.minutes * 60
    next_rss = t_start + args.rss_every_min * 60
    next_at = t_start
    while time.monotonic() < deadline and (args.runs is None or soak.books.started < args.runs):
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        now = time.monotonic()
        if now >= next_rss:
            rss.sample()
            if soak.auditing is None or soak.auditing.done():  # an audit is a read, outside the in-flight cap
                soak.auditing = asyncio.create_task(soak.audit())
            next_rss += args.rss_every_min * 60
        next_at += interval
        if now - next_at > 1.0:  # the loop fell behind: skip the missed ticks rather than burst them
            counts["skipped_late"] += int((now - next_at) / interval)
            next_at = now
        what = soak.tick()
        counts[what] += 1
        if what == "started":
            soak.books.started += 1
    return (time.monotonic() - t_start) / 60


async def run(args: argparse.Namespace, api_url: str, api_key: str | None,
              pids: Callable[[], dict[str, int]]) -> dict[str, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_inflight * 2 + 8)
    rss = RssLog(pids)
    rss.sample()
    counts = {"started": 0, "skipped_backpressure": 0, "skipped_all_busy": 0, "skipped_late": 0,
              "ops_cut_at_end": 0}
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)  # cleans up like Ctrl-C
    async with httpx.AsyncClient(base_url=api_url, headers=headers, limits=limits) as http:
        soak = Soak(http, args)
        minutes = 0.0
        try:
            print(f"creating {args.sandboxes} sandboxes ...", file=sys.stderr)
            sem = asyncio.Semaphore(args.max_inflight)

            async def one() -> None:
                async with sem:
                    await soak.create("setup_create")

            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(args.sandboxes))), args.setup_s)
            print(f"{len(soak.pool)} sandboxes; {args.rate:g} ops/min for {args.minutes:g} min, at most "
                  f"{args.max_inflight} in flight", file=sys.stderr)
            minutes = await drive(soak, args, rss, counts)
            if soak.tasks:
                print(f"draining {len(soak.tasks)} operations ...", file=sys.stderr)
                _, pending = await asyncio.wait(set(soak.tasks), timeout=args.drain_s)
                for task in pending:
                    task.cancel()
                counts["ops_cut_at_end"] = len(pending)
            if soak.auditing is not None:
                await asyncio.wait([soak.auditing], timeout=args.drain_s)
                soak.auditing.cancel()
            await asyncio.wait_for(soak.audit(), args.drain_s)
            rss.sample()
        finally:
            try:
                await soak.cleanup()
            except TimeoutError:
                print("cleanup ran out of time", file=sys.stderr)
            left = soak.books.made - soak.books.deleted
    return {**metrics(soak, counts, minutes, args, len(left)), **rss.metrics()}


def metrics(soak: Soak, counts: dict[str, int], minutes: float, args: argparse.Namespace,
            left: int) -> dict[str, dict[str, Any]]:
    b = soak.books
    out: dict[str, dict[str, Any]] = {}
    for op in ("setup_create", *OP_NAMES):
        if b.samples[op]:
            out[f"op_{op}"] = summarise(b.samples[op])
    for kind in sorted(b.errors):
        out[f"errors_{kind}"] = {"value": b.errors[kind]}
    out["errors_total"] = {"value": sum(b.errors.values())}
    for op in sorted(b.slow):
        out[f"answers_202_{op}"] = {"value": b.slow[op]}
    out["lost_sandboxes"] = {"value": len(b.lost)}
    out["lost_snapshots"] = {"value": len(b.lost_snapshots)}
    out["snapshots_retired"] = {"value": b.retired_snapshots}
    out["snapshots_dropped_by_suspend"] = {"value": b.suspend_dropped_snapshots}
    out["state_drift"] = {"value": b.state_drift}
    out["ops_started"] = {"value": b.started}
    out["ops_ok"] = {"value": b.ok}
    out["ops_failed"] = {"value": b.failed}
    out["target_ops_per_min"] = {"value": args.rate}
    out["ops_per_min"] = {"value": round(b.started / minutes, 1) if minutes else 0}
    out["ops_ok_per_min"] = {"value": round(b.ok / minutes, 1) if minutes else 0}
    for what in ("skipped_backpressure", "skipped_all_busy", "skipped_late", "ops_cut_at_end"):
        out[what] = {"value": counts[what]}
    out["max_inflight"] = {"value": args.max_inflight}
    out["load_minutes"] = {"value": round(minutes, 2)}
    out["sandboxes_made"] = {"value": len(b.made)}
    out["sandboxes_left"] = {"value": left}
    for line in b.examples:
        print(f"error: {line}", file=sys.stderr)
    return out


# --- own stack and entry point ------------------------------------------------------------------------------

def own_stack(nodes: int, root: Path) -> Any:
    """A started stack of our own under ``root`` with an API key (two or more nodes: one network namespace each)."""
    from podbay.devstack.stack import External, Stack, StackPorts

    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False,
                  node_ids=[f"node-{chr(ord('a') + i)}" for i in range(nodes)] if nodes > 1 else [],
                  base_env=dict(os.environ))
    print(f"starting a stack with {nodes} node(s) ...", file=sys.stderr)
    stack.start()
    stack.create_api_key("soak", "soak")
    return stack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = os.cpu_count() or 1
    p.add_argument("--sandboxes", type=int, default=100, help="Sandboxes kept (default 100).")
    p.add_argument("--rate", type=float, default=1000.0, help="Operations started per minute (default 1000).")
    p.add_argument("--minutes", type=float, default=30.0, help="How long to drive the load (default 30).")
    p.add_argument("--runs", type=int, default=None, help="Stop after this many operations (default: by time).")
    p.add_argument("--max-inflight", type=int, default=8 * cores,
                   help=f"Operations in flight at most; a tick beyond it is skipped (default 8 per core: {8 * cores}).")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"Operation weights (default {DEFAULT_MIX}).")
    p.add_argument("--op-timeout", type=float, default=300.0, help="Bound on one operation, s (default 300).")
    p.add_argument("--setup-s", type=float, default=1200.0, help="Bound on creating the sandboxes, s.")
    p.add_argument("--drain-s", type=float, default=120.0, help="Bound on the operations still running at the end.")
    p.add_argument("--cleanup-s", type=float, default=300.0, help="Bound on deleting our sandboxes at the end.")
    p.add_argument("--rss-every-min", type=float, default=5.0, help="RSS sample (and audit) interval, min.")
    p.add_argument("--seed", type=int, default=None, help="Seed of the operation draw.")
    p.add_argument("--template", default="base")
    p.add_argument("--own-stack", action="store_true", help="Start (and purge) a stack of our own.")
    p.add_argument("--nodes", type=int, default=2, help="Nodes of the own stack (default 2).")
    p.add_argument("--keep-data", action="store_true", help="Keep the own stack's directory (logs).")
    p.add_argument("--api-url", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", action="append", default=[], metavar="NAME=PID",
                   help="A service process whose RSS to sample (running stack); repeatable.")
    p.add_argument("--json", default=None, metavar="PATH", help="Write the metrics as JSON.")
    args = p.parse_args()
    if args.sandboxes < 1 or args.rate <= 0 or args.minutes <= 0 or args.max_inflight < 1 or args.nodes < 1:
        p.error("--sandboxes, --rate, --minutes, --max-inflight and --nodes must be positive")
    try:
        parse_mix(args.mix)
    except ValueError as exc:
        p.error(str(exc))
    stack, root = None, None
    results: dict[str, dict[str, Any]] = {}
    try:
        if args.own_stack:
            root = Path(tempfile.mkdtemp(prefix="podbay-soak-"))
            os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
            stack = own_stack(args.nodes, root)
            api_url, api_key = stack.api_url, stack.api_key
            pids: Callable[[], dict[str, int]] = lambda: stack_pids(stack)  # noqa: E731
        else:
            cfg = load_client_config(args.api_url, args.api_key)
            api_url, api_key = cfg.api_url, cfg.api_key
            found = find_pids(args.pid)
            pids = lambda: found  # noqa: E731
        print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
        results = asyncio.run(run(args, api_url, api_key, pids))
        print(f"load average at end: {os.getloadavg()}", file=sys.stderr)
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: our sandboxes were deleted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if stack is not None:
            from podbay.devstack.stack import kill_strays

            stack.stop(purge=True)
            kill_strays(root / "stack")  # type: ignore[operator]
        if root is not None and not args.keep_data:
            shutil.rmtree(root, ignore_errors=True)
    rss_metrics = {k: v for k, v in results.items() if k.startswith("rss_")}
    report({k: v for k, v in results.items() if k not in rss_metrics}, None)
    print_rss_table(rss_metrics)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
