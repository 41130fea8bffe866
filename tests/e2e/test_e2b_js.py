"""E2B's JavaScript SDK (the ``e2b`` npm package, unmodified, version :data:`E2B_JS`) against the real stack:
``tests/e2e/e2b_js/check.mjs`` creates a sandbox, runs a command, writes and reads files, drives a PTY,
pauses and connects, forks and snapshots, and prints what the SDK returned; this test asserts on it.

Runs where ``node`` (at least the SDK's 20.18.1) is installed; the package is installed once per version
into the build cache (``PODBAY_CACHE_DIR``, default ``~/.cache/podbay``), from the npm registry.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from podbay.config import default_cache_dir

pytestmark = pytest.mark.e2e

#: The npm package's version (its ``engines`` asks for Node.js >= 20.18.1 on 20.x, or >= 22).
E2B_JS = "2.51.0"
SCRIPT = Path(__file__).parent / "e2b_js" / "check.mjs"


def _node_version() -> tuple[int, ...] | None:
    node = shutil.which("node")
    if node is None:
        return None
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    return tuple(int(x) for x in out.strip().lstrip("v").split("."))


@pytest.fixture(scope="module")
def sdk_dir() -> Path:
    version = _node_version()
    if version is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (E2B's JS SDK needs Node.js >= 20.18.1)")
    if not (version >= (22,) or (20, 18, 1) <= version < (21,)):
        pytest.skip(f"Node.js {'.'.join(map(str, version))} is older than E2B's JS SDK needs (20.18.1)")
    cache = Path(os.environ.get("PODBAY_CACHE_DIR") or default_cache_dir()) / "npm" / f"e2b-{E2B_JS}"
    if not (cache / "node_modules" / "e2b" / "package.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", "--loglevel=error",
                        f"e2b@{E2B_JS}"], check=True, timeout=600)
    # ES modules resolve packages from the script's own folder, so the script runs from beside node_modules.
    shutil.copyfile(SCRIPT, cache / SCRIPT.name)
    return cache


def test_the_e2b_js_sdk_runs_unmodified(stack: Any, sdk_dir: Path) -> None:
    env = {**os.environ, "E2B_API_URL": f"{stack.api_url}/e2b", "E2B_SANDBOX_URL": stack.api_url,
           "E2B_API_KEY": stack.api_key}
    done = subprocess.run(["node", str(sdk_dir / SCRIPT.name)], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            steps[row["step"]] = row
    errors = {k: v["error"] for k, v in steps.items() if "error" in v}
    assert not errors, errors
    assert steps["done"]["value"] is True

    run = steps["run"]["value"]
    assert run == {"stdout": "hi\nuser\n", "stderr": "err\n", "exitCode": 0}
    files = steps["files"]["value"]
    assert files["text"] == "from js" and "note.txt" in files["names"]  # the missing /tmp/js was created
    pty = steps["pty"]["value"]
    assert "pty-42" in pty["output"] and pty["exitCode"] == 0
    pause = steps["pause"]["value"]
    assert pause == {"paused": True, "stdout": "kept"}
    fork = steps["fork"]["value"]
    assert len(fork["children"]) == 2
    assert all(c["stdout"] == "from js" and c["id"] != fork["parent"] for c in fork["children"])
    snap = steps["snapshot"]["value"]
    assert snap["stdout"] == "from js" and snap["listed"] is True and snap["deleted"] is True


def test_get_host_over_https_from_node(stack: Any, sdk_dir: Path, tmp_path: Path) -> None:
    """``fetch('https://' + sbx.getHost(port))`` from Node with the exports of ``podbay env --e2b`` (E2B_DOMAIN,
    NODE_EXTRA_CA_CERTS) for a client config as ``podbay up`` writes it: the guest's page through the TLS edge."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"api_url": stack.api_url, "api_key": stack.api_key, **stack.edge_client()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODBAY_API_", "E2B_"))}
    out = subprocess.run([str(Path(sys.executable).with_name("podbay")), "env", "--e2b"],
                         env={**env, "PODBAY_CONFIG": str(cfg)}, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    exports = dict(shlex.split(line)[1].split("=", 1) for line in out.splitlines() if line.startswith("export "))
    done = subprocess.run(["node", str(sdk_dir / SCRIPT.name)], env={**env, **exports, "E2B_JS_STEPS": "host"},
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    host = next(r for r in rows if r["step"] == "host")
    assert "error" not in host, host
    assert host["value"]["host"].startswith("8001-") and host["value"]["host"].endswith(f".{exports['E2B_DOMAIN']}")
    assert host["value"]["status"] == 200 and host["value"]["text"] == "js-tls\n", host
