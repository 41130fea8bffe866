"""Benchmark: create a sandbox (restore from the template snapshot) to its first exec answer, and the exec
round trip of ``true``, through the HTTP API of a running stack (``podbay up``).

    .venv/bin/python tests/bench/create_exec.py --runs 30 --json create_exec.json

Metrics (docs/DESIGN.md §7): ``create_restore`` (POST /v1/sandboxes until the first exec of ``true`` answered),
``create_http`` (the create call alone), ``exec_true`` (POST .../exec of ``true``), ``delete``. The API is
found as the CLI finds it (PODBAY_API_URL / PODBAY_API_KEY, else the dev config file).
"""

from __future__ import annotations

import argparse
import time

import httpx

from podbay.clientconfig import load_client_config

try:
    from tests.bench._stats import report, summarise
except ImportError:  # run as a script from the repository root
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, summarise  # type: ignore[no-redef]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="creates to measure (default 30)")
    ap.add_argument("--execs", type=int, default=10, help="exec round trips per sandbox (default 10)")
    ap.add_argument("--template", default="base")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    cfg = load_client_config()
    create_ms: list[float] = []
    create_http_ms: list[float] = []
    exec_ms: list[float] = []
    delete_ms: list[float] = []
    with httpx.Client(base_url=cfg.api_url, headers={"authorization": f"Bearer {cfg.api_key}"}, timeout=120) as c:
        c.get("/healthz").raise_for_status()
        for _ in range(args.runs):
            t0 = time.perf_counter()
            r = c.post("/v1/sandboxes", json={"template": args.template})
            t1 = time.perf_counter()
            r.raise_for_status()
            sid = r.json()["id"]
            e = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            t2 = time.perf_counter()
            e.raise_for_status()
            create_http_ms.append((t1 - t0) * 1000)
            create_ms.append((t2 - t0) * 1000)
            for _ in range(args.execs):
                a = time.perf_counter()
                c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}).raise_for_status()
                exec_ms.append((time.perf_counter() - a) * 1000)
            a = time.perf_counter()
            c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
            delete_ms.append((time.perf_counter() - a) * 1000)
    report({"create_restore": summarise(create_ms), "create_http": summarise(create_http_ms),
            "exec_true": summarise(exec_ms), "delete": summarise(delete_ms)}, args.json_path)


if __name__ == "__main__":
    main()
