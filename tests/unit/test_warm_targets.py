"""Warm-pool sizing: bounds applied to demand, spread over nodes within their memory."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from podbay_warmpool.targets import NodeRoom, PoolBounds, pool_size, spread


def test_pool_size_follows_demand_within_bounds() -> None:
    b = PoolBounds("base", 2, 20)
    assert pool_size(b, 0, window_s=60, horizon_s=10) == 2  # no demand: the floor
    assert pool_size(b, 30, window_s=60, horizon_s=10) == 5  # 0.5 creates/s for 10 s
    assert pool_size(b, 31, window_s=60, horizon_s=10) == 6  # rounded up
    assert pool_size(b, 10_000, window_s=60, horizon_s=10) == 20  # the ceiling
    assert pool_size(PoolBounds("base", 5, 5), 10_000, window_s=60, horizon_s=10) == 5
    assert pool_size(PoolBounds("base", 0, 0), 100, window_s=60, horizon_s=10) == 0


def test_spread_is_even_and_respects_memory() -> None:
    assert spread(5, [NodeRoom("a", 10), NodeRoom("b", 10)]) == {"a": 3, "b": 2}
    assert spread(5, [NodeRoom("a", 1), NodeRoom("b", 10)]) == {"a": 1, "b": 4}
    # Slots a node already keeps hold their memory already: they count as room.
    assert spread(4, [NodeRoom("a", 0), NodeRoom("b", 0)], {"a": 2, "b": 1}) == {"a": 2, "b": 1}
    assert spread(3, []) == {}
    assert spread(0, [NodeRoom("a", 5)]) == {"a": 0}


@given(st.integers(0, 200), st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10)), max_size=6))
def test_spread_never_exceeds_room_or_total(total: int, spec: list[tuple[int, int]]) -> None:
    nodes = [NodeRoom(f"n{i}", free) for i, (free, _) in enumerate(spec)]
    current = {f"n{i}": cur for i, (_, cur) in enumerate(spec)}
    out = spread(total, nodes, current)
    assert set(out) == {n.node_id for n in nodes}
    assert all(out[n.node_id] <= n.free_slots + current[n.node_id] for n in nodes)
    room = sum(n.free_slots + current[n.node_id] for n in nodes)
    assert sum(out.values()) == min(total, room)
    # Even: two nodes that both have room left never differ by more than one.
    open_nodes = [n.node_id for n in nodes if out[n.node_id] < n.free_slots + current[n.node_id]]
    if open_nodes:
        assert max(out.values(), default=0) - min(out[x] for x in open_nodes) <= 1
