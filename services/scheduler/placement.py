"""Placement policy: which live node gets a sandbox (pure logic, unit-tested).

Candidates are nodes whose heartbeat is in the KV bucket (so alive within the TTL), that are schedulable,
hold the template, and have room for the sandbox's memory and vCPUs once the sandboxes already placed on
them (counted from PostgreSQL, so placements in flight count) are subtracted. Among them: best of K random
candidates by free memory, which spreads load without every scheduler picking the same node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from podbay.contracts.messages import NodeHeartbeat

__all__ = ["NodeLoad", "choose_node", "NoCapacity", "ready_nodes"]


class NoCapacity(Exception):
    """No live node can take the sandbox; the message says why."""


@dataclass(frozen=True)
class NodeLoad:
    heartbeat: NodeHeartbeat
    memory_used_mib: int
    vcpus_used: int

    @property
    def free_memory_mib(self) -> int:
        return self.heartbeat.memory_mib - self.memory_used_mib


def ready_nodes(live: list[NodeHeartbeat], states: dict[str, str]) -> list[NodeHeartbeat]:
    """The live nodes that take placements: those whose ``nodes.state`` is ``ready`` (not ``draining``,
    ``drained`` or ``lost``; a heartbeat without a row is not placed on either)."""
    return [hb for hb in live if states.get(hb.node_id) == "ready"]


def choose_node(nodes: list[NodeLoad], *, template: str, memory_mib: int, vcpus: int, k: int = 2,
                rng: random.Random | None = None) -> NodeHeartbeat:
    """Pick a node for a sandbox; raises ``NoCapacity`` naming the reason when none fits."""
    if not nodes:
        raise NoCapacity("no node is alive")
    with_template = [n for n in nodes if n.heartbeat.schedulable and template in n.heartbeat.templates]
    if not with_template:
        raise NoCapacity(f"no live node has template {template!r}")
    fits = [n for n in with_template
            if n.free_memory_mib >= memory_mib and n.heartbeat.vcpus - n.vcpus_used >= vcpus]
    if not fits:
        raise NoCapacity(f"no node has room for {memory_mib} MiB and {vcpus} vCPUs")
    r = rng or random.Random()
    sample = r.sample(fits, min(k, len(fits)))
    return max(sample, key=lambda n: n.free_memory_mib).heartbeat
