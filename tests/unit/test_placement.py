"""Placement policy (services/scheduler/placement.py): pure logic with fake heartbeats."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from podbay.contracts.messages import NodeHeartbeat
from hypothesis import given, settings
from hypothesis import strategies as st

from podbay_scheduler.placement import W_TENANT, NoCapacity, NodeLoad, Request, choose_node, fits


def _hb(node: str, *, mem: int = 4096, cpus: int = 8, templates: tuple[str, ...] = ("base",),
        schedulable: bool = True) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, dataplane_url=f"http://{node}", memory_mib=mem, memory_used_mib=0, vcpus=cpus,
                         vcpus_used=0, sandboxes=0, templates=list(templates), accel="tcg", schedulable=schedulable,
                         at=datetime.now(UTC))


def test_no_nodes_is_no_capacity() -> None:
    with pytest.raises(NoCapacity, match="no node is alive"):
        choose_node([], template="base", memory_mib=256, vcpus=1)


def test_template_must_be_on_the_node() -> None:
    with pytest.raises(NoCapacity, match="template 'other'"):
        choose_node([NodeLoad(_hb("a"), 0, 0)], template="other", memory_mib=256, vcpus=1)


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
