"""Benchmark: volumes on a stack of its own. The create call with one volume attached against without (both
cold restores: no warm pool), and write throughput inside the guest to the volume against the root disk.

    .venv/bin/python tests/bench/volumes.py --runs 10 --json volumes.json

Metrics: ``create_cold_no_volume`` and ``create_cold_one_volume`` (POST /v1/sandboxes, alternating, each
sandbox deleted before the next; the volume is the same 1 GiB one, made on the first attach, which is not
measured); ``write_MiBps_volume`` and ``write_MiBps_root`` (``dd bs=1M count=--write-mib conv=fsync`` of
zeros, timed in the guest, the median of ``--writes`` runs each, alternating; as ``{"value": MiB/s}``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
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

VOLUME = {"name": "bench", "path": "/mnt/data"}


def _create(c: httpx.Client, volumes: list[dict[str, Any]]) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = c.post("/v1/sandboxes", json={"template": "base", **({"volumes": volumes} if volumes else {})})
    ms = (time.perf_counter() - t0) * 1000
    r.raise_for_status()
    return str(r.json()["id"]), ms


def _sh(c: httpx.Client, sid: str, script: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": script})
    r.raise_for_status()
    body = r.json()
    if body["exit_code"] != 0:
        raise RuntimeError(f"{script!r} exited {body['exit_code']}: {body.get('stderr')}")
    return str(body["stdout"])


def _write_mibps(c: httpx.Client, sid: str, path: str, mib: int) -> float:
    """MiB/s of ``dd ... conv=fsync`` into ``path`` as the guest's clock sees it (file removed after)."""
    out = _sh(c, sid, f"a=$(date +%s%N); dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync 2>/dev/null;"
                      f" b=$(date +%s%N); rm -f {path}; sync; echo $((b-a))")
    return mib / (int(out.strip()) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="creates of each kind (default 10)")
    ap.add_argument("--writes", type=int, default=5, help="dd runs per target (default 5)")
    ap.add_argument("--write-mib", type=int, default=64, help="MiB per dd run (default 64)")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False, base_env={**os.environ})
    results: dict[str, dict[str, Any]] = {}
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"},
                          timeout=300) as c:
            print(f"load average at start: {os.getloadavg()}")
            c.put("/v1/pools/base", json={"size": 0}).raise_for_status()
            c.post("/v1/volumes", json={"name": "bench", "size_bytes": 1 << 30}).raise_for_status()
            sid, _ = _create(c, [VOLUME])  # the volume's file is made here: not measured
            c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
            plain: list[float] = []
            with_volume: list[float] = []
            for _ in range(args.runs):
                for vols, into in (([], plain), ([VOLUME], with_volume)):
                    sid, ms = _create(c, vols)
                    into.append(ms)
                    c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
            results["create_cold_no_volume"] = summarise(plain)
            results["create_cold_one_volume"] = summarise(with_volume)
            sid, _ = _create(c, [VOLUME])
            vol: list[float] = []
            rootfs: list[float] = []
            for _ in range(args.writes):
                vol.append(_write_mibps(c, sid, "/mnt/data/bench.dd", args.write_mib))
                rootfs.append(_write_mibps(c, sid, "/root/bench.dd", args.write_mib))
            c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
            results["write_MiBps_volume"] = {"value": round(statistics.median(vol), 1)}
            results["write_MiBps_root"] = {"value": round(statistics.median(rootfs), 1)}
            print(f"volume MiB/s runs: {[round(v, 1) for v in vol]}; root: {[round(v, 1) for v in rootfs]}")
            print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root)
        shutil.rmtree(root, ignore_errors=True)
    report(results, args.json_path)


if __name__ == "__main__":
    main()
