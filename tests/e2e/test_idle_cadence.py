"""Snapshot and promotion work follows change, with a real microVM and short intervals (issue: idle costs
nothing; services/nodeagent/ops/cadence.py, libs/podbay/promotion.py): an idle sandbox takes no new disk
snapshot and promotes nothing, a paused one takes no new full snapshot; a write is snapshotted and promoted,
with only the changed chunks, within the intervals."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client, own_stack, sh_output, until

pytestmark = pytest.mark.e2e

DISK_S, FULL_S, PROMOTE_S = 5, 10, 5
TICK_S = 5  # services/nodeagent/ops/cadence.py TICK_S
SETTLE_S = 30  # a freshly started guest still writes its disk now and then for a while
ENV = {"PODBAY_SNAPSHOT_DISK_INTERVAL_S": str(DISK_S), "PODBAY_SNAPSHOT_FULL_INTERVAL_S": str(FULL_S),
       "PODBAY_PROMOTE_DISK_INTERVAL_S": str(PROMOTE_S), "PODBAY_CADENCE_CPU_BUDGET": "0",
       # This shared test machine runs near CPU saturation; admission by CPU pressure is tested elsewhere.
       "PODBAY_NODE_CPU_PRESSURE_MAX": "0", "PODBAY_PAUSED_RELEASE_S": "0"}


def _snapshots(c: Any, sid: str) -> dict[str, dict[str, Any]]:
    r = c.get(f"/v1/sandboxes/{sid}/snapshots")
    assert r.status_code == 200, r.text
    return {s["id"]: s for s in r.json()["snapshots"]}


def test_idle_sandbox_costs_no_snapshots_and_a_write_is_promoted_in_time(test_root: Path) -> None:
    with own_stack(test_root, ENV) as stack, api_client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        seen: dict[str, dict[str, Any]] = {}

        def quiet() -> bool:
            """No new disk snapshot for ``SETTLE_S`` (the guest has settled after its start).
            Full snapshots of a running guest go on: its kernel writes some RAM every few seconds."""
            now = _snapshots(c, sid)
            new = {i for i, s in now.items() if s["kind"] == "disk"} - set(seen)
            seen.update(now)
            if new:
                quiet.since = time.monotonic()  # type: ignore[attr-defined]
            # ... and its newest disk snapshot is in object storage (the first upload of a fresh bucket is long).
            newest = max((x for x in now.values() if x["kind"] == "disk"), key=lambda x: x["created_at"], default=None)
            promoted = newest is None or newest["promotion"] == "promoted"
            return promoted and time.monotonic() - getattr(quiet, "since", 0.0) >= SETTLE_S

        quiet.since = time.monotonic()  # type: ignore[attr-defined]
        try:
            until("the idle sandbox stops taking disk snapshots", quiet, 180, every_s=1)
        except AssertionError as exc:
            kinds = sorted((s["created_at"], s["kind"]) for s in seen.values())
            raise AssertionError(f"{exc}; snapshots: {kinds}") from None
        settled = _snapshots(c, sid)
        promoted = {i for i, s in settled.items() if s["promotion"] != "local"}
        # Two more disk and promotion intervals, idle: nothing new, nothing uploaded.
        time.sleep(2 * max(DISK_S, PROMOTE_S) + TICK_S)
        idle = _snapshots(c, sid)
        disk_new = [s for i, s in idle.items() if i not in seen and s["kind"] == "disk"]
        if disk_new:
            recent = sh_output(c, sid, "find / -xdev -newermt '-40 seconds' 2>/dev/null | head -40;"
                               " cat /proc/mounts | grep ' / '; ps -eo comm | grep -c lazyinit")
            timeline = sorted((s["created_at"], s["kind"]) for s in {**seen, **idle}.values())
            raise AssertionError(f"idle, yet new disk snapshots {disk_new}; timeline {timeline}; written: {recent}")
        # Nothing promoted since (retention may have dropped older rows from the list meanwhile).
        assert {i for i, s in idle.items() if s["promotion"] != "local"} <= promoted

        # A write: a disk snapshot within the disk interval (and a tick), promoted within the promotion interval.
        sh_output(c, sid, "head -c 1048576 /dev/urandom > /root/changed; sync")
        t = time.monotonic()

        def promoted_new() -> dict[str, Any] | None:
            for i, s in _snapshots(c, sid).items():
                if i not in idle and s["kind"] == "disk" and s["promotion"] == "promoted":
                    return s
            return None

        snap = until("the write is in a promoted disk snapshot", promoted_new,
                     DISK_S + PROMOTE_S + 3 * TICK_S + 30, every_s=1)
        took = time.monotonic() - t
        # Only the changed chunks went up (1 MiB of data, its metadata and journal), not the 2 GiB disk again.
        assert 0 < snap["uploaded_bytes"] < 32 << 20, snap
        assert took < DISK_S + PROMOTE_S + 3 * TICK_S + 30

        # Paused: the guest's memory and disk cannot change, so no full snapshot after the first one.
        assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        time.sleep(FULL_S + TICK_S + 2)  # a full snapshot of the changes before the pause may come
        before = {i for i, s in _snapshots(c, sid).items() if s["kind"] == "full"}
        time.sleep(2 * FULL_S + TICK_S)
        after = {i for i, s in _snapshots(c, sid).items() if s["kind"] == "full"}
        assert after - before == set()
        c.delete(f"/v1/sandboxes/{sid}")
