"""Benchmark: sandbox creation, warm (from a pool) and cold (restore), against the floor measured in the
same run; per-hop breakdown; idle sandboxes per GiB of host memory (docs/DESIGN.md §7, issue "warm pools").

    .venv/bin/python tests/bench/create.py --runs 200 --json create.json [--keep]

It starts its own stack of real processes in a temporary directory on free ports (as the tests do), so
that it can read PostgreSQL and the node's metrics and set the stack's paused-release time; servers given
by ``PODBAY_NATS_URL``/``PODBAY_PG_DSN``/``PODBAY_S3_URL`` are used instead of starting them.

Metrics:

- ``floor_resume_ping``: QMP ``cont`` of a stopped, restored guest plus one guestd ping on its already
  connected channel (the node's own restore of the template, outside the stack's books);
- ``create_warm``: ``POST /v1/sandboxes`` until it answers 201 (the sandbox runs and guestd answered its
  hygiene), one client, a ready slot waiting before each create (the wait is not timed);
- ``create_warm_8clients``: the same with 8 clients at once, in rounds of 8 with 8 slots ready;
- ``create_cold``: the same call with no pool (restore from the template snapshot);
- ``warm_share`` (and ``..._8clients``): share of the warm creates served from a slot (the API's
  ``create_warm`` counter; the others fell back to a restore);
- ``hop_<service>_<hop>_mean_ms`` (and ``..._8clients``): mean time per hop over each warm phase
  (``podbay_hop_seconds``; the node's ``warm_prepare`` is the refill running meanwhile), and
  ``..._cold`` over the cold phase, ``..._exec`` over the exec phase and ``..._first`` over the warm first
  command phase; beside them ``hop_<service>_route_<create|exec>_mean_ms...``: the whole handling of the
  public create and exec routes in the API and of the exec route on the node (``podbay_http_request_seconds``),
  so that what lies between the hops (HTTP handling, the proxy's transport, the client) shows;
- ``exec_true`` (phase ``exec``): ``POST /v1/sandboxes/{id}/exec`` of ``true`` on one running sandbox,
  one client (the same call as ``create_exec.py``, here on the benchmark's own stack, so that one run with
  ``PODBAY_TCG_TB_SIZE_MIB`` set and one without compare the memory bound's cost on a quiet machine), and
  ``guest_spawn_true``: the guest's own ``posix_spawn`` and wait of ``true``, timed inside the guest (as guestd
  starts an exec), so that the guest hop splits into the process start and the channel and guestd;
- ``first_command_warm`` (phase ``first``): what a user waits for from a create to its first command, through
  the SDK as a user runs it (``podbay.sdk.Client``: ``create_sandbox`` then ``exec(id, ["true"])``, one
  client), a ready slot waiting before each (the wait is not timed); ``first_command_cold`` (phase
  ``firstcold``): the same with no pool (issue "first command in 25 ms");
- ``idle_running_sandboxes_per_GiB`` / ``paused_sandboxes_per_GiB``: 1 GiB over the host memory per idle
  running sandbox, and per paused one before its RAM is released, as the node measures it
  (``podbay.vmmem``: each QEMU's PSS, which includes the guest RAM file's pages it mapped);
  ``paused_released_host_MiB_each`` and ``paused_released_disk_MiB_each`` (extents not shared with the
  template) after the release (QEMU gone, state on disk);
- ``running_sandboxes_max`` (phase ``max``, not in the default set): sandboxes created one after another,
  with the stack's default settings, until a create is refused, ``--max-target`` are running or
  ``--max-budget-s`` have passed, then one ``true`` exec in each; the value counts those that answered (the run also reports the refusal, if any,
  sandboxes the node paused for memory, the node's measured memory per idle sandbox
  ``node_memory_MiB_per_idle_sandbox``, and the load average and other VMs on the machine meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from podbay.channel.client import GuestChannel
from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.sdk import Client
from podbay.vmmem import vm_memory
from podbay.vmprocs import vm_processes
from podbay_nodeagent.build.template import TemplateSnapshot
from podbay_nodeagent.vm.vmm import QemuVmm

try:
    from tests.bench._stats import report, stop_on_sigterm, summarise
except ImportError:  # run as a script from the repository root
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, stop_on_sigterm, summarise  # type: ignore[no-redef]

#: Seconds a paused sandbox waits before its RAM is released, in the benchmark's stack.
RELEASE_S = 4
# /metrics of the API needs it (podbay.metricsauth); the bench's key is not the operator tenant's.
METRICS_TOKEN = secrets.token_hex(16)
#: Credentials of every /metrics read.
SCRAPE_HEADERS = {"authorization": f"Bearer {METRICS_TOKEN}"}
SETTLE_S = 600.0


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.05)


def _ready(c: httpx.Client, template: str) -> int:
    for p in c.get("/v1/pools").json()["pools"]:
        if p["template"] == template:
            return int(p["ready"])
    return 0


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


def _hops(text: str) -> dict[str, tuple[float, float]]:
    """``podbay_hop_seconds`` sum and count per ``service/hop`` from a Prometheus text page."""
    out: dict[str, list[float]] = {}
    for m in re.finditer(r'^podbay_hop_seconds_(sum|count)\{hop="([^"]+)",service="([^"]+)"\} (\S+)$', text, re.M):
        kind, hop, service, value = m.groups()
        out.setdefault(f"{service}_{hop}", [0.0, 0.0])[0 if kind == "sum" else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


#: Routes whose whole handling time is reported beside the hops (``podbay_http_request_seconds``, 2xx):
#: the public create and exec, and the node's exec, so that what lies between the hops shows.
_ROUTES = {("api", "POST", "/v1/sandboxes"): "route_create", ("api", "POST", "/v1/sandboxes/{sandbox_id}/exec"):
           "route_exec", ("nodeagent", "POST", "/internal/v1/sandboxes/{sandbox_id}/exec"): "route_exec"}


def _routes(text: str) -> dict[str, tuple[float, float]]:
    """``podbay_http_request_seconds`` sum and count of the routes in ``_ROUTES``, as ``<service>_route_<name>``."""
    out: dict[str, list[float]] = {}
    for m in re.finditer(r'^podbay_http_request_seconds_(sum|count)\{method="([^"]+)",route="([^"]+)",'
                         r'service="([^"]+)",status="2xx"\} (\S+)$', text, re.M):
        kind, method, route, service, value = m.groups()
        if (name := _ROUTES.get((service, method, route))) is not None:
            out.setdefault(f"{service}_{name}", [0.0, 0.0])[0 if kind == "sum" else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _scrape(urls: list[str]) -> dict[str, tuple[float, float]]:
    """Hop and route means of the ``/metrics`` pages at ``urls``."""
    total: dict[str, tuple[float, float]] = {}
    for url in urls:
        r = httpx.get(url, headers=SCRAPE_HEADERS, timeout=10)
        r.raise_for_status()
        text = r.text
        total.update(_hops(text))
        total.update(_routes(text))
    return total


def _hop_means(suffix: str, before: dict[str, tuple[float, float]],
               after: dict[str, tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """``hop_<service>_<hop>_mean_ms<suffix>`` for every hop seen between two scrapes."""
    out: dict[str, dict[str, Any]] = {}
    for key, (s1, n1) in sorted(after.items()):
        s0, n0 = before.get(key, (0.0, 0.0))
        if n1 > n0:
            out[f"hop_{key}_mean_ms{suffix}"] = {"value": round((s1 - s0) / (n1 - n0) * 1000, 2), "n": int(n1 - n0)}
    return out


def _warm_ok(api_metrics_url: str) -> float:
    """The API's count of creates served from a warm slot (``create_warm`` operations that succeeded)."""
    text = httpx.get(api_metrics_url, headers=SCRAPE_HEADERS, timeout=10).text
    m = re.search(r'^podbay_lifecycle_operations_total\{kind="create_warm",outcome="ok",service="api"\} (\S+)$',
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def _vm_cost_mib(store: Path, ids: list[str]) -> list[float]:
    """Host memory in MiB of each sandbox in ``ids`` that has a QEMU (``podbay.vmmem``, as the node counts)."""
    found: list[float] = []
    for sid in ids:
        vm_dir = store / "sandboxes" / sid
        for pid in vm_processes(vm_dir, qemu_only=True)[:1]:
            m = vm_memory(pid, vm_dir / "ram")
            if m is not None:
                found.append(m.cost_mib)
    return found


async def _floor(store: Path, runs: int) -> list[float]:
    """``cont`` + one ping on a restored, stopped guest whose channel is connected, ``runs`` times."""
    metas = sorted(store.glob("templates/*/*/template.json"), key=lambda p: p.stat().st_mtime)
    if not metas:
        raise SystemExit(f"no template in {store}")
    tpl = TemplateSnapshot.load(metas[-1].parent)
    vm_dir = store / "tmp" / "bench-floor"
    shutil.rmtree(vm_dir, ignore_errors=True)
    vmm = QemuVmm()
    vm = await vmm.restore(tpl.dir, vm_dir, tpl.vm_config(Settings()))
    samples: list[float] = []
    try:
        ch = await GuestChannel.connect(vm.paths.channel, timeout_s=60)
        await ch.ping()
        for _ in range(runs):
            await vmm.pause(vm)
            t0 = time.perf_counter()
            await vmm.resume(vm)
            await ch.ping()
            samples.append(_ms(t0))
        await ch.close()
    finally:
        await vmm.kill(vm)
        shutil.rmtree(vm_dir, ignore_errors=True)
    return samples


def _exclusive_mib(path: Path) -> float:
    """MiB of ``path`` held by no other file (``btrfs filesystem du``: extents not shared by reflink)."""
    out = subprocess.run(["btrfs", "filesystem", "du", "-s", "--raw", str(path)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return int(out[-1].split()[1]) / 2**20


def _density(c: httpx.Client, template: str, store: Path, count: int) -> dict[str, dict[str, Any]]:
    ids = [_create(c, template)[0] for _ in range(count)]
    try:
        time.sleep(3)  # let the guests settle after their hygiene
        running = _vm_cost_mib(store, ids)
        for sid in ids:
            c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
        paused = _vm_cost_mib(store, ids)
        _wait("paused sandboxes to release their RAM", lambda: not _vm_cost_mib(store, ids), RELEASE_S * 10 + 60)
        left = _vm_cost_mib(store, ids)
        disk = [_exclusive_mib(store / "sandboxes" / sid) for sid in ids]
    finally:
        _delete(c, ids)
    per = lambda xs: round(1024 / (sum(xs) / len(xs)), 2) if xs else None  # noqa: E731
    return {
        "idle_running_sandboxes_per_GiB": {"value": per(running), "n": len(running)},
        "paused_sandboxes_per_GiB": {"value": per(paused), "n": len(paused)},
        "paused_released_host_MiB_each": {"value": round(sum(left) / count, 2), "n": count},
        # Exclusive extents only: what the sandbox's files do not share with the template by reflink.
        "paused_released_disk_MiB_each": {"value": round(sum(disk) / count, 1), "n": count},
    }


def _metric(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _other_vms(root: Path) -> int:
    """QEMU processes on the machine that are not this benchmark's (other stacks' VMs share the cores)."""
    mine = set(vm_processes(root, qemu_only=True))
    qemus = set()
    for proc in Path("/proc").iterdir():
        try:
            argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0] if proc.name.isdigit() else b""
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name.startswith("qemu-system"):
            qemus.add(int(proc.name))
    return len(qemus - mine)


def _running_max(c: httpx.Client, template: str, node_metrics: str, root: Path,
                 target: int, budget_s: float) -> dict[str, dict[str, Any]]:
    """``running_sandboxes_max``: create one after another until refused, ``target`` or ``budget_s`` seconds
    of creating (a shared machine's lock is held meanwhile), then exec in all (4 at a time)."""
    ids: list[str] = []
    refused = ""
    stopped = "target"
    loads = [os.getloadavg()[0]]
    others = _other_vms(root)
    t0 = time.perf_counter()
    try:
        while len(ids) < target:
            r = c.post("/v1/sandboxes", json={"template": template})
            if r.status_code != 201:
                refused = f"create {len(ids) + 1} answered {r.status_code}: {r.text[:300]}"
                stopped = "refused"
                break
            ids.append(str(r.json()["id"]))
            if time.perf_counter() - t0 > budget_s:
                stopped = "time budget"
                break
            if len(ids) % 25 == 0:
                loads.append(os.getloadavg()[0])
                print(f"  {len(ids)} running after {time.perf_counter() - t0:.0f} s, load {loads[-1]:.2f}")
        time.sleep(5)  # a few measurements of the node with all of them idle
        text = httpx.get(node_metrics, headers=SCRAPE_HEADERS, timeout=10).text
        sandboxes_mib = _metric(text, "podbay_node_memory_mib", '{kind="sandboxes"}') or 0.0
        cost_mib = _metric(text, "podbay_node_memory_mib", '{kind="sandbox_cost"}')
        room_mib = _metric(text, "podbay_node_memory_mib", '{kind="room"}')
        measured_running = _metric(text, "podbay_node_memory_vms", '{kind="running"}') or 0.0
        states = [c.get(f"/v1/sandboxes/{sid}").json()["state"] for sid in ids]
        create_s = time.perf_counter() - t0

        def exec_ok(sid: str) -> bool:
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            return r.status_code == 200 and r.json().get("exit_code") == 0

        with ThreadPoolExecutor(4) as ex:
            answered = sum(ex.map(exec_ok, [sid for sid, st in zip(ids, states, strict=True) if st == "running"]))
        loads.append(os.getloadavg()[0])
    finally:
        _delete(c, ids)
    print(f"running_sandboxes_max: {answered} of {len(ids)} created in {create_s:.0f} s answered exec; "
          f"stopped by: {stopped}; "
          f"{states.count('paused')} paused by the node; refused: {refused or 'no'}; other VMs on the machine: "
          f"{others}; load average (1 min) {min(loads):.2f}..{max(loads):.2f}; node room left {room_mib} MiB")
    return {
        "running_sandboxes_max": {"value": answered, "n": len(ids), "target": target, "stopped_by": stopped,
                                  "refused": refused or None, "paused_by_node": states.count("paused"),
                                  "create_s": round(create_s, 1)},
        "node_memory_MiB_per_idle_sandbox": {"value": round(sandboxes_mib / measured_running, 1)
                                             if measured_running else None, "n": int(measured_running),
                                             "median_MiB": cost_mib},
        "load_avg_1m_during_max": {"value": round(max(loads), 2), "min": round(min(loads), 2), "other_vms": others},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="creates per metric (default 200)")
    ap.add_argument("--pool", type=int, default=16, help="pool size for the warm phases (default 16)")
    ap.add_argument("--density", type=int, default=10, help="sandboxes for the density figures (default 10)")
    ap.add_argument("--max-target", type=int, default=150, help="sandboxes the max phase aims for (default 150)")
    # 150 took 479 s on 2 cores under TCG (each create slows as the idle guests share the cores): room for it.
    ap.add_argument("--max-budget-s", type=float, default=900.0,
                    help="the max phase stops creating after this many seconds (default 900)")
    ap.add_argument("--template", default="base")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the stack's directory")
    ap.add_argument("--phases", default="floor,cold,warm,warm8,exec,first,firstcold,density",
                    help="comma-separated phases to run (default: floor,cold,warm,warm8,exec,first,firstcold,"
                         "density;"
                         " also: max)")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    if unknown := phases - {"floor", "cold", "warm", "warm8", "exec", "first", "firstcold", "density", "max"}:
        ap.error(f"unknown phases: {', '.join(sorted(unknown))}")

    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False,
                  base_env={**os.environ, "PODBAY_PAUSED_RELEASE_S": str(RELEASE_S),
                            "PODBAY_METRICS_TOKEN": METRICS_TOKEN})
    results: dict[str, dict[str, Any]] = {}
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        store = root / "stack" / "nodes" / Settings().node_id / "store"
        metrics = [f"{stack.api_url}/metrics", f"http://127.0.0.1:{stack.ports.node}/metrics"]
        # The node's /metrics takes the stack's internal token.
        SCRAPE_HEADERS["x-podbay-internal-token"] = stack.env.get("PODBAY_INTERNAL_TOKEN", "")
        headers = {"authorization": f"Bearer {stack.api_key}"}
        with httpx.Client(base_url=stack.api_url, headers=headers, timeout=120) as c:
            print(f"load average at start: {os.getloadavg()}")
            if "floor" in phases:
                results["floor_resume_ping"] = summarise(asyncio.run(_floor(store, args.runs)))
            _delete(c, [_create(c, args.template)[0]])  # warm-up, not counted
            if "cold" in phases:  # no pool
                before = _scrape(metrics)
                cold = []
                for _ in range(args.runs):
                    sid, ms = _create(c, args.template)
                    cold.append(ms)
                    _delete(c, [sid])
                results["create_cold"] = summarise(cold)
                results.update(_hop_means("_cold", before, _scrape(metrics)))
            if phases & {"warm", "warm8"}:
                _warm_phases(c, args, phases, metrics, results)
            if "exec" in phases:
                sid = _create(c, args.template)[0]
                before = _scrape(metrics)
                samples = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}).raise_for_status()
                    samples.append(_ms(t0))
                results.update(_hop_means("_exec", before, _scrape(metrics)))
                results["guest_spawn_true"] = summarise(_guest_spawns(c, sid, args.runs))
                _delete(c, [sid])
                results["exec_true"] = summarise(samples)
            if phases & {"first", "firstcold"}:
                _first_command(c, args, phases, stack.api_url, stack.api_key, metrics, results)
            if "density" in phases:
                results.update(_density(c, args.template, store, args.density))
            if "max" in phases:
                results.update(_running_max(c, args.template, metrics[1], root, args.max_target, args.max_budget_s))
            print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args.json_path)


#: Run in the guest: ``posix_spawn`` of ``true`` and its wait, as guestd starts an exec (guestd/spawn.py), timed
#: in the guest; one time in ms per line.
_SPAWN_PROBE = ("import os, sys, time\n"
                "for _ in range(int(sys.argv[1])):\n"
                "    t = time.perf_counter()\n"
                "    pid = os.posix_spawn('/bin/true', ['true'], os.environ)\n"
                "    os.waitpid(pid, 0)\n"
                "    print((time.perf_counter() - t) * 1000)\n")


def _guest_spawns(c: httpx.Client, sandbox_id: str, runs: int) -> list[float]:
    """``guest_spawn_true``: the guest's own start and wait of ``true`` (ms), ``runs`` times in one exec, so that
    ``exec_true``'s guest hop splits into the process start and the rest (channel, guestd)."""
    r = c.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"argv": ["python3", "-c", _SPAWN_PROBE, str(runs)]})
    r.raise_for_status()
    return [float(x) for x in r.json()["stdout"].split()]


def _warm_phases(c: httpx.Client, args: argparse.Namespace, phases: set[str], metrics: list[str],
                 results: dict[str, dict[str, Any]]) -> None:
    """``create_warm`` (one client) and ``create_warm_8clients``, with their hop means and warm shares."""
    c.put(f"/v1/pools/{args.template}", json={"size": args.pool}).raise_for_status()
    _wait("the pool to fill", lambda: _ready(c, args.template) >= args.pool)
    if "warm" in phases:
        before, ok0 = _scrape(metrics), _warm_ok(metrics[0])
        warm: list[float] = []
        for _ in range(args.runs):
            _wait("a ready slot", lambda: _ready(c, args.template) >= 1)
            sid, ms = _create(c, args.template)
            warm.append(ms)
            _delete(c, [sid])
        results["create_warm"] = summarise(warm)
        results["warm_share"] = {"value": round((_warm_ok(metrics[0]) - ok0) / len(warm), 3), "n": len(warm)}
        results.update(_hop_means("", before, _scrape(metrics)))
    if "warm8" in phases:  # 8 clients at once, in rounds of 8 with 8 slots ready
        warm8: list[float] = []
        before, ok0 = _scrape(metrics), _warm_ok(metrics[0])
        with ThreadPoolExecutor(8) as ex:
            while len(warm8) < args.runs:
                _wait("8 ready slots", lambda: _ready(c, args.template) >= 8)
                got = list(ex.map(lambda _: _create(c, args.template), range(8)))
                warm8 += [ms for _, ms in got]
                _delete(c, [sid for sid, _ in got])
        results["create_warm_8clients"] = summarise(warm8)
        results.update(_hop_means("_8clients", before, _scrape(metrics)))
        results["warm_share_8clients"] = {"value": round((_warm_ok(metrics[0]) - ok0) / len(warm8), 3),
                                          "n": len(warm8)}
    c.put(f"/v1/pools/{args.template}", json={"size": 0}).raise_for_status()
    _wait("the pool to drain", lambda: _ready(c, args.template) == 0)


def _first_command(c: httpx.Client, args: argparse.Namespace, phases: set[str], api_url: str, api_key: str,
                   metrics: list[str], results: dict[str, dict[str, Any]]) -> None:
    """``first_command_warm`` (a pool of ``--pool``) and ``first_command_cold`` (no pool), through the SDK."""
    with Client(api_url=api_url, api_key=api_key) as sdk:
        def first() -> float:
            t0 = time.perf_counter()
            sid = sdk.create_sandbox(template=args.template).id
            result = sdk.exec(sid, ["true"])
            ms = _ms(t0)
            sdk.delete_sandbox(sid)
            if result.exit_code != 0:
                raise SystemExit(f"true exited {result.exit_code} in {sid}")
            return ms

        if "first" in phases:
            c.put(f"/v1/pools/{args.template}", json={"size": args.pool}).raise_for_status()
            _wait("the pool to fill", lambda: _ready(c, args.template) >= args.pool)
            before = _scrape(metrics)
            samples = []
            for _ in range(args.runs):
                _wait("a ready slot", lambda: _ready(c, args.template) >= 1)
                samples.append(first())
            results["first_command_warm"] = summarise(samples)
            results.update(_hop_means("_first", before, _scrape(metrics)))
            c.put(f"/v1/pools/{args.template}", json={"size": 0}).raise_for_status()
            _wait("the pool to drain", lambda: _ready(c, args.template) == 0)
        if "firstcold" in phases:
            results["first_command_cold"] = summarise([first() for _ in range(args.runs)])


if __name__ == "__main__":
    main()
