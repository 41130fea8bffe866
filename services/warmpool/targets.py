"""How many warm slots each node should keep: the operator's bounds applied to recent demand.

Pure functions, unit-tested in tests/unit/test_warm_targets.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PoolBounds", "NodeRoom", "pool_size", "spread"]


@dataclass(frozen=True)
class PoolBounds:
    """A ``warm_pools`` row: keep at least ``min_size`` slots, at most ``max_size``."""

    template: str
    min_size: int
    max_size: int


@dataclass(frozen=True)
class NodeRoom:
    """A live node that carries the template, and how many more slots of it its free memory holds."""

    node_id: str
    free_slots: int


def pool_size(bounds: PoolBounds, creates: int, *, window_s: float, horizon_s: float) -> int:
    """Slots to keep over all nodes: enough for ``horizon_s`` of the create rate seen over the last
    ``window_s`` (``creates`` in that window), clamped to the bounds.

    >>> pool_size(PoolBounds("base", 2, 20), 120, window_s=60, horizon_s=5)
    10
    """
    wanted = math.ceil(creates * horizon_s / window_s) if creates > 0 else 0
    return max(bounds.min_size, min(bounds.max_size, wanted))


def spread(total: int, nodes: list[NodeRoom], current: dict[str, int] | None = None) -> dict[str, int]:
    """Share ``total`` slots among ``nodes``: as evenly as possible, the remainder to the nodes with the
    most room, and never more on a node than it already has plus what its memory holds. Returns node id ->
    target for every node (0 included); slots that fit nowhere are not placed.

    ``current``: slots each node keeps now (they already hold their memory, so they count as room).
    """
    current = current or {}
    room = {n.node_id: max(0, n.free_slots) + current.get(n.node_id, 0) for n in nodes}
    out = {n.node_id: 0 for n in nodes}
    left = total
    # Hand out one slot at a time to the node with the most room left relative to what it got, so the
    # split stays even where room allows and bends where it does not.
    while left > 0:
        open_nodes = [nid for nid in out if out[nid] < room[nid]]
        if not open_nodes:
            break
        nid = min(open_nodes, key=lambda x: (out[x], -(room[x] - out[x]), x))
        out[nid] += 1
        left -= 1
    return out
