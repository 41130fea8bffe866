"""Placement policy (services/scheduler/placement.py): pure logic with fake heartbeats."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from podbay.contracts.messages import NodeHeartbeat
from hypothesis import given, settings
from hypothesis import strategies as st

from podbay_scheduler.placement import (
    FALLBACK_OVERHEAD_MIB,
    W_TENANT,
    NoCapacity,
    NodeLoad,
    Request,
    choose_node,
    expected_cost,
    fits,
    measured,
    room_mib,
)


def _hb(node: str, *, mem: int = 4096, cpus: int = 8, templates: tuple[str, ...] = ("base",),
        schedulable: bool = True, **memory: object) -> NodeHeartbeat:
    """A heartbeat; ``memory`` gives its measured ``memory_*`` fields (none: a node that does not measure)."""
    return NodeHeartbeat(node_id=node, dataplane_url=f"http://{node}", memory_mib=mem, memory_used_mib=0, vcpus=cpus,
                         vcpus_used=0, sandboxes=0, templates=list(templates), accel="tcg", schedulable=schedulable,
                         at=datetime.now(UTC), **memory)


def _measured(node: str, *, available: int, sandboxes: int = 0, reclaimable: int = 0, cost: int | None = 130,
              limit: int | None = None, headroom: int = 1024, mem: int = 19284, cpus: int = 256) -> NodeHeartbeat:
    return _hb(node, mem=mem, cpus=cpus, memory_available_mib=available, memory_sandboxes_mib=sandboxes,
               memory_reclaimable_mib=reclaimable, memory_sandbox_cost_mib=cost, memory_limit_mib=limit,
               memory_headroom_mib=headroom, memory_measured_at=datetime.now(UTC))


def test_no_nodes_is_no_capacity() -> None:
    with pytest.raises(NoCapacity, match="no node is alive"):
        choose_node([], template="base", memory_mib=256, vcpus=1)


def test_template_must_be_on_the_node() -> None:
    with pytest.raises(NoCapacity, match="template 'other'"):
        choose_node([NodeLoad(_hb("a"), 0, 0)], template="other", memory_mib=256, vcpus=1)


def test_a_promoted_template_may_go_to_a_node_holding_its_root_and_prefers_the_one_holding_it() -> None:
    """A build promoted to object storage is fetched on first use, so a node with only its root (base) is a
    candidate; one that holds the build at the digest still wins on locality, and a node without the root
    never gets it."""
    holder = NodeLoad(_hb("a", templates=("base", "web")), 0, 0, has_digest=True)
    other = NodeLoad(_hb("b"), 0, 0)
    bare = NodeLoad(_hb("c", templates=()), 0, 0)
    req = Request("web", 256, 1, fetch_root="base")
    assert choose_node([other, bare], req, rng=random.Random(1)).node_id == "b"
    for seed in range(20):
        assert choose_node([holder, other], req, rng=random.Random(seed)).node_id == "a"
    with pytest.raises(NoCapacity, match="template 'web'"):
        choose_node([other], Request("web", 256, 1))  # not promoted: only a node that built it
    with pytest.raises(NoCapacity, match="template 'web'"):
        choose_node([bare], req)


def test_unschedulable_nodes_are_skipped() -> None:
    nodes = [NodeLoad(_hb("a", schedulable=False), 0, 0), NodeLoad(_hb("b"), 0, 0)]
    for seed in range(20):
        assert choose_node(nodes, template="base", memory_mib=256, vcpus=1, rng=random.Random(seed)).node_id == "b"


def test_memory_and_vcpus_already_placed_count() -> None:
    full_mem = NodeLoad(_hb("a", mem=1024), 900, 0)
    full_cpu = NodeLoad(_hb("b", cpus=2), 0, 2)
    with pytest.raises(NoCapacity, match="room"):
        choose_node([full_mem, full_cpu], template="base", memory_mib=256, vcpus=1)
    roomy = NodeLoad(_hb("c"), 0, 0)
    assert choose_node([full_mem, full_cpu, roomy], template="base", memory_mib=256, vcpus=1).node_id == "c"


def test_best_of_k_prefers_more_free_memory() -> None:
    busy = NodeLoad(_hb("busy"), 3000, 0)
    idle = NodeLoad(_hb("idle"), 0, 0)
    # With k covering both candidates the freer node always wins.
    for seed in range(20):
        got = choose_node([busy, idle], template="base", memory_mib=256, vcpus=1, k=2, rng=random.Random(seed))
        assert got.node_id == "idle"


# --- scoring: over-commit, spread, locality, warm slots -------------------------------------------------------


def test_overcommit_ratio_allows_more_memory_and_only_that_much() -> None:
    node = NodeLoad(_hb("a", mem=1024), 1024, 0)
    with pytest.raises(NoCapacity, match="room"):
        choose_node([node], Request("base", 256, 1))
    assert choose_node([node], Request("base", 256, 1, memory_overcommit=1.25)).node_id == "a"
    with pytest.raises(NoCapacity, match="room"):
        choose_node([node], Request("base", 257, 1, memory_overcommit=1.25))


def test_vcpu_overcommit_ratio() -> None:
    node = NodeLoad(_hb("a", cpus=2), 0, 2)
    with pytest.raises(NoCapacity, match="room"):
        choose_node([node], Request("base", 256, 1))
    assert choose_node([node], Request("base", 256, 2, vcpu_overcommit=2.0)).node_id == "a"


def test_tenant_spread_prefers_the_node_without_its_sandboxes() -> None:
    # Same free capacity; the tenant already has two sandboxes on "a".
    a = NodeLoad(_hb("a"), 512, 2, tenant_sandboxes=2)
    b = NodeLoad(_hb("b"), 512, 2, tenant_sandboxes=0)
    for seed in range(20):
        assert choose_node([a, b], Request("base", 256, 1), rng=random.Random(seed)).node_id == "b"


def test_spread_outweighs_a_small_capacity_difference() -> None:
    # "a" is a little freer, but holds 3 of the tenant's sandboxes.
    a = NodeLoad(_hb("a"), 0, 0, tenant_sandboxes=3)
    b = NodeLoad(_hb("b"), 512, 1, tenant_sandboxes=0)
    assert choose_node([a, b], Request("base", 256, 1), rng=random.Random(1)).node_id == "b"


def test_wake_prefers_the_node_that_holds_the_snapshot_even_outside_the_sample() -> None:
    others = [NodeLoad(_hb(f"n{i}"), 0, 0) for i in range(10)]
    local = NodeLoad(_hb("local"), 1024, 1, holds_snapshot=True)
    for seed in range(30):  # k=2 of 11: the local node is rarely sampled, yet always considered
        got = choose_node([*others, local], Request("base", 256, 1, wake=True), k=2, rng=random.Random(seed))
        assert got.node_id == "local"


def test_template_digest_locality_breaks_capacity_ties() -> None:
    a = NodeLoad(_hb("a"), 0, 0, has_digest=False)
    b = NodeLoad(_hb("b"), 0, 0, has_digest=True)
    for seed in range(20):
        assert choose_node([a, b], Request("base", 256, 1), rng=random.Random(seed)).node_id == "b"


def test_create_prefers_a_node_with_a_ready_warm_slot() -> None:
    others = [NodeLoad(_hb(f"n{i}"), 0, 0) for i in range(10)]
    warm = NodeLoad(_hb("warm"), 1024, 1, warm_ready=1)
    for seed in range(30):
        assert choose_node([*others, warm], Request("base", 256, 1), rng=random.Random(seed)).node_id == "warm"
    # A wake restores its own snapshot: a warm slot of the template is no reason to go there.
    for seed in range(30):
        got = choose_node([NodeLoad(_hb("idle"), 0, 0), warm], Request("base", 256, 1, wake=True), k=2,
                          rng=random.Random(seed))
        assert got.node_id == "idle"


def test_a_warm_or_local_node_that_is_full_is_never_chosen() -> None:
    full = NodeLoad(_hb("full", mem=1024), 1000, 0, warm_ready=3, holds_snapshot=True, has_digest=True)
    roomy = NodeLoad(_hb("roomy"), 0, 0, tenant_sandboxes=20)
    for wake in (False, True):
        assert choose_node([full, roomy], Request("base", 256, 1, wake=wake)).node_id == "roomy"


_node = st.builds(
    lambda i, mem, cpus, used_mem, used_cpu, tenant, warm, digest, snap: NodeLoad(
        _hb(f"n{i}", mem=mem, cpus=cpus), used_mem, used_cpu, tenant_sandboxes=tenant, warm_ready=warm,
        has_digest=digest, holds_snapshot=snap),
    st.integers(0, 10**6), st.integers(256, 8192), st.integers(1, 16), st.integers(0, 10000), st.integers(0, 20),
    st.integers(0, 30), st.integers(0, 3), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None)
@given(nodes=st.lists(_node, min_size=1, max_size=8, unique_by=lambda n: n.node_id),
       mem=st.integers(64, 4096), cpus=st.integers(1, 8), wake=st.booleans(),
       mem_ratio=st.sampled_from([1.0, 1.5, 2.0]), cpu_ratio=st.sampled_from([1.0, 4.0]),
       k=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_property_never_overcommits(nodes: list[NodeLoad], mem: int, cpus: int, wake: bool, mem_ratio: float,
                                    cpu_ratio: float, k: int, seed: int) -> None:
    req = Request("base", mem, cpus, wake=wake, memory_overcommit=mem_ratio, vcpu_overcommit=cpu_ratio)
    try:
        hb = choose_node(nodes, req, k=k, rng=random.Random(seed))
    except NoCapacity:
        assert not any(fits(n, req) for n in nodes)
        return
    n = next(n for n in nodes if n.node_id == hb.node_id)
    assert n.memory_used_mib + mem <= hb.memory_mib * mem_ratio
    assert n.vcpus_used + cpus <= hb.vcpus * cpu_ratio


@settings(max_examples=50, deadline=None)
@given(n_nodes=st.integers(2, 6), n_sandboxes=st.integers(2, 40), seed=st.integers(0, 2**32 - 1))
def test_property_one_tenant_spreads_evenly_over_equal_nodes(n_nodes: int, n_sandboxes: int, seed: int) -> None:
    """Placing a tenant's sandboxes one after another on equal nodes (best of all): no node gets more than
    one sandbox above another, because each sandbox of the tenant costs ``W_TENANT``."""
    assert W_TENANT > 0
    rng = random.Random(seed)
    count = {f"n{i}": 0 for i in range(n_nodes)}
    for _ in range(n_sandboxes):
        loads = [NodeLoad(_hb(nid, mem=1 << 20, cpus=1 << 10), c * 256, c, tenant_sandboxes=c)
                 for nid, c in count.items()]
        count[choose_node(loads, Request("base", 256, 1), k=n_nodes, rng=rng).node_id] += 1
    assert max(count.values()) - min(count.values()) <= 1


def test_only_live_nodes_in_state_ready_take_placements() -> None:
    from podbay_scheduler.placement import ready_nodes

    live = [_hb("a"), _hb("b"), _hb("c"), _hb("d"), _hb("e")]
    states = {"a": "ready", "b": "draining", "c": "drained", "d": "lost"}  # e: a heartbeat without a row
    assert [hb.node_id for hb in ready_nodes(live, states)] == ["a"]
    # A ready row without a heartbeat is not live, so not a candidate either.
    assert ready_nodes([], {"a": "ready"}) == []


def test_a_stack_whose_live_nodes_are_all_drained_or_draining_says_so_and_how_to_undo_it() -> None:
    from podbay_scheduler.placement import unready_reason

    why = unready_reason([_hb("b"), _hb("a")], {"a": "draining", "b": "drained"})
    assert why is not None and why.startswith("no live node takes new sandboxes: a is draining, b is drained")
    assert "podbay node undrain" in why
    # One ready node: its absence from the candidates has another reason (room, template), said elsewhere.
    assert unready_reason([_hb("a"), _hb("b")], {"a": "draining", "b": "ready"}) is None
    assert unready_reason([], {}) is None  # no live node at all: "no node is alive" stays right


# --- admission by measured memory -----------------------------------------------------------------------------


def test_old_heartbeats_still_parse_and_use_the_nominal_rule() -> None:
    old = _hb("a").model_dump(mode="json")
    for key in [k for k in old if k.startswith("memory_") and k not in ("memory_mib", "memory_used_mib")]:
        del old[key]
    hb = NodeHeartbeat.model_validate(old)
    assert not measured(NodeLoad(hb, 0, 0))
    # No ratio set (0): a node that does not measure is held to 1.0.
    node = NodeLoad(_hb("a", mem=1024), 1024, 0)
    with pytest.raises(NoCapacity, match="room"):
        choose_node([node], Request("base", 256, 1, memory_overcommit=0.0))


def test_measured_use_admits_beyond_the_nominal_cap() -> None:
    # 75 sandboxes of 256 MiB fill 80% of 24 GiB nominally; measured, the host still has 9 GiB available.
    node = NodeLoad(_measured("a", available=9000, sandboxes=75 * 130), 75 * 256, 75)
    nominal = Request("base", 256, 1, memory_overcommit=1.0)
    with pytest.raises(NoCapacity, match="room"):
        choose_node([node], nominal)
    assert choose_node([node], Request("base", 256, 1, memory_overcommit=0.0)).node_id == "a"


def test_measured_admission_keeps_the_headroom() -> None:
    req = Request("base", 256, 1, memory_overcommit=0.0)
    # room = 1024 + 130 - 1024 = 130: exactly one fresh sandbox at its measured cost of 130 MiB.
    assert fits(NodeLoad(_measured("a", available=1024 + 130), 0, 0), req)
    assert not fits(NodeLoad(_measured("a", available=1024 + 129), 0, 0), req)
    # A node that measures is refused by measurement even when nominally empty.
    with pytest.raises(NoCapacity, match="room"):
        choose_node([NodeLoad(_measured("a", available=1000), 0, 0)], req)


def test_sandboxes_in_flight_count_at_the_expected_cost() -> None:
    req = Request("base", 256, 1, memory_overcommit=0.0)
    hb = _measured("a", available=1024 + 3 * 130)
    assert fits(NodeLoad(hb, 0, 0, inflight=2), req)
    assert not fits(NodeLoad(hb, 0, 0, inflight=3), req)


def test_what_the_node_can_release_counts_as_room() -> None:
    req = Request("base", 256, 1, memory_overcommit=0.0)
    short = _measured("a", available=1024, reclaimable=0)
    assert not fits(NodeLoad(short, 0, 0), req)
    assert fits(NodeLoad(_measured("a", available=1024, reclaimable=130), 0, 0), req)


def test_a_set_node_limit_caps_measured_use() -> None:
    req = Request("base", 256, 1, memory_overcommit=0.0)
    # Plenty available on the host, but NODE_MEMORY_MIB=500 with 390 MiB used leaves 110 < 130.
    node = NodeLoad(_measured("a", available=20000, sandboxes=390, limit=500), 512, 2)
    assert not fits(node, req)
    assert fits(NodeLoad(_measured("a", available=20000, sandboxes=260, limit=500), 512, 2), req)


def test_a_set_overcommit_ratio_still_caps_nominal_ram_on_measuring_nodes() -> None:
    node = NodeLoad(_measured("a", available=20000, mem=1024), 1024, 0)
    assert fits(node, Request("base", 256, 1, memory_overcommit=0.0))
    assert not fits(node, Request("base", 256, 1, memory_overcommit=1.0))
    assert fits(node, Request("base", 256, 1, memory_overcommit=1.25))


def test_expected_cost() -> None:
    measured_node = NodeLoad(_measured("a", available=5000, cost=140), 0, 0)
    fresh_node = NodeLoad(_measured("a", available=5000, cost=None), 0, 0)
    assert expected_cost(measured_node, Request("base", 256, 1)) == 140
    # Never above the sandbox's RAM plus QEMU, also the figure before anything was measured.
    assert expected_cost(measured_node, Request("base", 64, 1)) == 64 + FALLBACK_OVERHEAD_MIB
    assert expected_cost(fresh_node, Request("base", 256, 1)) == 256 + FALLBACK_OVERHEAD_MIB
    # The setting wins.
    assert expected_cost(measured_node, Request("base", 256, 1, memory_estimate_mib=200)) == 200


def test_measured_score_prefers_real_room_over_room_made_by_releases() -> None:
    req = Request("base", 256, 1, memory_overcommit=0.0)
    releasing = NodeLoad(_measured("releasing", available=1100, reclaimable=4000), 0, 0)
    roomy = NodeLoad(_measured("roomy", available=5000), 0, 0)
    for seed in range(20):
        assert choose_node([releasing, roomy], req, k=2, rng=random.Random(seed)).node_id == "roomy"


_measured_node = st.builds(
    lambda i, mem, cpus, used_mem, used_cpu, avail, sbx, recl, cost, limit, headroom, inflight: NodeLoad(
        _measured(f"m{i}", available=avail, sandboxes=sbx, reclaimable=recl, cost=cost, limit=limit,
                  headroom=headroom, mem=mem, cpus=cpus), used_mem, used_cpu, inflight=inflight),
    st.integers(0, 10**6), st.integers(256, 8192), st.integers(1, 16), st.integers(0, 10000), st.integers(0, 20),
    st.integers(0, 30000), st.integers(0, 30000), st.integers(0, 5000), st.one_of(st.none(), st.integers(1, 400)),
    st.one_of(st.none(), st.integers(0, 20000)), st.integers(0, 2048), st.integers(0, 10))


@settings(max_examples=300, deadline=None)
@given(nodes=st.lists(st.one_of(_node, _measured_node), min_size=1, max_size=8, unique_by=lambda n: n.node_id),
       mem=st.integers(64, 4096), cpus=st.integers(1, 8), wake=st.booleans(),
       mem_ratio=st.sampled_from([0.0, 1.0, 1.5, 2.0]), cpu_ratio=st.sampled_from([1.0, 4.0]),
       estimate=st.sampled_from([0, 100, 300]), k=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_property_measured_admission_never_eats_the_headroom(
        nodes: list[NodeLoad], mem: int, cpus: int, wake: bool, mem_ratio: float, cpu_ratio: float, estimate: int,
        k: int, seed: int) -> None:
    """Whatever mix of measuring and older nodes: a chosen measuring node keeps its headroom (and its limit)
    after the sandboxes in flight and this one at their expected cost, counting what it can release; every
    chosen node keeps the nominal bound that applies to it (the ratio when set; 1.0 on a node that does not
    measure); NoCapacity only when no node fits."""
    req = Request("base", mem, cpus, wake=wake, memory_overcommit=mem_ratio, vcpu_overcommit=cpu_ratio,
                  memory_estimate_mib=estimate)
    try:
        hb = choose_node(nodes, req, k=k, rng=random.Random(seed))
    except NoCapacity:
        assert not any(fits(n, req) for n in nodes)
        return
    n = next(n for n in nodes if n.node_id == hb.node_id)
    if measured(n):
        need = (n.inflight + 1) * expected_cost(n, req)
        assert hb.memory_available_mib is not None and hb.memory_sandboxes_mib is not None
        assert hb.memory_available_mib + hb.memory_reclaimable_mib - need >= hb.memory_headroom_mib
        if hb.memory_limit_mib is not None:
            assert hb.memory_sandboxes_mib + need - hb.memory_reclaimable_mib <= hb.memory_limit_mib
        assert room_mib(n) >= need
    ratio = mem_ratio if mem_ratio > 0 else (None if measured(n) else 1.0)
    if ratio is not None:
        assert n.memory_used_mib + mem <= hb.memory_mib * ratio
    assert n.vcpus_used + cpus <= hb.vcpus * cpu_ratio


def test_a_node_under_cpu_pressure_is_passed_by() -> None:
    """Admission knows CPU too: a node whose heartbeat says its CPUs are saturated gets nothing while another
    fits, even when it is the better candidate otherwise (more room, a warm slot)."""
    busy = NodeLoad(_hb("busy", mem=65536, cpu_pressure=97.0, cpu_saturated=True), 0, 0, warm_ready=3)
    calm = NodeLoad(_hb("calm", mem=2048, cpu_pressure=12.0), 0, 0)
    for seed in range(20):
        assert choose_node([busy, calm], template="base", memory_mib=256, vcpus=1,
                           rng=random.Random(seed)).node_id == "calm"


def test_only_saturated_nodes_is_no_capacity_with_the_reason() -> None:
    nodes = [NodeLoad(_hb("a", cpu_pressure=97.0, cpu_saturated=True), 0, 0),
             NodeLoad(_hb("b", cpu_pressure=93.5, cpu_saturated=True), 0, 0)]
    # The scheduler fails the placement with code no_capacity and this message (services/scheduler/main.py).
    with pytest.raises(NoCapacity, match=r"under CPU pressure \(the least at 94%") as refused:
        choose_node(nodes, template="base", memory_mib=256, vcpus=1)
    # The refusal names the setting an operator changes (a fresh user met it on a busy host with no hint).
    assert "PODBAY_NODE_CPU_PRESSURE_MAX" in str(refused.value)
    # Pressure alone, below the node's own threshold, is no reason to refuse.
    assert choose_node([NodeLoad(_hb("c", cpu_pressure=70.0), 0, 0)], template="base", memory_mib=256,
                       vcpus=1).node_id == "c"
