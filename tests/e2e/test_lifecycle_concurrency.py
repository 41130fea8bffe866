"""Concurrent lifecycle calls on one sandbox: every call is answered cleanly and the end state is coherent.

Twenty random calls (pause, resume, full and disk snapshots, rollback to an existing snapshot, fork of one
child) race from six threads against one real microVM. Each must be accepted (200/201/202) or refused with
409 ``invalid_state``/``conflict``, never a 5xx; afterwards the sandbox is running or paused, runs commands,
and its JetStream event history agrees with that state (docs/DESIGN.md §5, docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import nats
import pytest
from e2e_http import api_client as _client, sh_output as _sh

pytestmark = pytest.mark.e2e

SEED = 20240611
CALLS = 20
THREADS = 6
VERBS = ("pause", "resume", "snapshot_full", "snapshot_disk", "restore", "fork")
# The events that set the sandbox's state, and the state each one leaves it in.
STATE_EVENTS = {"started": "running", "paused": "paused", "resumed": "running", "restored": "running",
                "reattached": None}  # reattached carries its state in ``state``
OP_DEADLINE_S = 300.0


async def _events(nats_url: str, sandbox_id: str) -> list[dict[str, Any]]:
    """Every event of ``sandbox_id`` on PODBAY_EVT, in stream order (an ordered consumer, 2 s idle ends it)."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.jetstream().subscribe(f"podbay.evt.sandbox.{sandbox_id}.*", ordered_consumer=True)
        out: list[dict[str, Any]] = []
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                return out
            out.append(json.loads(msg.data))
    finally:
        await nc.close()


def _event_state(event: dict[str, Any]) -> str:
    named = STATE_EVENTS[event["type"]]
    return str(named if named is not None else event["state"])


def _last_state_event(events: list[dict[str, Any]]) -> dict[str, Any]:
    bearing = [e for e in events if e["type"] in STATE_EVENTS]
    assert bearing, [e["type"] for e in events]
    return bearing[-1]


def _call(stack: Any, sid: str, verb: str, snapshot_id: str) -> tuple[str, int, dict[str, Any]]:
    """One lifecycle call (``snapshot_id`` is the rollback target); returns (verb, status, body)."""
    with _client(stack) as c:
        if verb in ("pause", "resume"):
            r = c.post(f"/v1/sandboxes/{sid}/{verb}")
        elif verb.startswith("snapshot_"):
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": verb.removeprefix("snapshot_")})
        elif verb == "restore":
            r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": snapshot_id})
        else:
            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
        try:
            body = r.json()
        except ValueError:
            body = {"raw": r.text}
        return verb, r.status_code, body


def _wait_operations(c: httpx.Client, op_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Poll each operation until it is succeeded or failed (bounded); returns the last answer of each."""
    deadline = time.monotonic() + OP_DEADLINE_S
    last: dict[str, dict[str, Any]] = {}
    pending = list(op_ids)
    while pending and time.monotonic() < deadline:
        for op in list(pending):
            r = c.get(f"/v1/operations/{op}")
            assert r.status_code == 200, r.text
            last[op] = r.json()
            if last[op]["state"] in ("succeeded", "failed"):
                pending.remove(op)
        if pending:
            time.sleep(0.5)
    assert not pending, {op: last.get(op) for op in pending}
    return last


def test_concurrent_lifecycle_calls_leave_a_coherent_sandbox(stack: Any) -> None:
    rng = random.Random(SEED)
    plan = [rng.choice(VERBS) for _ in range(CALLS)]
    with _client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        children: list[str] = []
        try:
            _sh(c, sid, "echo base > /root/mark")
            # Rollback targets that exist before the storm: one full snapshot and one disk snapshot.
            snapshots = []
            for kind in ("full", "disk"):
                r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": kind})
                assert r.status_code == 201, r.text
                snapshots.append(r.json()["id"])
            targets = {i: rng.choice(snapshots) for i, verb in enumerate(plan) if verb == "restore"}

            def run(i: int) -> tuple[str, int, dict[str, Any]]:
                return _call(stack, sid, plan[i], targets.get(i, ""))

            with ThreadPoolExecutor(max_workers=THREADS) as pool:
                results = list(pool.map(run, range(CALLS)))

            for verb, status, body in results:
                if verb == "fork" and status in (200, 202):
                    children += [ch["sandbox_id"] for ch in body["children"]]
            bad = [(verb, status, body) for verb, status, body in results
                   if not (status in (200, 201, 202)
                           or (status == 409 and body.get("error", {}).get("code") in ("invalid_state", "conflict")))]
            assert not bad, {"plan": plan, "bad": bad}

            ops = [str(body["operation_id"]) for _, status, body in results if status == 202]
            _wait_operations(c, ops)

            info = c.get(f"/v1/sandboxes/{sid}").json()
            assert info["state"] in ("running", "paused"), {"info": info, "results": results}
            final = info["state"]

            # The event history ends in the same state (the outbox relay publishes within about a second).
            deadline = time.monotonic() + 15
            events = asyncio.run(_events(stack.nats_url, sid))
            while _event_state(_last_state_event(events)) != final and time.monotonic() < deadline:
                time.sleep(1.0)
                events = asyncio.run(_events(stack.nats_url, sid))
            summary = [(e["type"], e.get("state"), e["data"].get("seq")) for e in events]
            last = _last_state_event(events)
            assert _event_state(last) == final, {"final": final, "events": summary}
            assert last.get("state") in (None, final), {"final": final, "events": summary}
            seqs = [e["data"]["seq"] for e in events]
            assert all(a < b for a, b in zip(seqs, seqs[1:], strict=False)), {"events": summary}

            if final == "paused":
                r = c.post(f"/v1/sandboxes/{sid}/resume")
                assert r.status_code == 200 and r.json()["state"] == "running", r.text
            assert _sh(c, sid, "echo ok") == "ok\n"
            assert _sh(c, sid, "cat /root/mark") == "base\n"
        finally:
            for child in children:
                c.delete(f"/v1/sandboxes/{child}")
            c.delete(f"/v1/sandboxes/{sid}")
