"""A burst of creates beyond a node's room (issue: bursts beyond capacity), on a stack of its own.

The node's room is set explicitly: ``PODBAY_NODE_MEMORY_MIB`` = ``ROOM`` x 256 MiB with the nominal cap on
(``PODBAY_MEMORY_OVERCOMMIT_RATIO=1``), and admission by measured memory counting a fresh sandbox at 1 MiB
(``PODBAY_MEMORY_SANDBOX_ESTIMATE_MIB``), so the nominal rule alone decides and exactly ``ROOM`` sandboxes
fit whatever this machine's memory figures. ``CREATES`` waiting creates are sent at once. Each one must
either answer 201 with a sandbox that runs a command, or 503 ``no_capacity`` with ``Retry-After`` once the
scheduler's retry window (``PODBAY_PLACEMENT_RETRY_S``, 5 s here) has passed; no 202 (the API's wait ran
out), no other error. Afterwards no sandbox is left pending or starting, every refused one is ``failed`` with
the reason, and the scheduler's log has no "maximum consumers" error (node lookups open no consumer).

Sizes: the issue's figure is 100 creates against room for 50; under TCG on two cores 50 restores take
minutes, so this runs 20 against room for 10 (``PODBAY_BURST_ROOM``/``PODBAY_BURST_CREATES`` override).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2e_http import api_client, own_stack

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.e2e

ROOM = int(os.environ.get("PODBAY_BURST_ROOM", "10"))
CREATES = int(os.environ.get("PODBAY_BURST_CREATES", str(2 * ROOM)))


@pytest.fixture(scope="module")
def room_node(test_root: Path) -> Iterator[Stack]:
    with own_stack(test_root, {"PODBAY_NODE_MEMORY_MIB": str(ROOM * 256), "PODBAY_MEMORY_OVERCOMMIT_RATIO": "1",
                               "PODBAY_MEMORY_SANDBOX_ESTIMATE_MIB": "1", "PODBAY_MEMORY_PRESSURE_IDLE_S": "0",
                               "PODBAY_PLACEMENT_RETRY_S": "5"}, prefix="b") as running:
        yield running


def test_a_burst_beyond_room_fills_the_room_and_refuses_the_rest_with_no_capacity(room_node: Stack) -> None:
    def create(_: int) -> tuple[httpx.Response, float]:
        with api_client(room_node, timeout_s=180) as c:
            t0 = time.monotonic()
            r = c.post("/v1/sandboxes", json={"template": "base"})
            return r, time.monotonic() - t0

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=CREATES) as pool:
        answers = list(pool.map(create, range(CREATES)))
    burst_s = time.monotonic() - t0

    by_outcome: Counter[str] = Counter()
    placed: list[str] = []
    refused: list[str] = []
    fail_s: list[float] = []
    for r, took in answers:
        if r.status_code == 201:
            by_outcome["created"] += 1
            placed.append(r.json()["id"])
        else:
            assert r.status_code == 503, r.text  # not 202 (a create left waiting), nor another error
            err = r.json()["error"]
            assert err["code"] == "no_capacity", r.text
            assert int(r.headers["retry-after"]) > 0
            by_outcome[err["code"]] += 1
            refused.append(err["details"]["sandbox_id"])
            fail_s.append(took)
    print(f"\nburst: {CREATES} creates, room {ROOM}: {dict(by_outcome)} in {burst_s:.1f} s; no_capacity "
          f"answered after {min(fail_s, default=0):.1f}-{max(fail_s, default=0):.1f} s")
    assert by_outcome["created"] == ROOM and by_outcome["no_capacity"] == CREATES - ROOM

    with api_client(room_node) as c:
        for sid in placed:
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        states = {s["id"]: s for s in c.get("/v1/sandboxes", params={"limit": 1000}).json()["sandboxes"]}
        assert not [s for s in states.values() if s["state"] in ("pending", "starting")]
        for sid in refused:
            assert states[sid]["state"] == "failed" and "room" in states[sid]["failure_reason"], states[sid]
    log = room_node.log_path("scheduler").read_text(errors="replace")
    assert "maximum consumers" not in log
