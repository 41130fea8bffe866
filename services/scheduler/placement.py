"""Placement policy: which live node gets a sandbox (pure logic, unit-tested in tests/unit/test_placement.py).

Input: one :class:`NodeLoad` per live node (heartbeat from the ``podbay_nodes`` KV bucket, so alive within the
TTL; load counted from PostgreSQL in one query, so placements in flight count). Steps:

1. **Filter.** The node is schedulable, carries the template, and has room: memory committed plus the
   sandbox's stays within ``memory_mib x memory_overcommit`` and vCPUs within ``vcpus x vcpu_overcommit``
   (both ratios default 1.0: never over-commit). A node that fails this is never chosen, whatever its score.
2. **Sample.** K random fitting nodes (so replicas of the scheduler do not all pick the same node), plus the
   fitting nodes with an affinity (they hold the snapshot to wake from, or a ready warm slot of the template),
   so a preference is never lost to the dice.
3. **Score** each candidate (higher wins; ties go to the dice):

   - free capacity after placement: ``W_FREE x`` the mean of the free memory and free vCPU fractions (0..1);
   - chunk locality: ``+W_SNAPSHOT`` when the node took the snapshot a wake restores (its files or chunks are
     likely still there), ``+W_TEMPLATE`` when it holds the template at the sandbox's exact digest;
   - warm slots: ``+W_WARM`` when a create's template has a ready warm slot on the node;
   - spread: ``-W_TENANT`` per sandbox of the same tenant already on the node.

Raises :class:`NoCapacity` (message says why) when no node passes the filter.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from podbay.contracts.messages import NodeHeartbeat

__all__ = ["NodeLoad", "Request", "choose_node", "score", "fits", "NoCapacity", "ready_nodes",
           "W_FREE", "W_SNAPSHOT", "W_TEMPLATE", "W_WARM", "W_TENANT"]

#: Score weights (dimensionless). Locality and warm slots outweigh a full node's worth of free capacity
#: difference only together; one sandbox of the same tenant costs a fifth of it.
W_FREE = 1.0
W_SNAPSHOT = 0.6
W_TEMPLATE = 0.2
W_WARM = 0.5
W_TENANT = 0.2


class NoCapacity(Exception):
    """No live node can take the sandbox; the message says why."""


@dataclass(frozen=True)
class NodeLoad:
    """A live node and what is committed on it (from PostgreSQL, not the heartbeat, so in-flight counts).

    ``memory_used_mib``: memory of its sandboxes (paused ones too) and warm slots, MiB. ``vcpus_used``: vCPUs
    of its non-paused sandboxes. ``tenant_sandboxes``: live sandboxes of the requesting tenant on it.
    ``warm_ready``: ready warm slots of the requested template. ``has_digest``: it holds the template at the
    sandbox's digest (``node_templates``). ``holds_snapshot``: the snapshot a wake restores was taken here.
    """

    heartbeat: NodeHeartbeat
    memory_used_mib: int
    vcpus_used: int
    tenant_sandboxes: int = 0
    warm_ready: int = 0
    has_digest: bool = False
    holds_snapshot: bool = False

    @property
    def node_id(self) -> str:
        return self.heartbeat.node_id

    @property
    def free_memory_mib(self) -> int:
        """Free memory without over-commit, MiB (may be negative on an over-committed node)."""
        return self.heartbeat.memory_mib - self.memory_used_mib


def ready_nodes(live: list[NodeHeartbeat], states: dict[str, str]) -> list[NodeHeartbeat]:
    """The live nodes that take placements: those whose ``nodes.state`` is ``ready`` (not ``draining``,
    ``drained`` or ``lost``; a heartbeat without a row is not placed on either)."""
    return [hb for hb in live if states.get(hb.node_id) == "ready"]


@dataclass(frozen=True)
class Request:
    """What is being placed: ``memory_mib`` (MiB) and ``vcpus`` of one sandbox of ``template``.

    ``wake``: a suspended sandbox resumes (warm slots do not apply, snapshot locality does).
    ``memory_overcommit`` / ``vcpu_overcommit``: ratios >= 1.0 of what a node advertises that may be committed.
    """

    template: str
    memory_mib: int
    vcpus: int
    wake: bool = False
    memory_overcommit: float = 1.0
    vcpu_overcommit: float = 1.0


def _caps(n: NodeLoad, req: Request) -> tuple[int, int]:
    # floor: a ratio of 1.0 must allow exactly the advertised amount, never a rounding MiB more.
    return (math.floor(n.heartbeat.memory_mib * req.memory_overcommit),
            math.floor(n.heartbeat.vcpus * req.vcpu_overcommit))


def fits(n: NodeLoad, req: Request) -> bool:
    """Whether ``n`` can take ``req`` without committing beyond its capacity x the over-commit ratios."""
    mem_cap, cpu_cap = _caps(n, req)
    return n.memory_used_mib + req.memory_mib <= mem_cap and n.vcpus_used + req.vcpus <= cpu_cap


def score(n: NodeLoad, req: Request) -> float:
    """The candidate's score (higher is better); see the module docstring for the terms."""
    mem_cap, cpu_cap = _caps(n, req)
    free_mem = (mem_cap - n.memory_used_mib - req.memory_mib) / mem_cap if mem_cap > 0 else 0.0
    free_cpu = (cpu_cap - n.vcpus_used - req.vcpus) / cpu_cap if cpu_cap > 0 else 0.0
    s = W_FREE * (free_mem + free_cpu) / 2
    if req.wake and n.holds_snapshot:
        s += W_SNAPSHOT
    if n.has_digest:
        s += W_TEMPLATE
    if not req.wake and n.warm_ready > 0:
        s += W_WARM
    return s - W_TENANT * n.tenant_sandboxes


def _affine(n: NodeLoad, req: Request) -> bool:
    return (req.wake and n.holds_snapshot) or (not req.wake and n.warm_ready > 0)


def choose_node(nodes: list[NodeLoad], req: Request | None = None, *, template: str = "", memory_mib: int = 0,
                vcpus: int = 0, k: int = 2, rng: random.Random | None = None) -> NodeHeartbeat:
    """Pick a node for ``req`` (best of ``k`` random fitting nodes plus the affine ones); raises
    :class:`NoCapacity` naming the reason when none fits. Without ``req``, a create of ``template`` with
    ``memory_mib`` and ``vcpus`` and no over-commit."""
    req = req or Request(template, memory_mib, vcpus)
    if not nodes:
        raise NoCapacity("no node is alive")
    with_template = [n for n in nodes if n.heartbeat.schedulable and req.template in n.heartbeat.templates]
    if not with_template:
        raise NoCapacity(f"no live node has template {req.template!r}")
    ok = [n for n in with_template if fits(n, req)]
    if not ok:
        raise NoCapacity(f"no node has room for {req.memory_mib} MiB and {req.vcpus} vCPUs")
    r = rng or random.Random()
    sample = r.sample(ok, min(max(1, k), len(ok)))
    seen = {n.node_id for n in sample}
    sample += [n for n in ok if _affine(n, req) and n.node_id not in seen]
    r.shuffle(sample)  # ties go to the dice, not to list order
    return max(sample, key=lambda n: score(n, req)).heartbeat
