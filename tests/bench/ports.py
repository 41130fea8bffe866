"""Benchmark: a guest port through the API's edge against the same request from inside the guest.

    .venv/bin/python tests/bench/ports.py --runs 50 --json ports.json

Starts a stack of its own (like create.py), one sandbox with ``python3 -m http.server`` on port 8000 and a
WebSocket echo server (the e2e test's, tests/e2e/test_ports.py) on 8002, then measures:

- ``ports_ttfb_edge``: a GET of a 1 KiB file through the edge (host form, token header, one keep-alive
  connection), from sending to the first body byte; ``ports_ttfb_guest``: the same GET from inside the guest
  to 127.0.0.1:8000 (a Python loop in the guest, timed there); the ratio as ``ports_ttfb_ratio`` (p50s).
- ``ports_download_edge_MiB_per_s`` and ``ports_download_guest_MiB_per_s``: a 64 MiB file, through the edge and
  inside the guest (guest-timed), and their ratio.
- ``ports_ws_roundtrip_edge``: one 32-byte WebSocket message echoed, through the edge.

Guests run under TCG here: the guest-side figures include the guest's slowness on both sides of the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect as ws_connect

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays

try:
    from tests.bench._stats import report, stop_on_sigterm, summarise
except ImportError:  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, stop_on_sigterm, summarise  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
BIG_MIB = 64

# Timed inside the guest: N GETs of /small.bin on one connection (time to the first body byte), then one GET
# of /big.bin read to the end; prints JSON.
GUEST_CLIENT = r'''
import http.client, json, sys, time
n = int(sys.argv[1])
c = http.client.HTTPConnection("127.0.0.1", 8000)
ttfb = []
for _ in range(n):
    t = time.perf_counter()
    c.request("GET", "/small.bin")
    r = c.getresponse()
    r.read(1)
    ttfb.append((time.perf_counter() - t) * 1000)
    r.read()
t = time.perf_counter()
c.request("GET", "/big.bin")
r = c.getresponse()
total = 0
while True:
    b = r.read(1 << 16)
    if not b:
        break
    total += len(b)
print(json.dumps({"ttfb_ms": ttfb, "bytes": total, "s": time.perf_counter() - t}))
'''


def _ws_echo_source() -> str:
    text = (ROOT / "tests" / "e2e" / "test_ports.py").read_text()
    start = text.index("WS_ECHO = r'''") + len("WS_ECHO = r'''")
    return text[start:text.index("'''", start)]


def _sh(c: httpx.Client, sid: str, script: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": script, "timeout_s": 600})
    r.raise_for_status()
    if r.json()["exit_code"] != 0:
        raise RuntimeError(r.text)
    return str(r.json()["stdout"])


def _measure(stack: Stack, runs: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    headers = {"authorization": f"Bearer {stack.api_key}"}
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=600) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        r.raise_for_status()
        sid = r.json()["id"]
        try:
            c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/ws_echo.py"},
                  content=_ws_echo_source().encode()).raise_for_status()
            c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/client.py"},
                  content=GUEST_CLIENT.encode()).raise_for_status()
            _sh(c, sid, f"mkdir -p /srv && head -c 1024 /dev/zero > /srv/small.bin && "
                        f"head -c {BIG_MIB << 20} /dev/zero > /srv/big.bin && "
                        "(setsid python3 -m http.server 8000 --directory /srv >/dev/null 2>&1 </dev/null &) && "
                        "(setsid python3 /root/ws_echo.py 8002 >/dev/null 2>&1 </dev/null &) && sleep 2")
            token = c.get(f"/v1/sandboxes/{sid}/ports/8000/url").json()["token"]
            host = {"host": f"8000-{sid.replace('_', '-')}.localhost", "x-podbay-access-token": token}
            with httpx.Client(base_url=stack.api_url, headers=host, timeout=600) as edge:
                deadline = time.monotonic() + 120
                while edge.get("/small.bin").status_code != 200:  # the servers start, then warm-up
                    if time.monotonic() > deadline:
                        raise RuntimeError("the guest's HTTP server did not answer within 120 s")
                    time.sleep(0.5)
                ttfb = []
                for _ in range(runs):
                    t = time.perf_counter()
                    with edge.stream("GET", "/small.bin") as resp:
                        body = resp.iter_raw()
                        next(body)
                        ttfb.append((time.perf_counter() - t) * 1000)
                        for _ in body:
                            pass
                results["ports_ttfb_edge"] = summarise(ttfb)
                t = time.perf_counter()
                total = 0
                with edge.stream("GET", "/big.bin") as resp:
                    for chunk in resp.iter_raw(1 << 16):
                        total += len(chunk)
                edge_rate = total / (1 << 20) / (time.perf_counter() - t)
            guest = json.loads(_sh(c, sid, f"python3 /root/client.py {runs}"))
            results["ports_ttfb_guest"] = summarise(guest["ttfb_ms"])
            guest_rate = guest["bytes"] / (1 << 20) / guest["s"]
            results["ports_ttfb_ratio"] = {"value": round(
                results["ports_ttfb_edge"]["p50_ms"] / results["ports_ttfb_guest"]["p50_ms"], 2)}
            results["ports_download_edge_MiB_per_s"] = {"value": round(edge_rate, 1)}
            results["ports_download_guest_MiB_per_s"] = {"value": round(guest_rate, 1)}
            results["ports_download_ratio"] = {"value": round(edge_rate / guest_rate, 2)}
            ws_url = stack.api_url.replace("http://", "ws://") + f"/ports/8002-{sid.replace('_', '-')}/"
            with ws_connect(ws_url, additional_headers={"x-podbay-access-token": token}, open_timeout=60) as ws:
                msg = "x" * 32
                ws.send(msg)
                ws.recv(timeout=60)  # warm-up
                rtt = []
                for _ in range(runs):
                    t = time.perf_counter()
                    ws.send(msg)
                    ws.recv(timeout=60)
                    rtt.append((time.perf_counter() - t) * 1000)
            results["ports_ws_roundtrip_edge"] = summarise(rtt)
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="requests and round trips per metric (default 50)")
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
        print(f"load average at start: {os.getloadavg()}")
        results = _measure(stack, args.runs)
        print(f"load average at end: {os.getloadavg()}")
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        shutil.rmtree(root, ignore_errors=True)
    report(results, args.json_path)


if __name__ == "__main__":
    main()
