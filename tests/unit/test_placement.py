"""Placement policy (services/scheduler/placement.py): pure logic with fake heartbeats."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from podbay.contracts.messages import NodeHeartbeat
from podbay_scheduler.placement import NoCapacity, NodeLoad, choose_node


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


def test_only_live_nodes_in_state_ready_take_placements() -> None:
    from podbay_scheduler.placement import ready_nodes

    live = [_hb("a"), _hb("b"), _hb("c"), _hb("d"), _hb("e")]
    states = {"a": "ready", "b": "draining", "c": "drained", "d": "lost"}  # e: a heartbeat without a row
    assert [hb.node_id for hb in ready_nodes(live, states)] == ["a"]
    # A ready row without a heartbeat is not live, so not a candidate either.
    assert ready_nodes([], {"a": "ready"}) == []
