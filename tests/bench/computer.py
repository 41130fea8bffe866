"""Benchmark: the ``browser`` template (templates/browser/Dockerfile, FROM templates/chromium/Dockerfile, 1024 MiB)
and the computer-use API.

    .venv/bin/python tests/bench/computer.py --runs 20 --json computer.json

Starts a stack of its own (like template.py), builds ``chromium`` and ``browser`` (the slow layers come from the host's build
cache, cache_dir/layers, when an earlier build on this machine left them; otherwise the first build downloads
Chromium through the gateway and takes many minutes under TCG), then measures:

- ``build_templates_ms``: the builds of ``chromium`` and the templates measured (one value: cached or not, as printed);
- ``create_cold_browser`` and ``create_warm_browser`` (a pool of 2): the HTTP create of a sandbox with a
  running Chromium, to 201, then its delete (not timed); ``create_cold_base`` beside it for scale;
- ``screenshot``: ``POST .../computer/screenshot`` through the SDK, to the whole PNG (1280x577 of
  ``about:blank``; the node opens a CDP connection per call);
- ``cdp_evaluate_roundtrip``: ``Runtime.evaluate`` of ``1+1`` on the page, sent on one CDP WebSocket held
  open through the API's port edge (``GET .../computer/cdp``'s URL), to its answer;
- ``guest_used_MiB``: the guest's ``MemTotal - MemAvailable`` with Chromium idle (one reading).

With ``--templates browser,desktop`` (the default) the same for ``desktop`` (templates/desktop/Dockerfile,
1024 MiB, 3072 MiB disk; its layers from the host's build cache too), each metric suffixed ``_desktop``
(``screenshot_desktop`` is the whole X screen read over VNC, 1280x720), and for each template the host's
memory per sandbox, its QEMU's PSS (the RAM file's touched pages count, as in density.py):
``host_MiB_idle_<template>`` 3 s after its create, ``host_MiB_busy_<template>`` after 20 s of a page
animating a full-window canvas (requestAnimationFrame) while screenshots are taken.

Guests run under TCG here: Chromium itself runs slowly, which dominates the screenshot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect as ws_connect

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.sdk import Client
from podbay.vmmem import vm_memory

try:
    from tests.bench._stats import report, stop_on_sigterm, summarise
except ImportError:  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, stop_on_sigterm, summarise  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"
#: The browser template's memory (templates/browser/Dockerfile says why).
BROWSER_MEMORY_MIB = 1024
EGRESS = {"allow": [{"domain": "deb.debian.org", "ports": [80]}]}
#: How each template is built: (Dockerfile, context, build options).
BUILDS: dict[str, tuple[Path, Path, dict[str, Any]]] = {
    "browser": (TEMPLATES / "browser" / "Dockerfile", TEMPLATES / "browser",
                {"ready_port": 9222, "memory_mib": BROWSER_MEMORY_MIB}),
    "desktop": (TEMPLATES / "desktop" / "Dockerfile", TEMPLATES,
                {"ready_port": 6080, "memory_mib": 1024, "disk_mib": 3072, "egress": EGRESS}),
}
#: The busy workload: a canvas the size of the window, redrawn every animation frame.
ANIMATE = ("(() => { const c = document.createElement('canvas'); c.width = innerWidth; c.height = innerHeight;"
           " document.body.appendChild(c); const g = c.getContext('2d'); let n = 0;"
           " const f = () => { g.fillStyle = `hsl(${n++ % 360},80%,50%)`;"
           " g.fillRect(Math.random() * c.width, Math.random() * c.height, 200, 120); requestAnimationFrame(f); };"
           " f(); return 1; })()")
BUSY_S = 20.0


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _ready(c: httpx.Client, template: str) -> int:
    return sum(int(p["ready"]) for p in c.get("/v1/pools").json()["pools"] if p["template"] == template)


def _wait(what: str, check: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.1)


def _create_ms(c: httpx.Client, template: str) -> float:
    t0 = time.perf_counter()
    r = c.post("/v1/sandboxes", json={"template": template})
    ms = _ms(t0)
    if r.status_code != 201:
        raise SystemExit(f"create answered {r.status_code}: {r.text}")
    c.delete(f"/v1/sandboxes/{r.json()['id']}").raise_for_status()
    return ms


def _qemu_pss_mib(store: Path, sid: str) -> float:
    """The PSS of the sandbox's QEMU (its ``qemu.pid`` in the node's store), MiB."""
    for pidfile in (store / "sandboxes" / sid).glob("**/qemu.pid"):
        mem = vm_memory(int(pidfile.read_text().split()[0]), None)
        if mem is not None:
            return float(mem.pss_mib)
    raise SystemExit(f"no running QEMU for {sid}")


def _evaluate_ms(url: str, runs: int, expression: str = "1+1", expect: Any = 2) -> list[float]:
    """``runs`` round trips of ``Runtime.evaluate(expression)`` on the first page, over one CDP WebSocket."""
    out: list[float] = []
    with ws_connect(url, max_size=None, open_timeout=30) as ws:
        def call(msg_id: int, method: str, params: dict[str, Any], session: str | None = None) -> dict[str, Any]:
            msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
            if session:
                msg["sessionId"] = session
            ws.send(json.dumps(msg))
            while True:
                ans = json.loads(ws.recv(timeout=60))
                if ans.get("id") == msg_id:
                    if "error" in ans:
                        raise SystemExit(f"{method}: {ans['error']}")
                    return dict(ans.get("result", {}))

        pages = [t for t in call(1, "Target.getTargets", {})["targetInfos"] if t["type"] == "page"]
        session = call(2, "Target.attachToTarget", {"targetId": pages[0]["targetId"], "flatten": True})["sessionId"]
        for i in range(runs):
            t0 = time.perf_counter()
            res = call(10 + i, "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
            out.append(_ms(t0))
            if res["result"]["value"] != expect:
                raise SystemExit(f"{expression} answered {res}")
    return out


def _measure(c: httpx.Client, sdk: Client, tpl: str, runs: int, store: Path) -> dict[str, dict[str, Any]]:
    """The metrics of one template (module docstring); ``browser``'s unsuffixed, others' ``_<template>``."""
    sfx = "" if tpl == "browser" else f"_{tpl}"
    out: dict[str, dict[str, Any]] = {}
    out[f"create_cold_{tpl}"] = summarise([_create_ms(c, tpl) for _ in range(runs)])
    c.put(f"/v1/pools/{tpl}", json={"size": 2}).raise_for_status()
    warm: list[float] = []
    for _ in range(runs):
        _wait("a ready slot", lambda: _ready(c, tpl) >= 1)
        warm.append(_create_ms(c, tpl))
    out[f"create_warm_{tpl}"] = summarise(warm)
    c.put(f"/v1/pools/{tpl}", json={"size": 0}).raise_for_status()
    _wait("the pool to drain", lambda: _ready(c, tpl) == 0)

    r = c.post("/v1/sandboxes", json={"template": tpl})
    r.raise_for_status()
    sid = r.json()["id"]
    try:
        time.sleep(3)  # idle: the guest settles after its hygiene
        out[f"host_MiB_idle_{tpl}"] = {"value": round(_qemu_pss_mib(store, sid), 1)}
        shots: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            png = sdk.screenshot(sid)
            shots.append(_ms(t0))
            if not png.startswith(b"\x89PNG"):
                raise SystemExit("the screenshot is not a PNG")
        out[f"screenshot{sfx}"] = summarise(shots)
        url = sdk.cdp(sid).url
        out[f"cdp_evaluate_roundtrip{sfx}"] = summarise(_evaluate_ms(url, runs))
        mem = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "cat /proc/meminfo"}).json()["stdout"]
        kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in mem.splitlines() if ln.split()[1:2]}
        out[f"guest_used_MiB{sfx}"] = {"value": round((kib["MemTotal"] - kib["MemAvailable"]) / 1024, 1)}
        out[f"guest_swap_used_MiB{sfx}"] = {"value": round((kib["SwapTotal"] - kib["SwapFree"]) / 1024, 1)}
        _evaluate_ms(url, 1, ANIMATE, 1)  # busy: the page animates from now on
        t_end = time.monotonic() + BUSY_S
        while time.monotonic() < t_end:
            sdk.screenshot(sid)
        out[f"host_MiB_busy_{tpl}"] = {"value": round(_qemu_pss_mib(store, sid), 1)}
    finally:
        c.delete(f"/v1/sandboxes/{sid}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="samples per metric (default 20)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--templates", default="browser,desktop", help="browser, desktop or both (default)")
    args = ap.parse_args()
    templates = [t for t in args.templates.split(",") if t]
    if not set(templates) <= set(BUILDS):
        raise SystemExit(f"--templates: {templates} (browser, desktop)")

    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False, base_env={**os.environ})
    results: dict[str, dict[str, Any]] = {}
    try:
        stop_on_sigterm()
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        print(f"load average at start: {os.getloadavg()}")
        headers = {"authorization": f"Bearer {stack.api_key}"}
        with Client(stack.api_url, stack.api_key, timeout_s=3600) as sdk, \
                httpx.Client(base_url=stack.api_url, headers=headers, timeout=120) as c:
            t0 = time.perf_counter()
            events: list[Any] = []
            sdk.build_template("chromium", TEMPLATES / "chromium" / "Dockerfile", TEMPLATES / "chromium",
                               egress=EGRESS, on_event=events.append)
            for tpl in templates:
                dockerfile, context, opts = BUILDS[tpl]
                sdk.build_template(tpl, dockerfile, context, on_event=events.append, **opts)
            results["build_templates_ms"] = {"value": round(_ms(t0))}
            cached = all(e.cached for e in events if e.type == "step")
            print(f"  build: {results['build_templates_ms']['value']} ms ({'all cached' if cached else 'ran steps'})")
            store = root / "stack" / "nodes" / Settings().node_id / "store"
            results["create_cold_base"] = summarise([_create_ms(c, "base") for _ in range(args.runs)])
            for tpl in templates:
                results.update(_measure(c, sdk, tpl, args.runs, store))
        print(f"load average at end: {os.getloadavg()}")
    finally:
        # Reported before the stack stops (its purge can take minutes), and also when a bound stopped the run.
        report(results, args.json_path)
        stack.stop(purge=True)
        kill_strays(root / "stack")
        subprocess.run(["rm", "-rf", str(root)], check=False)


if __name__ == "__main__":
    main()
