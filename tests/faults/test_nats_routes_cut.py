"""A NATS server cut off from the other two by its routes only, under load (issue 42, "faults").

Unlike the SIGSTOP partition of test_bus_and_replicas.py, the cut server keeps running and keeps its client
connections (tests/faults/faultload.py, ``RoutePartition``): it answers its clients' pings, so the ping check
never moves them, while it has no majority. The other two elect new leaders; what clients on the lone server
send waits for its retries or ends in a clear error (how many creates still succeeded during the cut is
printed, not asserted: clients stay on the lone server). Then the routes return and the invariants are
checked. A module of its own: its fleet is not shared with the other faults.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from nats.aio.client import Client as NATS

from faultload import Fleet, Load, RoutePartition, all_current, check_invariants

from podbay.contracts import subjects
from podbay.devstack.servers import NatsServer

pytestmark = pytest.mark.timeout(300)

#: Open finding (issue 42): with the routes cut, a create the API took at the moment of the cut can answer 503
#: to every retry with its Idempotency-Key, on both API processes, for the client's whole 60 s and past the
#: heal (2 of 40 creates in one run), which check_invariants reports as unanswered. Not strict: other runs pass.
_FINDING = ("creates begun at the cut answered 503 to every retry for 60 s, past the heal; "
            "clients on the lone server stay on it")

WARMUP_S = 3.0
#: How long the routes stay cut (s): past a leader election on the majority side (7 to 8 s measured).
ROUTES_CUT_S = 20.0


async def _stream_leader_at(nc: NATS) -> str | None:
    """The command stream's leader as the server ``nc`` is connected to sees it (None: no leader yet)."""
    try:
        info = await nc.jetstream(timeout=2.0).stream_info(subjects.CMD_STREAM)
    except Exception:  # noqa: BLE001 - no leader yet
        return None
    return str(info.cluster.leader) if info.cluster and info.cluster.leader else None


@pytest.mark.xfail(reason=_FINDING, strict=False)
async def test_a_nats_server_whose_routes_are_cut_loses_nothing(fleet: Fleet) -> None:
    info = await fleet.bus.js.stream_info(subjects.CMD_STREAM)
    assert info.cluster is not None and info.cluster.leader
    victim = str(info.cluster.leader)  # the stream leader: its loss costs most
    server = fleet.stack.servers[victim]
    assert isinstance(server, NatsServer)
    cut = RoutePartition(server)
    majority = await nats.connect(next(s.url for n, s in fleet.stack.servers.items()
                                       if isinstance(s, NatsServer) and n != victim), name="faults-majority")
    try:
        async with Load(fleet) as load:
            await asyncio.sleep(WARMUP_S)
            fault_at = time.monotonic()
            await asyncio.to_thread(cut.cut)
            assert cut.cut_connections > 0, "the victim had no route connection to cut"
            # The majority side elects a leader among itself (asked there: the lone server may still think it leads).
            deadline = fault_at + 60
            while await _stream_leader_at(majority) in (None, victim):
                assert time.monotonic() < deadline, "the majority side never elected a new stream leader"
                await asyncio.sleep(0.5)
            elected_at = time.monotonic()
            # Measured, not asserted: clients connected to the lone server stay on it (it answers their pings),
            # so the fleet may stall until the routes return (docs/operations.md, "Running a fleet").
            progressed = await load.progress(elected_at, timeout_s=fault_at + ROUTES_CUT_S - time.monotonic())
            progress_s = time.monotonic() - fault_at if progressed else None
            await asyncio.sleep(max(0.0, fault_at + ROUTES_CUT_S - time.monotonic()))
            during = sum(1 for o in load.acked("create") if fault_at <= o.started and o.acked
                         and o.acked < fault_at + ROUTES_CUT_S)
            await asyncio.to_thread(cut.heal)
            healed_at = time.monotonic()
            assert await load.progress(healed_at), "creates started after the routes returned never succeeded"
    finally:
        await asyncio.to_thread(cut.heal)
        await majority.close()
    counts = await check_invariants(fleet, load)
    await all_current(fleet, timeout_s=120.0)
    figures = {"fault": f"nats server {victim} routes cut for {ROUTES_CUT_S:.0f} s (nftables)",
               "recovery_s": round(load.recovery_s(fault_at), 2),
               "longest_gap_s": round(load.longest_gap_s(fault_at), 2), **counts,
               "failed_attempts": dict(load.errors()), "new_leader_s": round(elected_at - fault_at, 2),
               "five_creates_during_s": None if progress_s is None else round(progress_s, 2), "creates_acked_during": during,
               "rejoined_s": round(time.monotonic() - healed_at, 2)}
    print("FAULT " + json.dumps(figures))
