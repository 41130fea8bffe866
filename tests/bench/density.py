"""Benchmark: what a busy sandbox costs the host, beside an idle one, and the speed the TCG translation buffer's
bound leaves (docs/DESIGN.md §7 "running sandboxes on one 24 GiB node"; the issue "dense nodes").

    .venv/bin/python tests/bench/density.py --busy 4 --loop-s 60 --json density.json [--tcg-tb-size-mib 64]

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
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="creates and execs for the latency figures (default 30)")
    ap.add_argument("--idle", type=int, default=4, help="idle sandboxes for the idle figure (default 4)")
    ap.add_argument("--busy", type=int, default=4, help="busy sandboxes, run at once (default 4)")
    ap.add_argument("--loop-s", type=int, default=60, help="seconds of the shell loop per busy sandbox (default 60)")
    ap.add_argument("--tcg-tb-size-mib", type=int, default=None,
                    help="PODBAY_TCG_TB_SIZE_MIB for the stack (default: the setting in force; 0 = QEMU's 1 GiB)")
    ap.add_argument("--template", default="base")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the stack's directory")
    args = ap.parse_args()

    env = dict(os.environ)
    if args.tcg_tb_size_mib is not None:
        env["PODBAY_TCG_TB_SIZE_MIB"] = str(args.tcg_tb_size_mib)
    tb_size = args.tcg_tb_size_mib if args.tcg_tb_size_mib is not None else Settings().tcg_tb_size_mib
    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False, base_env=env)
    results: dict[str, dict[str, Any]] = {"tcg_tb_size_MiB": {"value": tb_size}}
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
            print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args.json_path)


if __name__ == "__main__":
    main()
