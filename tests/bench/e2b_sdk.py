"""Benchmark: the unmodified ``e2b`` SDK against a running stack (``podbay up``; ``eval "$(podbay env --e2b)"``).

    .venv/bin/python tests/bench/e2b_sdk.py --runs 10 --json e2b.json

Metrics: ``e2b_create`` (``Sandbox.create`` until it answered: the sandbox runs), ``e2b_commands_run_true``
(``commands.run("true")``: a login bash, ``/bin/bash -l -c true``, through the API's envd routing, the node's
envd service and the guest channel), ``e2b_files_write_1KiB`` and ``e2b_files_read_1KiB``, ``e2b_kill``,
and for comparison ``podbay_exec_bash_login_true``: the same ``/bin/bash -l -c true`` through podbay's own
``POST /v1/sandboxes/{id}/exec`` (the API is at ``E2B_SANDBOX_URL``; the E2B key is a podbay key).
The SDK reads ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` from the environment.
"""

from __future__ import annotations

import argparse
import os
import time

import httpx

try:
    from tests.bench._stats import report, summarise
except ImportError:  # run as a script from the repository root
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, summarise  # type: ignore[no-redef]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    from e2b import Sandbox

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="sandboxes to create (default 10)")
    ap.add_argument("--ops", type=int, default=10, help="commands and file round trips per sandbox (default 10)")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    samples: dict[str, list[float]] = {k: [] for k in (
        "e2b_create", "e2b_commands_run_true", "podbay_exec_bash_login_true", "e2b_files_write_1KiB",
        "e2b_files_read_1KiB", "e2b_kill")}
    api = httpx.Client(base_url=os.environ["E2B_SANDBOX_URL"], timeout=60,
                       headers={"authorization": f"Bearer {os.environ['E2B_API_KEY']}"})
    data = b"x" * 1024
    for _ in range(args.runs):
        t0 = time.perf_counter()
        sb = Sandbox.create(template="base")
        samples["e2b_create"].append(_ms(t0))
        try:
            sb.commands.run("true")  # warm the guest's page cache for bash
            for i in range(args.ops):
                t0 = time.perf_counter()
                sb.commands.run("true")
                samples["e2b_commands_run_true"].append(_ms(t0))
                t0 = time.perf_counter()
                r = api.post(f"/v1/sandboxes/{sb.sandbox_id}/exec",
                             json={"argv": ["/bin/bash", "-l", "-c", "true"], "user": "user"})
                r.raise_for_status()
                samples["podbay_exec_bash_login_true"].append(_ms(t0))
                t0 = time.perf_counter()
                sb.files.write(f"/tmp/f{i}", data)
                samples["e2b_files_write_1KiB"].append(_ms(t0))
                t0 = time.perf_counter()
                assert sb.files.read(f"/tmp/f{i}", format="bytes") == data
                samples["e2b_files_read_1KiB"].append(_ms(t0))
        finally:
            t0 = time.perf_counter()
            sb.kill()
            samples["e2b_kill"].append(_ms(t0))
    report({k: summarise(v) for k, v in samples.items()}, args.json_path)


if __name__ == "__main__":
    main()
