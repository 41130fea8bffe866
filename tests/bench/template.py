"""Benchmark: template builds from a Dockerfile, and creates from a built template against base (docs/DESIGN.md
§8, issue "Bring your own environment").

    .venv/bin/python tests/bench/template.py --runs 3 --json template.json [--creates 10]

It starts its own stack (as create.py does) and builds an example Dockerfile (RUN, COPY, ENV, WORKDIR, USER
and a start command serving HTTP with a readiness port; no network: RUN steps have no egress yet).

Metrics:

- ``build_cold``: a build whose every step runs (an ``ARG`` value used by the first RUN differs per run, so
  no layer is cached), from the SDK call to its ``done`` event;
- ``build_cached``: the same Dockerfile and args again: every step and the start snapshot reused;
- ``layer_exclusive_MiB`` / ``layers``: extents of the node's layer store not shared with anything else
  (``btrfs filesystem du``) after the cold builds, and the number of layers;
- ``template_exclusive_MiB``: the same for the built template's directory (what it adds over base);
- ``template_upload_MiB`` / ``template_total_MiB``: bytes the first cold build's promotion to object storage
  uploaded (chunks its root ``base`` lacks and the bucket did not hold; from the build log), against the
  template's whole files;
- ``create_cold_<template>``: ``POST /v1/sandboxes`` with no pool, for ``base`` and the built template;
- ``create_warm_<template>``: the same with a ready warm slot waiting (pool of 2; the wait is not timed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _stats import report, stop_on_sigterm, summarise

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.sdk import Client

DOCKERFILE = """\
FROM podbay/base
ARG NONCE=0
RUN useradd -m agent && mkdir -p /srv/app && echo "build $NONCE" > /srv/build.txt
COPY app/ /srv/app/
ENV PORT=8000 APP_MODE=bench
WORKDIR /srv/app
RUN python3 -c "import compileall; compileall.compile_dir('/srv/app', quiet=1)"
USER agent
CMD ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"]
"""


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _exclusive_mib(path: Path) -> float:
    out = subprocess.run(["btrfs", "filesystem", "du", "-s", "--raw", str(path)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return round(int(out[-1].split()[1]) / 2**20, 1)


def _wait(what: str, check: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.1)


def _ready(c: httpx.Client, template: str) -> int:
    return sum(int(p["ready"]) for p in c.get("/v1/pools").json()["pools"] if p["template"] == template)


def _create_ms(c: httpx.Client, template: str) -> float:
    t0 = time.perf_counter()
    r = c.post("/v1/sandboxes", json={"template": template})
    ms = _ms(t0)
    if r.status_code != 201:
        raise SystemExit(f"create answered {r.status_code}: {r.text}")
    c.delete(f"/v1/sandboxes/{r.json()['id']}").raise_for_status()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="cold and cached builds each (default 3)")
    ap.add_argument("--creates", type=int, default=10, help="creates per create metric (default 10)")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False, base_env={**os.environ})
    ctx = root / "ctx"
    (ctx / "app").mkdir(parents=True)
    for i in range(20):
        (ctx / "app" / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 50)
    (ctx / "app" / "index.html").write_text("hello\n")
    results: dict[str, dict[str, Any]] = {}
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        store = root / "stack" / "nodes" / Settings().node_id / "store"
        print(f"load average at start: {os.getloadavg()}")
        cold: list[float] = []
        cached: list[float] = []
        with Client(stack.api_url, stack.api_key, timeout_s=600) as sdk:
            for i in range(args.runs):
                t0 = time.perf_counter()
                logs: list[Any] = []
                sdk.build_template("bench-web", DOCKERFILE, ctx, build_args={"NONCE": str(i)}, ready_port=8000,
                                   on_event=logs.append)
                cold.append(_ms(t0))
                promoted = [m for e in logs if e.type == "log" and e.text and (
                    m := re.search(r"promoted to object storage: (\d+) of (\d+) bytes", e.text))]
                if i == 0 and promoted:
                    results["template_upload_MiB"] = {"value": int(promoted[0].group(1)) / 2**20}
                    results["template_total_MiB"] = {"value": int(promoted[0].group(2)) / 2**20}
                t0 = time.perf_counter()
                events: list[Any] = []
                sdk.build_template("bench-web", DOCKERFILE, ctx, build_args={"NONCE": str(i)}, ready_port=8000,
                                   on_event=events.append)
                cached.append(_ms(t0))
                if not all(e.cached for e in events if e.type == "step"):
                    raise SystemExit("the repeated build ran a step: the cache missed")
                print(f"  build {i + 1}: cold {cold[-1]:.0f} ms, cached {cached[-1]:.0f} ms")
        results["build_cold"] = summarise(cold)
        results["build_cached"] = summarise(cached)
        layers = [p for p in (store / "layers").iterdir() if not p.name.startswith(".")]
        results["layers"] = {"value": len(layers)}
        results["layer_exclusive_MiB"] = {"value": _exclusive_mib(store / "layers")}
        results["template_exclusive_MiB"] = {"value": _exclusive_mib(store / "templates" / "bench-web")}
        headers = {"authorization": f"Bearer {stack.api_key}"}
        with httpx.Client(base_url=stack.api_url, headers=headers, timeout=120) as c:
            for tpl in ("base", "bench-web"):
                results[f"create_cold_{tpl}"] = summarise([_create_ms(c, tpl) for _ in range(args.creates)])
            for tpl in ("base", "bench-web"):
                c.put(f"/v1/pools/{tpl}", json={"size": 2}).raise_for_status()
                warm: list[float] = []
                for _ in range(args.creates):
                    _wait("a ready slot", lambda t=tpl: _ready(c, t) >= 1)
                    warm.append(_create_ms(c, tpl))
                results[f"create_warm_{tpl}"] = summarise(warm)
                c.put(f"/v1/pools/{tpl}", json={"size": 0}).raise_for_status()
                _wait("the pool to drain", lambda t=tpl: _ready(c, t) == 0)
        print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        subprocess.run(["rm", "-rf", str(root)], check=False)
    report(results, args.json_path)


if __name__ == "__main__":
    main()
