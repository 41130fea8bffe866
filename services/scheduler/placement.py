"""Placement policy: which live node gets a sandbox (pure logic, unit-tested in tests/unit/test_placement.py).

Input: one :class:`NodeLoad` per live node (heartbeat from the ``podbay_nodes`` KV bucket, so alive within the
TTL; load counted from PostgreSQL in one query, so placements in flight count). Steps:

1. **Filter.** The node is schedulable, carries the template (or, when the template's build is promoted to
   object storage, the built-in template it was built on: the node fetches the build on first use), and has
   room (:func:`fits`):

   - memory, on a node that reports measured memory (its heartbeat's ``memory_*`` fields,
     services/nodeagent/ops/memory.py): its room (available memory less its headroom, and less its sandboxes'
     measured use under ``NODE_MEMORY_MIB`` when that is set) plus what it could release (paused and idle
     sandboxes, ``memory_reclaimable_mib``) holds the sandboxes in flight to it (placed since its measurement,
     ``NodeLoad.inflight``) and this one, each at the expected cost of a fresh sandbox
     (:func:`expected_cost`). With ``memory_overcommit > 0`` nominal guest RAM must also stay within
     ``memory_mib x memory_overcommit`` (1.0: every guest may touch all its RAM). A node that reports no
     measurement is held to the nominal rule alone, at ratio 1.0 when none is set;
   - vCPUs of its running sandboxes within ``vcpus x vcpu_overcommit``.

   A node that fails this is never chosen, whatever its score. Nor is a node whose heartbeat says its CPUs
   are saturated (``cpu_saturated``: CPU pressure above its ``node_cpu_pressure_max``, services/nodeagent/
   heartbeat.py): it would accept the sandbox and then answer nothing. When only such nodes have room, the
   refusal says so (``no_capacity``, "under CPU pressure").
2. **Sample.** K random fitting nodes (so replicas of the scheduler do not all pick the same node), plus the
   fitting nodes with an affinity (they hold the snapshot to wake from, or a ready warm slot of the template),
   so a preference is never lost to the dice.
3. **Score** each candidate (higher wins; ties go to the dice):

   - free capacity after placement: ``W_FREE x`` the mean of the free memory (measured room without releases,
     or nominal) and free vCPU fractions (0..1);
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
from podbay.contracts.states import NodeState

__all__ = ["NodeLoad", "Request", "choose_node", "score", "fits", "fits_memory", "expected_cost", "room_mib",
           "measured", "NoCapacity", "ready_nodes", "with_volumes", "W_FREE", "W_SNAPSHOT", "W_TEMPLATE", "W_WARM", "W_TENANT",
           "FALLBACK_OVERHEAD_MIB"]

#: Score weights (dimensionless). Locality and warm slots outweigh a full node's worth of free capacity
#: difference only together; one sandbox of the same tenant costs a fifth of it.
W_FREE = 1.0
W_SNAPSHOT = 0.6
W_TEMPLATE = 0.2
W_WARM = 0.5
W_TENANT = 0.2
#: Before a node has measured a running sandbox, a fresh one is expected to cost its RAM plus this, MiB (QEMU).
FALLBACK_OVERHEAD_MIB = 64


class NoCapacity(Exception):
    """No live node can take the sandbox; the message says why."""


@dataclass(frozen=True)
class NodeLoad:
    """A live node and what is committed on it (from PostgreSQL, not the heartbeat, so in-flight counts).

    ``memory_used_mib``: memory of its sandboxes (paused ones too) and warm slots, MiB. ``vcpus_used``: vCPUs
    of its non-paused sandboxes. ``tenant_sandboxes``: live sandboxes of the requesting tenant on it.
    ``warm_ready``: ready warm slots of the requested template. ``has_digest``: it holds the template at the
    sandbox's digest (``node_templates``). ``holds_snapshot``: the snapshot a wake restores was taken here.
    ``inflight``: sandboxes and warm slots placed on it that its last memory measurement did not see yet.
    """

    heartbeat: NodeHeartbeat
    memory_used_mib: int
    vcpus_used: int
    tenant_sandboxes: int = 0
    warm_ready: int = 0
    has_digest: bool = False
    holds_snapshot: bool = False
    inflight: int = 0

    @property
    def node_id(self) -> str:
        return self.heartbeat.node_id

    @property
    def free_memory_mib(self) -> int:
        """Free memory without over-commit, MiB (may be negative on an over-committed node)."""
        return self.heartbeat.memory_mib - self.memory_used_mib


def unready_reason(live: list[NodeHeartbeat], states: dict[str, str]) -> str | None:
    """Why no live node takes placements when live ones exist but none is ``ready`` (``"no live node takes new
    sandboxes: node-1 is draining"``), else None. A node left ``draining`` by a failed drain, or ``drained``,
    takes placements again after ``POST /v1/nodes/{id}/undrain``."""
    held = sorted(f"{hb.node_id} is {states.get(hb.node_id, 'unknown')}" for hb in live
                  if states.get(hb.node_id) != NodeState.READY)
    if not held or len(held) < len(live):
        return None
    return f"no live node takes new sandboxes: {', '.join(held)} (podbay node undrain NODE makes one ready again)"


def ready_nodes(live: list[NodeHeartbeat], states: dict[str, str]) -> list[NodeHeartbeat]:
    """The live nodes that take placements: those whose ``nodes.state`` is ``ready`` (not ``draining``,
    ``drained`` or ``lost``; a heartbeat without a row is not placed on either)."""
    return [hb for hb in live if states.get(hb.node_id) == NodeState.READY]


@dataclass(frozen=True)
class Request:
    """What is being placed: ``memory_mib`` (MiB) and ``vcpus`` of one sandbox of ``template``.

    ``wake``: a suspended sandbox resumes (warm slots do not apply, snapshot locality does).
    ``memory_overcommit``: ratio of a node's advertised memory that nominal guest RAM may reach (0: no nominal
    cap on nodes that measure, 1.0 on those that do not); ``vcpu_overcommit``: the same for vCPUs (>= 1.0).
    ``memory_estimate_mib``: expected host cost of a fresh sandbox, MiB (0: the node's measured median).
    ``fetch_root``: the template's build is promoted to object storage and was built on this built-in
    template (``base``), so a node holding that one may take it too (it fetches the build on first use).
    """

    template: str
    memory_mib: int
    vcpus: int
    wake: bool = False
    fetch_root: str | None = None
    memory_overcommit: float = 1.0
    vcpu_overcommit: float = 1.0
    memory_estimate_mib: int = 0


def measured(n: NodeLoad) -> bool:
    """Whether the node's heartbeat carries measured memory."""
    return n.heartbeat.measures_memory


def expected_cost(n: NodeLoad, req: Request) -> int:
    """Host memory one fresh sandbox of ``req`` is expected to cost on ``n``, MiB: the setting when given, else
    the node's measured median (never above the sandbox's RAM + ``FALLBACK_OVERHEAD_MIB``, which is also the
    figure before the node has measured one)."""
    if req.memory_estimate_mib > 0:
        return req.memory_estimate_mib
    ceiling = req.memory_mib + FALLBACK_OVERHEAD_MIB
    cost = n.heartbeat.memory_sandbox_cost_mib
    return ceiling if cost is None else min(cost, ceiling)


def room_mib(n: NodeLoad, *, with_reclaimable: bool = True) -> int:
    """A measuring node's room for new sandboxes, MiB: available less headroom (and, under its limit, the limit
    less its sandboxes' use), plus what it could release when ``with_reclaimable``. May be negative."""
    room = n.heartbeat.memory_room_mib(with_reclaimable=with_reclaimable)
    assert room is not None, "room_mib of a node that does not measure memory"
    return room


def _nominal_ratio(n: NodeLoad, req: Request) -> float | None:
    """The nominal memory ratio that applies to ``n`` (None: no nominal cap)."""
    if req.memory_overcommit > 0:
        return req.memory_overcommit
    return None if measured(n) else 1.0


def _cpu_cap(n: NodeLoad, req: Request) -> int:
    # floor: a ratio of 1.0 must allow exactly the advertised amount, never a rounding unit more.
    return math.floor(n.heartbeat.vcpus * req.vcpu_overcommit)


def fits_memory(n: NodeLoad, req: Request) -> bool:
    """The memory half of :func:`fits` (see the module docstring)."""
    if measured(n) and room_mib(n) < (n.inflight + 1) * expected_cost(n, req):
        return False
    ratio = _nominal_ratio(n, req)
    return ratio is None or n.memory_used_mib + req.memory_mib <= math.floor(n.heartbeat.memory_mib * ratio)


def fits(n: NodeLoad, req: Request) -> bool:
    """Whether ``n`` can take ``req``: memory by :func:`fits_memory`, vCPUs within capacity x their ratio."""
    return fits_memory(n, req) and n.vcpus_used + req.vcpus <= _cpu_cap(n, req)


def _free_memory(n: NodeLoad, req: Request) -> float:
    """Fraction of memory left after placing ``req`` (measured room without releases, or nominal)."""
    cap = n.heartbeat.memory_mib
    if measured(n):
        left = room_mib(n, with_reclaimable=False) - (n.inflight + 1) * expected_cost(n, req)
        return min(1.0, max(0.0, left / cap)) if cap > 0 else 0.0
    mem_cap = math.floor(cap * (_nominal_ratio(n, req) or 1.0))
    return (mem_cap - n.memory_used_mib - req.memory_mib) / mem_cap if mem_cap > 0 else 0.0


def score(n: NodeLoad, req: Request) -> float:
    """The candidate's score (higher is better); see the module docstring for the terms."""
    cpu_cap = _cpu_cap(n, req)
    free_mem = _free_memory(n, req)
    free_cpu = (cpu_cap - n.vcpus_used - req.vcpus) / cpu_cap if cpu_cap > 0 else 0.0
    s = W_FREE * (free_mem + free_cpu) / 2
    if req.wake and n.holds_snapshot:
        s += W_SNAPSHOT
    if n.has_digest:
        s += W_TEMPLATE
    if not req.wake and n.warm_ready > 0:
        s += W_WARM
    return s - W_TENANT * n.tenant_sandboxes


def with_volumes(nodes: list[NodeLoad], volume_node: str | None) -> list[NodeLoad]:
    """The nodes a sandbox may run on given where its volumes live (``volume_node``; None: it has none, or
    they have no node yet): only that node, since a volume's file is on one node's store."""
    if volume_node is None:
        return nodes
    return [n for n in nodes if n.node_id == volume_node]


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
    with_template = [n for n in nodes if n.heartbeat.schedulable and (
        req.template in n.heartbeat.templates or (req.fetch_root is not None and req.fetch_root in n.heartbeat.templates))]
    if not with_template:
        raise NoCapacity(f"no live node has template {req.template!r}")
    ok = [n for n in with_template if fits(n, req)]
    if not ok:
        raise NoCapacity(f"no node has room for {req.memory_mib} MiB and {req.vcpus} vCPUs")
    # A node whose CPUs are saturated would take the sandbox and then answer nothing: pass it by.
    calm = [n for n in ok if not n.heartbeat.cpu_saturated]
    if not calm:
        worst = min((n.heartbeat.cpu_pressure or 0.0) for n in ok)
        raise NoCapacity(f"every node with room is under CPU pressure (the least at {worst:.0f}% of the time "
                         "with tasks waiting for a CPU; an operator sets the threshold with PODBAY_NODE_CPU_PRESSURE_MAX, 0 turns "
                         "the check off)")
    ok = calm
    r = rng or random.Random()
    sample = r.sample(ok, min(max(1, k), len(ok)))
    seen = {n.node_id for n in sample}
    sample += [n for n in ok if _affine(n, req) and n.node_id not in seen]
    r.shuffle(sample)  # ties go to the dice, not to list order
    return max(sample, key=lambda n: score(n, req)).heartbeat
