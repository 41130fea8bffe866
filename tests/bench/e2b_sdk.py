"""Benchmark: the unmodified ``e2b`` SDK against podbay, each operation beside podbay's native API for the
same operation in the same run (docs/e2b.md).

    .venv/bin/python tests/bench/e2b_sdk.py --runs 5 --json e2b.json

It starts its own stack of real processes in a temporary directory on free ports (as the tests do) and
points the SDK at it (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``). Metrics, E2B then native:

- ``e2b_create_cold`` / ``podbay_create_cold``: ``Sandbox.create`` / ``POST /v1/sandboxes`` until answered
  (the sandbox runs), no warm pool (a restore of the template's snapshot);
- ``e2b_create_warm`` / ``podbay_create_warm``: the same with a warm pool of ``--pool`` slots and a ready
  slot waiting before each create (the wait is not timed);
- ``e2b_commands_run_true`` / ``podbay_exec_bash_login_true``: ``commands.run("true")`` (``/bin/bash -l -c
  true`` through envd) / ``POST .../exec`` of the same argv;
- ``e2b_files_write_1MiB`` / ``podbay_files_put_1MiB`` and ``e2b_files_read_1MiB`` /
  ``podbay_files_get_1MiB``: one 1 MiB file up and down;
- ``e2b_fork_4`` / ``podbay_fork_4``: ``sandbox.fork(count=4)`` / ``POST .../fork {"count": 4}`` until all
  four children run (children deleted after each, not timed);
- ``e2b_create_snapshot`` / ``podbay_snapshot_full``: ``create_snapshot()`` / ``POST .../snapshots
  {"kind": "full"}`` until ready;
- ``e2b_create_from_fs_snapshot`` / ``podbay_restore_disk_snapshot``: ``Sandbox.create(id)`` of a
  ``create_snapshot(mode="filesystem")`` (a new sandbox booted afresh on that disk, out of object storage) /
  ``POST .../restore`` of a disk snapshot (the same sandbox booted afresh on it, the disk on the node), until
  the sandbox runs (the snapshots are taken before, not timed; children killed after, not timed).

``--only create,ops,fs,warm`` runs some of the sections (creates cold, the operations on one sandbox, the
filesystem-snapshot creates, creates warm).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.naming import sandbox_id_from_e2b

try:
    from tests.bench._stats import report, stop_on_sigterm, summarise
except ImportError:  # run as a script from the repository root
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, stop_on_sigterm, summarise  # type: ignore[no-redef]

MIB = b"\xa5" * (1 << 20)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.05)


def _ready(c: httpx.Client, template: str) -> int:
    return sum(int(p["ready"]) for p in c.get("/v1/pools").json()["pools"] if p["template"] == template)


def _podbay_create(c: httpx.Client, template: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = c.post("/v1/sandboxes", json={"template": template})
    ms = _ms(t0)
    r.raise_for_status()
    return str(r.json()["id"]), ms


def _creates(c: httpx.Client, template: str, runs: int, warm: bool, samples: dict[str, list[float]]) -> None:
    from e2b import Sandbox

    tag = "warm" if warm else "cold"
    for _ in range(runs):
        if warm:
            _wait("a ready slot", lambda: _ready(c, template) >= 1)
        t0 = time.perf_counter()
        sb = Sandbox.create(template=template, timeout=600)
        samples[f"e2b_create_{tag}"].append(_ms(t0))
        sb.kill()
        if warm:
            _wait("a ready slot", lambda: _ready(c, template) >= 1)
        sid, ms = _podbay_create(c, template)
        samples[f"podbay_create_{tag}"].append(ms)
        c.delete(f"/v1/sandboxes/{sid}").raise_for_status()


def _ops(c: httpx.Client, template: str, runs: int, samples: dict[str, list[float]]) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(template=template, timeout=3600)
    sid = sandbox_id_from_e2b(sb.sandbox_id) or sb.sandbox_id  # podbay's /v1 takes the stored spelling
    try:
        sb.commands.run("true")  # warm the guest's page cache for bash
        for i in range(runs):
            t0 = time.perf_counter()
            sb.commands.run("true")
            samples["e2b_commands_run_true"].append(_ms(t0))
            t0 = time.perf_counter()
            c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["/bin/bash", "-l", "-c", "true"],
                                                      "user": "user"}).raise_for_status()
            samples["podbay_exec_bash_login_true"].append(_ms(t0))
            t0 = time.perf_counter()
            sb.files.write(f"/tmp/e{i}", MIB)
            samples["e2b_files_write_1MiB"].append(_ms(t0))
            t0 = time.perf_counter()
            assert sb.files.read(f"/tmp/e{i}", format="bytes") == MIB
            samples["e2b_files_read_1MiB"].append(_ms(t0))
            t0 = time.perf_counter()
            c.put(f"/v1/sandboxes/{sid}/files", params={"path": f"/tmp/p{i}"}, content=MIB).raise_for_status()
            samples["podbay_files_put_1MiB"].append(_ms(t0))
            t0 = time.perf_counter()
            r = c.get(f"/v1/sandboxes/{sid}/files", params={"path": f"/tmp/p{i}"})
            assert r.status_code == 200 and r.content == MIB
            samples["podbay_files_get_1MiB"].append(_ms(t0))
        for _ in range(runs):
            t0 = time.perf_counter()
            sb.create_snapshot()
            samples["e2b_create_snapshot"].append(_ms(t0))
            t0 = time.perf_counter()
            c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"}).raise_for_status()
            samples["podbay_snapshot_full"].append(_ms(t0))
        for _ in range(runs):
            t0 = time.perf_counter()
            forks = sb.fork(count=4, timeout=600)
            samples["e2b_fork_4"].append(_ms(t0))
            bad = [f for f in forks if isinstance(f, Exception)]
            for f in forks:
                if not isinstance(f, Exception):
                    f.kill()
            if bad:
                raise SystemExit(f"a fork failed: {bad[0]}")
            t0 = time.perf_counter()
            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 4})
            samples["podbay_fork_4"].append(_ms(t0))
            r.raise_for_status()
            children = r.json()["children"]
            for ch in children:
                c.delete(f"/v1/sandboxes/{ch['sandbox_id']}")
            if any(ch["state"] != "running" for ch in children):
                raise SystemExit(f"a fork failed: {children}")
    finally:
        sb.kill()


def _fs_snapshot(c: httpx.Client, template: str, runs: int, samples: dict[str, list[float]]) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(template=template, timeout=3600)
    sid = sandbox_id_from_e2b(sb.sandbox_id) or sb.sandbox_id  # podbay's /v1 takes the stored spelling
    try:
        sb.files.write("/home/user/fs.txt", "kept")
        snap = sb.create_snapshot(mode="filesystem")
        for _ in range(runs):
            t0 = time.perf_counter()
            child = Sandbox.create(snap.snapshot_id, timeout=600)
            samples["e2b_create_from_fs_snapshot"].append(_ms(t0))
            ok = child.files.read("/home/user/fs.txt") == "kept"
            child.kill()
            if not ok:
                raise SystemExit("a sandbox from the filesystem snapshot lacks its file")
            disk = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"})
            disk.raise_for_status()
            t0 = time.perf_counter()
            r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": disk.json()["id"]})
            samples["podbay_restore_disk_snapshot"].append(_ms(t0))
            r.raise_for_status()
            if r.json()["state"] != "running":
                raise SystemExit(f"the rollback to a disk snapshot did not run: {r.json()}")
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        sb.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="samples per metric (default 5)")
    ap.add_argument("--pool", type=int, default=2, help="warm pool size for the warm creates (default 2)")
    ap.add_argument("--template", default="base")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--only", default="create,ops,fs,warm", help="sections to run (default all)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False, base_env=dict(os.environ))
    samples: dict[str, list[float]] = {}
    for k in ("create_cold", "create_warm"):
        samples[f"e2b_{k}"], samples[f"podbay_{k}"] = [], []
    for k in ("e2b_commands_run_true", "podbay_exec_bash_login_true", "e2b_files_write_1MiB",
              "podbay_files_put_1MiB", "e2b_files_read_1MiB", "podbay_files_get_1MiB", "e2b_fork_4",
              "podbay_fork_4", "e2b_create_snapshot", "podbay_snapshot_full", "e2b_create_from_fs_snapshot",
              "podbay_restore_disk_snapshot"):
        samples[k] = []
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        os.environ.update({"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_SANDBOX_URL": stack.api_url,
                           "E2B_API_KEY": stack.api_key})
        with httpx.Client(base_url=stack.api_url, timeout=300,
                          headers={"authorization": f"Bearer {stack.api_key}"}) as c:
            c.delete(f"/v1/sandboxes/{_podbay_create(c, args.template)[0]}")  # warm-up, not counted
            if "create" in only:
                _creates(c, args.template, args.runs, False, samples)
            if "ops" in only:
                _ops(c, args.template, args.runs, samples)
            if "fs" in only:
                _fs_snapshot(c, args.template, args.runs, samples)
            if "warm" in only:
                c.put(f"/v1/pools/{args.template}", json={"size": args.pool}).raise_for_status()
                _creates(c, args.template, args.runs, True, samples)
                c.put(f"/v1/pools/{args.template}", json={"size": 0}).raise_for_status()
        print(f"load average at the end: {os.getloadavg()}")
        results: dict[str, dict[str, Any]] = {k: summarise(v) for k, v in samples.items() if v}
        report(results, args.json_path)
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
