"""A template built on one node starts on another (services/nodeagent/build/, template_fetch.py), real VMs.

The stack's node agent builds a template; the build is promoted to object storage with only the chunks
its root (``base``) lacks uploaded. That agent is stopped and a second one (own data directory and node id,
the same ``base`` build) is started; a create of the template is placed there, which fetches the build on
first use and runs it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, sh, until

from podbay.contracts.templates import BuildEvent
from podbay.devstack.netns import purge_networks
from podbay.devstack.procs import free_port, stop_process
from podbay.devstack.vms import kill_strays, unmount_node_stores
from podbay.sdk import Client

pytestmark = pytest.mark.e2e


def test_a_template_built_on_one_node_starts_on_another(stack: Any, tmp_path: Path) -> None:
    node2_dir = Path(stack.data_dir) / "node2"
    port = free_port()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "note.txt").write_text("copied on node one\n")
    events: list[BuildEvent] = []
    name = "travels"
    with Client(stack.api_url, stack.api_key, timeout_s=600) as sdk, api_client(stack, timeout_s=600) as c:
        sdk.build_template(name, "FROM podbay/base\nRUN echo built-on-one > /etc/built\nCOPY note.txt /srv/\n",
                                 ctx, on_event=events.append)
        promoted = [e.text for e in events if e.type == "log" and e.text and "promoted to object storage" in e.text]
        assert promoted, [e.text for e in events]
        node2: subprocess.Popen[bytes] | None = None
        sid: str | None = None
        try:
            # The second node gets the build cache's copy of base at the digest the template was built on.
            base = next(t["digest"] for t in c.get("/v1/templates").json()["templates"] if t["name"] == "base")
            cache = tmp_path / "cache"
            (cache / "templates").mkdir(parents=True)
            for meta in (Path(stack.env["PODBAY_CACHE_DIR"]) / "templates").glob("*/template.json"):
                if f'"{base}"' in meta.read_text() or meta.parent.name.endswith(base[:16]):
                    (cache / "templates" / meta.parent.name).symlink_to(meta.parent)
            env = {**stack.env, "PODBAY_NODE_ID": "node-2", "PODBAY_NODE_PORT": str(port),
                   "PODBAY_DATA_DIR": str(node2_dir), "PODBAY_CACHE_DIR": str(cache),
                   "PODBAY_SNAPSHOT_DISK_INTERVAL_S": "0"}
            stack.kill("nodeagent", signal.SIGTERM)
            log = open(tmp_path / "node2.log", "wb")
            node2 = subprocess.Popen([str(Path(stack.bin_dir) / "podbay-nodeagent")], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert node2.poll() is None, (tmp_path / "node2.log").read_text()[-3000:]
                time.sleep(0.5)
            # The first node's heartbeat expires (TTL), so only node-2 is live: waited for as the API sees it
            # (every process computes a heartbeat's expiry from its stored time alike), plus a second.
            until("only node-2 is live", lambda: [n["id"] for n in c.get("/v1/nodes").json()["nodes"] if n["live"]]
                  == ["node-2"], 60)
            time.sleep(1)
            r = c.post("/v1/sandboxes", json={"template": name})
            assert r.status_code == 201, r.text + (tmp_path / "node2.log").read_text()[-3000:]
            sid = r.json()["id"]
            assert r.json()["node_id"] == "node-2"
            assert sh(c, sid, "cat /etc/built /srv/note.txt").split("\n")[:2] == ["built-on-one", "copied on node one"]
        finally:
            if sid is not None:
                c.delete(f"/v1/sandboxes/{sid}")
            if node2 is not None:
                stop_process(node2, grace_s=10)
            # node-2's data dir is not the stack's, so the stack's purge would miss what it made on the host.
            kill_strays(node2_dir)
            unmount_node_stores(node2_dir)
            purge_networks(node2_dir)
            stack.restart("nodeagent")
            c.delete(f"/v1/templates/{name}")
