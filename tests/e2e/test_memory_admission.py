"""Admission by measured memory and release under memory pressure (services/nodeagent/ops/memory.py,
services/scheduler/placement.py), on a stack of its own whose node offers 400 MiB (``PODBAY_NODE_MEMORY_MIB``).

Nominally that holds one 256 MiB sandbox. Measured, an idle sandbox costs about 95 MiB here, and admission
counts each fresh one at a fixed 150 MiB (``PODBAY_MEMORY_SANDBOX_ESTIMATE_MIB``, so the arithmetic does not
depend on this machine's figure): three fit (room 400, then ~305, ~210), a fourth does not (~115 left). Paused
sandboxes are never released on a timer here (``PODBAY_PAUSED_RELEASE_S=0``) and running ones never paused for
memory (``PODBAY_MEMORY_PRESSURE_IDLE_S=0``), so the release the test sees is the pressure's own.

Both tests share the module's stack: the one that needs another size restarts the node agent with it (a few
seconds), rather than starting a stack of its own (a stack's start and stop cost about half a minute).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, sh, until, own_stack

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def memory_stack(test_root: Path) -> Iterator[Stack]:
    with own_stack(test_root, {"PODBAY_NODE_MEMORY_MIB": "400", "PODBAY_MEMORY_SANDBOX_ESTIMATE_MIB": "150",
                               "PODBAY_PAUSED_RELEASE_S": "0", "PODBAY_MEMORY_PRESSURE_IDLE_S": "0",
                               "PODBAY_NODE_HEARTBEAT_S": "1"}, prefix="mem") as running:
        yield running


def _node_offering(stack: Stack, mib: int) -> Stack:
    """``stack`` once its node offers ``mib`` MiB and holds no sandbox: the node agent is restarted with that
    ``PODBAY_NODE_MEMORY_MIB`` when it offers another size (its memory counters start again from zero)."""
    with api_client(stack) as c:
        until("no sandbox left on the node", lambda: not c.get("/v1/sandboxes").json()["sandboxes"], 120)
    agent = stack.services["nodeagent"]
    if agent.env.get("PODBAY_NODE_MEMORY_MIB") != str(mib):
        agent.env = {**agent.env, "PODBAY_NODE_MEMORY_MIB": str(mib)}
        stack.restart("nodeagent")
    return stack


@pytest.fixture
def small_node(memory_stack: Stack) -> Stack:
    return _node_offering(memory_stack, 400)


def _node_metric(stack: Any, name: str, labels: str) -> float:
    # The node's /metrics needs the stack's internal token (services/nodeagent/dataplane/grant_check.py).
    text = httpx.get(f"http://127.0.0.1:{stack.ports.node}/metrics", timeout=10,
                     headers={"x-podbay-internal-token": stack.env.get("PODBAY_INTERNAL_TOKEN", "")}).text
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_measured_use_admits_beyond_nominal_and_pressure_releases_a_paused_sandbox_before_refusing(
        small_node: Stack) -> None:
    with api_client(small_node) as c:
        ids: list[str] = []
        try:
            # Three sandboxes on a node that nominally holds one (3 x 256 MiB > 400 MiB).
            for _ in range(3):
                r = c.post("/v1/sandboxes", json={"template": "base"})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            first = ids[0]
            sh(c, first, "echo kept > /tmp/mark")
            until("the node to measure its three sandboxes", lambda: _node_metric(
                small_node, "podbay_node_memory_vms", 'kind="running"') == 3, 30)
            assert _node_metric(small_node, "podbay_node_memory_releases_total", 'kind="paused",outcome="ok"') == 0

            # Room is now below two sandboxes' worth: the node releases the paused one's RAM, unasked.
            assert c.post(f"/v1/sandboxes/{first}/pause").status_code == 200
            until("the paused sandbox's RAM released under pressure", lambda: _node_metric(
                small_node, "podbay_node_memory_releases_total", 'kind="paused",outcome="ok"') >= 1, 30)
            assert c.get(f"/v1/sandboxes/{first}").json()["state"] == "paused"

            # A fourth fits only in what the release freed.
            r = c.post("/v1/sandboxes", json={"template": "base"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
            assert sh(c, ids[-1], "echo ok").strip() == "ok"

            # The released sandbox comes back as it was.
            assert c.post(f"/v1/sandboxes/{first}/resume").status_code == 200
            assert sh(c, first, "cat /tmp/mark").strip() == "kept"
        finally:
            for sid in ids:
                c.delete(f"/v1/sandboxes/{sid}")


@pytest.fixture
def pooled_node(memory_stack: Stack) -> Stack:
    """A node of 600 MiB with the same fixed estimate: the low-water mark is 300 MiB of room, so a warm slot
    is prepared only while the room is at least 450 (one slot and the mark)."""
    return _node_offering(memory_stack, 600)


def _ready_slots(c: httpx.Client) -> int:
    pools = {p["template"]: p for p in c.get("/v1/pools").json()["pools"]}
    return int(pools["base"]["ready"]) if "base" in pools else 0


def test_memory_pressure_releases_warm_slots_first_and_the_pool_refills_only_when_room_returns(
        pooled_node: Stack) -> None:
    with api_client(pooled_node) as c:
        sid = None
        try:
            assert c.put("/v1/pools/base", json={"size": 1}).status_code == 200
            until("a warm slot", lambda: _ready_slots(c) == 1, 120)
            r = c.post("/v1/sandboxes", json={"template": "base"})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            # Room ~500 (one idle sandbox of ~95 MiB) still fits a slot above the mark: the pool refills.
            until("the pool refilled beside the sandbox", lambda: _ready_slots(c) == 1, 120)
            # The guest touches 160 MiB: the room falls below the mark. The slot goes, not the sandbox.
            sh(c, sid, "setsid -f python3 -c 'import time; b = b\"x\" * (160 << 20); time.sleep(900)' "
                       ">/dev/null 2>&1; sleep 2")
            until("the warm slot released under pressure", lambda: _node_metric(
                pooled_node, "podbay_node_memory_releases_total", 'kind="warm",outcome="ok"') >= 1, 120)
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            assert "python3" in sh(c, sid, "pgrep -a python3 || true")
            assert _ready_slots(c) == 0
            # With the sandbox gone the room is back, and the pool prepares its slot again.
            assert c.delete(f"/v1/sandboxes/{sid}").status_code in (200, 202, 204)
            sid = None
            until("the pool refilled once the room returned", lambda: _ready_slots(c) == 1, 120)
        finally:
            c.put("/v1/pools/base", json={"size": 0})
            if sid is not None:
                c.delete(f"/v1/sandboxes/{sid}")
