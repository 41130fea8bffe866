"""Benchmark: what a busy sandbox costs the host, beside an idle one, and the speed the TCG translation buffer's
bound leaves (docs/DESIGN.md §7 "running sandboxes on one 24 GiB node"; the issue "dense nodes").

    .venv/bin/python tests/bench/density.py --busy 4 --loop-s 60 --json density.json [--tcg-tb-size-mib 64]
    .venv/bin/python tests/bench/density.py --runs 3 --idle 0 --busy 0 --idle-counts 0,50,150,max --json idle.json \
        [--node-cpu-pressure-max 0]

It starts its own stack of real processes in a temporary directory on free ports (as ``create.py`` does);
``--tcg-tb-size-mib`` sets ``PODBAY_TCG_TB_SIZE_MIB`` in that stack (default: the setting in force), so two
runs compare sizes.

Phases, in order:

- ``create_cold``: ``POST /v1/sandboxes`` until 201, no warm pool (restore of the template snapshot, whose
  guest starts with an empty translation cache); ``--runs`` creates, each deleted;
- ``exec_true``: ``POST .../exec`` of ``true`` on one sandbox, ``--runs`` times;
- idle: ``--idle`` sandboxes created one after another and left alone 3 s; ``idle_running_sandboxes_per_GiB``
  is 1 GiB over their mean QEMU PSS (the RAM file's pages a guest touched count, as in ``create.py``);
- busy: ``--busy`` sandboxes at once, each running the fixed workload, one step after another:

  1. a Python import and compile: ``compileall`` of the standard library's ``json`` package (forced), then one
     interpreter importing a dozen standard modules (``busy_compile_import``, ms);
  2. a file tree walk, ``find / -xdev`` (``busy_find``, ms);
  3. ``--loop-s`` seconds of the shell loop ``echo $i > /tmp/c; sleep 0.1`` (bash, bounded by ``$SECONDS``);
     ``busy_loop_iterations_per_s`` is how many rounds fit per second (10 at most; fewer when the guests
     are slow).

  Then, per sandbox: its QEMU's PSS, its guest's own use (``MemTotal - MemAvailable`` of ``/proc/meminfo``
  inside) and the resident part of TCG's translation buffer (``podbay.vmmem.tcg_buffer_mib``).
  ``busy_host_overhead_MiB_per_sandbox`` is the mean of PSS minus guest use (``max`` the largest);
  ``busy_running_sandboxes_per_GiB`` is 1 GiB over the mean PSS; ``busy_qemu_pss_MiB_per_sandbox``,
  ``busy_guest_used_MiB_per_sandbox`` and ``busy_tcg_buffer_MiB_per_sandbox`` are the parts.

The guest's page cache (the files ``find`` and Python read) counts as available inside the guest but its pages
are in the RAM file on the host, so it is part of the overhead as measured here.

Idle density (the issue "idle costs nothing"), with ``--idle-counts 0,50,150,max``: for each count in
ascending order, idle sandboxes are added until there are that many (``max``: until the API refuses a create),
left alone ``--settle-s`` seconds (default: the promotion interval plus a minute, so a promotion cycle has
passed), then measured over ``--window-s`` seconds (default 180) in which the bench does nothing but sample
``/proc`` every 5 s:

- the host's busy cores (``/proc/stat``) and the cores of each component (``/proc/<pid>/stat``: user, system
  and reaped children's time of the process tree): ``qemus`` (the sandboxes' QEMUs), ``snapshotter``,
  ``nodeagent``, ``api_scheduler_warmpool``, ``gateway``, ``servers`` (NATS, PostgreSQL, S3, OpenBao: the
  stack's own), ``bench`` and ``kernel_threads`` (every kernel thread of the host, btrfs and IO workers among
  them: on a shared machine, other users' too); ``outside_qemus_cores`` is the stack's services and servers;
- pressure (``/proc/pressure``: percent of the window that some, or all, tasks waited for CPU, IO, memory);
- ``qemu_idle_cores``: one idle QEMU's cores (mean and max over the sandboxes);
- ``promotion_bytes_per_min`` (hashed, reused, uploaded) from the snapshotter's ``podbay_promotion_bytes_total``,
  ``promotion_lag_s`` (``podbay_snapshot_promotion_lag_seconds``: a sandbox never promoted counts its whole
  life, changed or not), ``cadence_lag_s`` (``podbay_cadence_lag_seconds``, the node agent's) at the window's
  end, and ``unpromoted_snapshot_age_s`` (the snapshots table: the oldest snapshot not yet in S3 that no
  promoted one overtook, i.e. how long a change has waited for promotion);

then ``idle_pss_MiB`` (each QEMU's PSS), ``exec_true`` (``--exec-runs`` execs of ``true`` through the API,
one after another, round-robin over all the sandboxes) and ``create`` (``--create-runs`` creates at that
density, each deleted). Every figure has the load averages beside it (``load_at_*``). The phases go to the
JSON file under ``idle_density`` and print as one table, a column per count. Every sandbox is deleted at the
end, and the stack (its QEMUs with it) stopped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.vmmem import tcg_buffer_mib, vm_memory

try:
    from tests.bench._stats import report, stop_on_sigterm, summarise
except ImportError:  # run as a script from the repository root
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, stop_on_sigterm, summarise  # type: ignore[no-redef]

#: Step 1 of the busy workload: a compile of a standard-library package, then imports of a dozen modules.
COMPILE_IMPORT = (
    "python3 -c 'import compileall; compileall.compile_dir(\"/usr/lib/python3.11/json\", quiet=1, force=True)' "
    "&& python3 -c 'import argparse, asyncio, decimal, email.parser, http.client, json, logging, sqlite3, "
    "subprocess, urllib.request, xml.etree.ElementTree, zipfile'"
)
#: Step 2: a walk of the root file system.
FIND = "find / -xdev >/dev/null 2>&1; true"
#: Step 3: the shell loop, for LOOP_S seconds of wall time; prints how many rounds it made.
LOOP = "exec bash -c 'i=0; while [ $SECONDS -lt {s} ]; do echo $i > /tmp/c; sleep 0.1; i=$((i+1)); done; echo $i'"


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _create(c: httpx.Client, template: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = c.post("/v1/sandboxes", json={"template": template})
    ms = _ms(t0)
    if r.status_code != 201:
        raise SystemExit(f"create answered {r.status_code}: {r.text}")
    return str(r.json()["id"]), ms


def _delete(c: httpx.Client, ids: list[str]) -> None:
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda sid: c.delete(f"/v1/sandboxes/{sid}").raise_for_status(), ids))


def _sh(c: httpx.Client, sid: str, cmd: str, timeout_s: float = 1800) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": cmd, "timeout_s": timeout_s},
               timeout=timeout_s + 60)
    r.raise_for_status()
    res = r.json()
    if res["exit_code"] != 0:
        raise SystemExit(f"{cmd!r} in {sid} exited {res['exit_code']}: {res['stderr'][-300:]}")
    return str(res["stdout"])


def _guest_used_mib(c: httpx.Client, sid: str) -> float:
    """``MemTotal - MemAvailable`` inside the guest, MiB."""
    info = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", _sh(c, sid, "cat /proc/meminfo"), re.M)}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def _qemu_pids(store: Path, ids: list[str]) -> dict[str, int]:
    """QEMU's pid per sandbox, from the ``qemu.pid`` of its VM directory."""
    out: dict[str, int] = {}
    for sid in ids:
        for pidfile in (store / "sandboxes" / sid).glob("**/qemu.pid"):
            try:
                out[sid] = int(pidfile.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    missing = set(ids) - set(out)
    if missing:
        raise SystemExit(f"no running QEMU for {sorted(missing)}")
    return out


def _pss_mib(pid: int) -> float:
    mem = vm_memory(pid, None)
    if mem is None:
        raise SystemExit(f"QEMU {pid} is gone")
    return mem.pss_mib


def _workload(c: httpx.Client, sid: str, loop_s: int) -> dict[str, float]:
    t0 = time.perf_counter()
    _sh(c, sid, COMPILE_IMPORT)
    compile_ms = _ms(t0)
    t0 = time.perf_counter()
    _sh(c, sid, FIND)
    find_ms = _ms(t0)
    t0 = time.perf_counter()
    rounds = int(_sh(c, sid, LOOP.format(s=loop_s)).strip() or 0)
    return {"compile_ms": compile_ms, "find_ms": find_ms, "rounds_per_s": rounds / (_ms(t0) / 1000)}


def _idle(c: httpx.Client, template: str, store: Path, count: int) -> dict[str, dict[str, Any]]:
    ids = [_create(c, template)[0] for _ in range(count)]
    try:
        time.sleep(3)  # let the guests settle after their hygiene
        pss = [_pss_mib(pid) for pid in _qemu_pids(store, ids).values()]
    finally:
        _delete(c, ids)
    return {"idle_running_sandboxes_per_GiB": {"value": round(1024 / statistics.fmean(pss), 2), "n": len(pss)},
            "idle_qemu_pss_MiB_per_sandbox": {"value": round(statistics.fmean(pss), 1), "n": len(pss)}}


def _busy(c: httpx.Client, template: str, store: Path, count: int, loop_s: int) -> dict[str, dict[str, Any]]:
    ids = [_create(c, template)[0] for _ in range(count)]
    try:
        with ThreadPoolExecutor(count) as ex:
            work = list(ex.map(lambda sid: _workload(c, sid, loop_s), ids))
        time.sleep(2)
        pids = _qemu_pids(store, ids)
        pss = {sid: _pss_mib(pid) for sid, pid in pids.items()}
        tb = [tcg_buffer_mib(pid) or 0.0 for pid in pids.values()]
        used = {sid: _guest_used_mib(c, sid) for sid in ids}
    finally:
        _delete(c, ids)
    overhead = [pss[sid] - used[sid] for sid in ids]
    mean = lambda xs: round(statistics.fmean(xs), 1)  # noqa: E731
    n = len(ids)
    return {
        "busy_host_overhead_MiB_per_sandbox": {"value": mean(overhead), "max": round(max(overhead), 1), "n": n},
        "busy_running_sandboxes_per_GiB": {"value": round(1024 / statistics.fmean(pss.values()), 2), "n": n},
        "busy_qemu_pss_MiB_per_sandbox": {"value": mean(pss.values()), "n": n},
        "busy_guest_used_MiB_per_sandbox": {"value": mean(used.values()), "n": n},
        "busy_tcg_buffer_MiB_per_sandbox": {"value": mean(tb), "n": n},
        "busy_compile_import": summarise([w["compile_ms"] for w in work]),
        "busy_find": summarise([w["find_ms"] for w in work]),
        "busy_loop_iterations_per_s": {"value": round(statistics.fmean(w["rounds_per_s"] for w in work), 2), "n": n},
    }


# --- idle density (issue "idle costs nothing") ---------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Components of the host CPU split, in table order; ``kernel_threads`` and ``host`` are the whole machine's.
COMPONENTS = ("qemus", "snapshotter", "nodeagent", "api_scheduler_warmpool", "gateway", "servers", "bench",
              "kernel_threads")


def _proc_stat(pid: int) -> tuple[int, int, int, int] | None:
    """``(ppid, starttime, cpu ticks of the process and its reaped children, 1 for a kernel thread else 0)``
    from ``/proc/<pid>/stat`` (proc(5): fields 4, 22, 14-17 and the PF_KTHREAD bit of field 9); None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    ppid, flags = int(rest[1]), int(rest[6])
    ticks = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
    return ppid, int(rest[19]), ticks, 1 if flags & 0x00200000 else 0


def _host_ticks() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all CPUs from the ``cpu`` line of ``/proc/stat`` (idle and iowait not busy)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(f) - f[3] - f[4], sum(f)


def _pressure_totals() -> dict[str, int]:
    """``{"cpu_some": µs, "io_some": ..., "io_full": ..., "memory_some": ..., "memory_full": ...}``: the
    ``total=`` counters of ``/proc/pressure/*`` (Documentation/accounting/psi.rst); empty without PSI."""
    out: dict[str, int] = {}
    for res in ("cpu", "io", "memory"):
        try:
            text = Path(f"/proc/pressure/{res}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            kind, *fields = line.split()
            total = dict(f.split("=") for f in fields).get("total")
            if total is not None and not (res == "cpu" and kind == "full"):
                out[f"{res}_{kind}"] = int(total)
    return out


class CpuSampler:
    """Host CPU split by component over a window, sampled every few seconds so that processes that start and
    end inside it count (those reaped by a tracked parent count through the parent's children's time).

    ``roots`` maps a component to the pids whose process trees belong to it; ``qemu_pids`` are the QEMUs
    (counted apart, whoever their parent). Kernel threads are every kernel thread of the host: the btrfs and
    IO workers the snapshot work sets off run there, but so does every other user's on a shared machine."""

    def __init__(self, roots: dict[str, list[int]], qemu_pids: list[int]) -> None:
        self.roots = {pid: comp for comp, pids in roots.items() for pid in pids}
        self.qemus = set(qemu_pids)
        self.last: dict[tuple[int, int], int] = {}
        self.ticks: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
        self.per_qemu: dict[int, int] = dict.fromkeys(qemu_pids, 0)
        self.t0 = time.monotonic()
        self.host0 = _host_ticks()
        self.psi0 = _pressure_totals()
        self.sample(first=True)

    def _component(self, pid: int, stats: dict[int, tuple[int, int, int, int]]) -> str | None:
        seen = 0
        while pid > 1 and seen < 64:
            if pid in self.qemus:
                return "qemus"
            if pid in self.roots:
                return self.roots[pid]
            st = stats.get(pid)
            if st is None:
                return None
            pid, seen = st[0], seen + 1
        return None

    def sample(self, first: bool = False) -> None:
        stats: dict[int, tuple[int, int, int, int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
                stats[int(entry.name)] = st
        for pid, (_ppid, start, ticks, kthread) in stats.items():
            comp = "kernel_threads" if kthread else self._component(pid, stats)
            if comp is None:
                continue
            key = (pid, start)
            prev = self.last.get(key)
            # A process first seen after the window began counts whole (it started inside the window).
            delta = 0 if first else ticks - (prev if prev is not None else 0)
            self.last[key] = ticks
            self.ticks[comp] += max(0, delta)
            if pid in self.per_qemu:
                self.per_qemu[pid] += max(0, delta)

    def result(self) -> dict[str, Any]:
        """Cores (CPU seconds per second) per component, the host's busy cores and pressure percentages."""
        self.sample()
        wall = time.monotonic() - self.t0
        busy, total = (b - a for a, b in zip(self.host0, _host_ticks(), strict=True))
        cores = {c: round(t / _CLK_TCK / wall, 3) for c, t in self.ticks.items()}
        psi1 = _pressure_totals()
        psi = {k: round((psi1[k] - v) / 1e6 / wall * 100, 1) for k, v in self.psi0.items() if k in psi1}
        per_qemu = [t / _CLK_TCK / wall for t in self.per_qemu.values()]
        return {"window_s": round(wall, 1), "cores": cores,
                "host_busy_cores": round(busy / max(total, 1) * (os.cpu_count() or 1), 3),
                "outside_qemus_cores": round(sum(v for k, v in cores.items()
                                                 if k not in ("qemus", "bench", "kernel_threads")), 3),
                "pressure_pct": psi,
                "qemu_idle_cores": ({"mean": round(statistics.fmean(per_qemu), 4), "max": round(max(per_qemu), 4),
                                     "n": len(per_qemu)} if per_qemu else None)}


def _metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` in Prometheus text ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lab = head.partition("{")
        if metric != name or any(f'{k}="{v}"' not in lab for k, v in labels.items()):
            continue
        total += float(value)
    return total


def _metrics(url: str) -> str:
    try:
        return httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def _promotion_figures(before: str, after: str, node_metrics: str, window_s: float) -> dict[str, Any]:
    """Promotion bytes per minute over the window (by what promotion did with them) and the lag gauges."""
    per_min = {what: round((_metric_sum(after, "podbay_promotion_bytes_total", what=what)
                            - _metric_sum(before, "podbay_promotion_bytes_total", what=what)) / window_s * 60)
               for what in ("hashed", "reused", "uploaded")}
    return {"promotion_bytes_per_min": per_min,
            "promotion_lag_s": _metric_sum(after, "podbay_snapshot_promotion_lag_seconds"),
            "cadence_lag_s": _metric_sum(node_metrics, "podbay_cadence_lag_seconds")}


#: Age of the oldest snapshot of a live sandbox on the node that is not in S3 yet and that no promoted snapshot
#: of its sandbox has overtaken: how long a change has waited for promotion (0 for none). Unlike
#: ``podbay_snapshot_promotion_lag_seconds`` it does not count a sandbox that never changed (nothing to lose).
UNPROMOTED_AGE_SQL = (
    "SELECT coalesce(max(extract(epoch FROM now() - s.created_at)), 0)::float8 FROM snapshots s"
    " JOIN sandboxes b ON b.id = s.sandbox_id WHERE b.node_id = $1 AND b.state IN ('running', 'paused')"
    " AND s.state = 'ready' AND s.promotion IN ('local', 'promoting') AND NOT EXISTS (SELECT 1 FROM snapshots p"
    "  WHERE p.sandbox_id = s.sandbox_id AND p.promotion = 'promoted' AND p.created_at >= s.created_at)")


def _unpromoted_age_s(dsn: str, node_id: str) -> float | None:
    """:data:`UNPROMOTED_AGE_SQL` on the stack's PostgreSQL, seconds; None when it cannot be read."""
    import asyncio

    import asyncpg

    async def ask() -> float:
        conn = await asyncpg.connect(dsn)
        try:
            return float(await conn.fetchval(UNPROMOTED_AGE_SQL, node_id))
        finally:
            await conn.close()

    try:
        return round(asyncio.run(ask()), 1)
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"unpromoted snapshot age: {exc}")
        return None


def _exec_round_robin(c: httpx.Client, ids: list[str], runs: int) -> dict[str, Any]:
    """``exec true`` through the API, one after another over ``ids`` round-robin, ``max(runs, len(ids))`` times."""
    samples: list[float] = []
    for i in range(max(runs, len(ids))):
        t0 = time.perf_counter()
        c.post(f"/v1/sandboxes/{ids[i % len(ids)]}/exec", json={"argv": ["true"]}, timeout=600).raise_for_status()
        samples.append(_ms(t0))
    return summarise(samples)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Density:
    """Idle sandboxes, added to reach each count in turn, and what they cost once settled (module docstring)."""

    def __init__(self, c: httpx.Client, stack: Stack, store: Path, template: str, args: argparse.Namespace) -> None:
        self.c, self.stack, self.store, self.template, self.args = c, stack, store, template, args
        self.ids: list[str] = []

    def _roots(self) -> dict[str, list[int]]:
        roots: dict[str, list[int]] = {c: [] for c in COMPONENTS}
        for name in self.stack.part_names():
            pid = self.stack.pid(name)
            if pid is None:
                continue
            base = name.split("@")[0].split("-")[0]
            comp = {"api": "api_scheduler_warmpool", "scheduler": "api_scheduler_warmpool",
                    "warmpool": "api_scheduler_warmpool", "nodeagent": "nodeagent", "snapshotter": "snapshotter",
                    "gateway": "gateway"}.get(base, "servers")
            roots[comp].append(pid)
        roots["bench"].append(os.getpid())
        return roots

    def fill(self, count: int | None) -> bool:
        """Create sandboxes until there are ``count`` (None: until the API refuses one). False once refused."""
        while count is None or len(self.ids) < count:
            r = self.c.post("/v1/sandboxes", json={"template": self.template})
            if r.status_code != 201:
                print(f"create #{len(self.ids) + 1} refused: {r.status_code} {r.text[:200]}")
                return False
            self.ids.append(str(r.json()["id"]))
            if len(self.ids) % 10 == 0:
                print(f"  {len(self.ids)} idle sandboxes, load {_load()}", flush=True)
        return True

    def phase(self, label: str) -> dict[str, Any]:
        n = len(self.ids)
        out: dict[str, Any] = {"sandboxes": n, "load_at_settle": _load()}
        print(f"idle {label}: {n} sandboxes, settling {self.args.settle_s:.0f} s, load {_load()}", flush=True)
        time.sleep(self.args.settle_s if n else 0)
        pids = _qemu_pids(self.store, self.ids) if n else {}
        sampler = CpuSampler(self._roots(), list(pids.values()))
        before = _metrics(f"http://127.0.0.1:{self.stack.ports.snapshotter}")
        out["load_at_window_start"] = _load()
        end = time.monotonic() + self.args.window_s
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(5.0, left))
            sampler.sample()
        out.update(sampler.result())
        out["load_at_window_end"] = _load()
        after = _metrics(f"http://127.0.0.1:{self.stack.ports.snapshotter}")
        out.update(_promotion_figures(before, after, _metrics(f"http://127.0.0.1:{self.stack.ports.node}"),
                                      out["window_s"]))
        out["unpromoted_snapshot_age_s"] = _unpromoted_age_s(str(self.stack.pg_dsn), Settings().node_id)
        if pids:
            pss = [_pss_mib(pid) for pid in pids.values()]
            out["idle_pss_MiB"] = {"mean": round(statistics.fmean(pss), 1), "max": round(max(pss), 1), "n": len(pss)}
        if n:
            out["exec_true"] = _exec_round_robin(self.c, self.ids, self.args.exec_runs)
            out["load_after_exec"] = _load()
        creates: list[float] = []
        for _ in range(self.args.create_runs):
            sid, ms = _create(self.c, self.template)
            creates.append(ms)
            _delete(self.c, [sid])
        out["create"] = summarise(creates)
        out["load_after_create"] = _load()
        return out

    def stop(self) -> None:
        _delete(self.c, self.ids)
        self.ids = []


def _parse_counts(raw: str) -> list[int | None]:
    """``"0,50,150,max"`` -> ``[0, 50, 150, None]`` (None: as many as the node admits), ascending."""
    out: list[int | None] = []
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        out.append(None if part == "max" else int(part))
    return sorted(out, key=lambda x: float("inf") if x is None else x)


def idle_table(phases: dict[str, dict[str, Any]]) -> None:
    """Print one column per idle count: the issue's table."""
    from rich.console import Console
    from rich.table import Table

    table = Table("idle sandboxes", *phases)
    rows: list[tuple[str, Any]] = [
        ("load avg (window start)", lambda p: " ".join(f"{x:.1f}" for x in p["load_at_window_start"])),
        ("load avg (window end)", lambda p: " ".join(f"{x:.1f}" for x in p["load_at_window_end"])),
        ("host busy, cores", lambda p: p["host_busy_cores"]),
        *[(f"  {c}, cores", functools.partial(lambda c, p: p["cores"][c], c)) for c in COMPONENTS],
        ("outside QEMUs, cores", lambda p: p["outside_qemus_cores"]),
        ("one idle QEMU, cores (mean/max)", lambda p: (f"{p['qemu_idle_cores']['mean']:.4f} / "
                                                         f"{p['qemu_idle_cores']['max']:.4f}"
                                                         if p.get("qemu_idle_cores") else "")),
        ("idle sandbox PSS MiB (mean)", lambda p: p.get("idle_pss_MiB", {}).get("mean", "")),
        *[(f"pressure {k} %", functools.partial(lambda k, p: p["pressure_pct"].get(k, ""), k))
          for k in ("cpu_some", "io_some", "io_full", "memory_some", "memory_full")],
        ("exec true p50 / p99 ms", lambda p: (f"{p['exec_true']['p50_ms']:.1f} / {p['exec_true']['p99_ms']:.1f}"
                                              if "exec_true" in p else "")),
        ("create p50 ms", lambda p: p["create"]["p50_ms"] if p["create"]["n"] else ""),
        ("promotion hashed / uploaded B/min", lambda p: (f"{p['promotion_bytes_per_min']['hashed']} / "
                                                         f"{p['promotion_bytes_per_min']['uploaded']}")),
        ("promotion lag s / cadence lag s", lambda p: f"{p['promotion_lag_s']:.0f} / {p['cadence_lag_s']:.0f}"),
        ("oldest unpromoted snapshot s", lambda p: p.get("unpromoted_snapshot_age_s", "")),
    ]
    for name, get in rows:
        table.add_row(name, *[str(get(p)) for p in phases.values()])
    Console().print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="creates and execs for the latency figures (default 30)")
    ap.add_argument("--idle", type=int, default=4, help="idle sandboxes for the idle figure (default 4)")
    ap.add_argument("--busy", type=int, default=4, help="busy sandboxes, run at once (default 4)")
    ap.add_argument("--loop-s", type=int, default=60, help="seconds of the shell loop per busy sandbox (default 60)")
    ap.add_argument("--tcg-tb-size-mib", type=int, default=None,
                    help="PODBAY_TCG_TB_SIZE_MIB for the stack (default: the setting in force; 0 = QEMU's 1 GiB)")
    ap.add_argument("--idle-counts", default="",
                    help="idle density phases: counts of idle sandboxes, e.g. 0,50,150,max (max: until the API "
                         "refuses a create); default none")
    ap.add_argument("--settle-s", type=float, default=None,
                    help="seconds each idle count is left alone before its window (default: the promotion "
                         "interval plus a minute, past one promotion cycle)")
    ap.add_argument("--window-s", type=float, default=180.0, help="measured window per idle count (default 180)")
    ap.add_argument("--exec-runs", type=int, default=100,
                    help="exec true per idle count, round-robin over the sandboxes (at least one each)")
    ap.add_argument("--create-runs", type=int, default=5, help="creates per idle count, each deleted (default 5)")
    ap.add_argument("--node-cpu-pressure-max", type=float, default=None,
                    help="PODBAY_NODE_CPU_PRESSURE_MAX for the stack (default: the setting in force); 0 turns CPU "
                         "admission off, which a machine shared with other work needs to fill a node at all")
    ap.add_argument("--template", default="base")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the stack's directory")
    args = ap.parse_args()

    env = dict(os.environ)
    if args.tcg_tb_size_mib is not None:
        env["PODBAY_TCG_TB_SIZE_MIB"] = str(args.tcg_tb_size_mib)
    if args.node_cpu_pressure_max is not None:
        env["PODBAY_NODE_CPU_PRESSURE_MAX"] = str(args.node_cpu_pressure_max)
    tb_size = args.tcg_tb_size_mib if args.tcg_tb_size_mib is not None else Settings().tcg_tb_size_mib
    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False, base_env=env)
    results: dict[str, dict[str, Any]] = {"tcg_tb_size_MiB": {"value": tb_size}}
    if args.node_cpu_pressure_max is not None:
        results["node_cpu_pressure_max"] = {"value": args.node_cpu_pressure_max}
    idle_phases: dict[str, dict[str, Any]] = {}
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        store = root / "stack" / "nodes" / Settings().node_id / "store"
        headers = {"authorization": f"Bearer {stack.api_key}"}
        with httpx.Client(base_url=stack.api_url, headers=headers, timeout=120) as c:
            print(f"load average at start: {os.getloadavg()}")
            _delete(c, [_create(c, args.template)[0]])  # warm-up, not counted
            cold: list[float] = []
            for _ in range(args.runs):
                sid, ms = _create(c, args.template)
                cold.append(ms)
                _delete(c, [sid])
            results["create_cold"] = summarise(cold)
            sid, _ = _create(c, args.template)
            execs: list[float] = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}).raise_for_status()
                execs.append(_ms(t0))
            _delete(c, [sid])
            results["exec_true"] = summarise(execs)
            if args.idle:
                results.update(_idle(c, args.template, store, args.idle))
            if args.busy:
                results.update(_busy(c, args.template, store, args.busy, args.loop_s))
            if args.idle_counts:
                if args.settle_s is None:
                    args.settle_s = Settings().promote_disk_interval_s + 60
                density = Density(c, stack, store, args.template, args)
                try:
                    for count in _parse_counts(args.idle_counts):
                        full = not density.fill(count)
                        label = str(len(density.ids)) if count is not None else f"max ({len(density.ids)})"
                        idle_phases[label] = density.phase(label)
                        print(json.dumps(idle_phases[label]), flush=True)
                        if full:
                            break
                finally:
                    density.stop()
            print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if idle_phases:
        results["idle_density"] = idle_phases
        idle_table(idle_phases)
    report({k: v for k, v in results.items() if k != "idle_density"}, None)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
