"""Simulated node agents: many fake nodes in one asyncio process, answering the real protocol with no VMs.

For the fleet benchmark (``tests/bench/fleet.py``) and its small-size test
(``tests/integration/test_fleet_sim.py``): the real api, scheduler and warmpool talk to these nodes exactly as
to real ones, over the same servers.

What each simulated node does, as services/nodeagent does it:

- **Registration**: its ``nodes`` row (``ready``) and its ``node_templates`` rows (the templates it holds, at
  their digests), as ``register_node`` and ``register_node_templates`` write them.
- **Heartbeats**: a ``NodeHeartbeat`` under its id in the ``podbay_nodes`` KV bucket every
  ``heartbeat_s`` (the puts of all nodes spread over the period, as independent agents would be), with its
  nominal load (guest RAM and vCPUs of the sandboxes it runs). No measured memory: placement holds it to the
  nominal rule. Deleted from the bucket on stop, as an agent leaving does.
- **Commands** on ``podbay.cmd.node.<node>.<verb>``: ``create`` checks the row as ``CreateOps.create`` does
  (this node, this generation, still ``starting``) and applies ``Verb.STARTED`` through
  :func:`podbay.lifecycle.apply` with the operation's outcome and the ``started`` event, as the registry's
  ``bring_up`` does once its VM runs (the fake VM does nothing); ``delete`` applies ``Verb.DELETED`` as
  ``DeleteOps.delete`` does. Other verbs are acknowledged and counted, nothing else.

One difference, for scale: the nodes share a few durable consumers (each filtering on up to
:data:`NODES_PER_CONSUMER` nodes' ``podbay.cmd.node.<node>.>`` subjects) instead of one consumer each, so that
1,000 idle pull loops do not dominate what the benchmark measures. Subjects, messages, ``Nats-Msg-Id``
deduplication and acks are the real ones.

Record for invariant checks: :attr:`SimFleet.started` maps each sandbox to the (node, generation) pairs that
ran it (more than one pair: it was started twice); :attr:`SimFleet.timings` when each was placed.

A host's link cut (:meth:`SimFleet.cut_link`, the fault tests): the node stops heartbeating and its commands
wait (unacknowledged, kept alive) as if they were in flight to an unreachable host; its sandboxes keep
"running". :meth:`SimFleet.restore_link` does what the agent does when the link returns
(``services/nodeagent/ops/fence.py``): it drops every sandbox whose row moved to another node or generation (the
fence sweep), marks a ``lost`` node ``ready`` again (``rejoin``), then lets the waiting commands through, which
meet the fence of ``create`` and ``delete`` with their stale generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from podbay.contracts.events import EventType
from podbay import lifecycle
from podbay.bus import MAX_DELIVER, Bus, consume
from podbay.contracts import subjects
from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, NodeHeartbeat
from podbay.contracts.states import NodeState, OperationState
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.outbox import Relay

from .stack import SERVICES, ServiceProcess, Stack, replica_counts

__all__ = ["SimFleet", "SimNode", "Timing", "NODES_PER_CONSUMER", "CONTROL_PLANE", "start_control_plane"]

log = logging.getLogger("podbay.devstack.simnode")

#: Nodes whose command subjects one shared durable consumer filters on.
NODES_PER_CONSUMER = 250
#: The services a simulated fleet runs for real (one process each); the node services are simulated.
CONTROL_PLANE = ("api", "scheduler", "warmpool")


def start_control_plane(stack: Stack) -> None:
    """Start ``stack``'s :data:`CONTROL_PLANE` services after its servers (:meth:`Stack.start_servers`), each
    with the stack's replica count (``api``, ``api-2``, ...): the API's processes first, waited for (the first
    migrates), then the others together, each waited for. :meth:`Stack.stop` stops them. Raises
    ``StackError``."""
    counts = replica_counts(stack.base_env, stack.replicas)
    groups: list[list[ServiceProcess]] = [[], []]
    for spec in SERVICES:
        if spec.name in CONTROL_PLANE:
            for i in range(1, counts.get(spec.name, 1) + 1):
                # The stack's own recipe, for a subset of its services.
                groups[0 if spec.name == "api" else 1].append(stack._service(spec, i))  # noqa: SLF001
    stack.start_groups(groups)


@dataclass(frozen=True)
class Timing:
    """When a sandbox's row was inserted (the API's create), when the scheduler's placing transaction began,
    and when its node command was stored by JetStream (all wall clock, one host)."""

    created_at: datetime
    placed_tx_at: datetime
    command_at: datetime

    @property
    def placement_ms(self) -> float:
        """The scheduler's placement: its transaction (lock, load, update, commit) and the node command's
        publish, ms."""
        return (self.command_at - self.placed_tx_at).total_seconds() * 1000

    @property
    def to_node_ms(self) -> float:
        """From the API's insert to the node command being stored (queueing included), ms."""
        return (self.command_at - self.created_at).total_seconds() * 1000


@dataclass
class SimNode:
    """One simulated node: capacity it advertises (MiB, vCPUs) and the sandboxes it runs (id -> (MiB, vCPUs))."""

    node_id: str
    memory_mib: int
    vcpus: int
    running: dict[str, tuple[int, int]] = field(default_factory=dict)

    def heartbeat(self, templates: list[str]) -> NodeHeartbeat:
        """Its heartbeat now (nominal load only)."""
        return NodeHeartbeat(
            node_id=self.node_id, dataplane_url="http://127.0.0.1:9", memory_mib=self.memory_mib,
            memory_used_mib=sum(m for m, _ in self.running.values()),
            vcpus=self.vcpus, vcpus_used=sum(c for _, c in self.running.values()), sandboxes=len(self.running),
            templates=templates, accel="sim", at=datetime.now(UTC))


def _stored_at(msg: Any) -> datetime:
    """When JetStream stored ``msg`` (its metadata), or now when the message carries none."""
    try:
        return msg.metadata.timestamp  # type: ignore[no-any-return]
    except (ValueError, AttributeError):  # nats-py parses the metadata from the reply subject
        return datetime.now(UTC)


class SimFleet:
    """``node_ids`` simulated nodes holding ``templates`` (name -> digest), each advertising ``memory_mib`` MiB
    and ``vcpus`` vCPUs, on the given PostgreSQL pool and bus. :meth:`start` registers them and runs their
    heartbeats and command consumers until :meth:`stop`.

    Counters: ``commands`` (by verb), ``started`` (sandbox -> [(node, generation)]), ``refused`` (commands a
    fence turned away: stale generation, another node, no longer ``starting``).
    """

    def __init__(self, pool: asyncpg.Pool, bus: Bus, node_ids: Iterable[str], *, templates: dict[str, str],
                 memory_mib: int = 1 << 20, vcpus: int = 1 << 14, heartbeat_s: float = 2.0,
                 consumer_prefix: str = "simfleet") -> None:
        self.pool = pool
        self.bus = bus
        self.nodes = {n: SimNode(n, memory_mib, vcpus) for n in node_ids}
        self.templates = dict(templates)
        self.heartbeat_s = heartbeat_s
        self.consumer_prefix = consumer_prefix
        self.relay = Relay(pool, bus)
        self.commands: dict[str, int] = defaultdict(int)
        self.started: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self.refused = 0
        #: Sandboxes a restored node dropped because they had moved on (:meth:`restore_link`).
        self.fenced: list[str] = []
        self.timings: dict[str, Timing] = {}
        self._links: dict[str, asyncio.Event] = {}  # node -> set while its link is up; absent: up
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._consumers: list[str] = []

    # --- start / stop -------------------------------------------------------------------------------------

    async def register(self) -> None:
        """Upsert every node's row (``ready``) and its ``node_templates`` rows, in two statements each."""
        ids = list(self.nodes)
        any_node = next(iter(self.nodes.values()))
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state, started_at, seen_at)"
                " SELECT id, 'http://127.0.0.1:9', $2, $3, 'sim', $4, now(), now() FROM unnest($1::text[]) id"
                " ON CONFLICT (id) DO UPDATE SET memory_mib=$2, vcpus=$3, started_at=now(), seen_at=now()",
                ids, any_node.memory_mib, any_node.vcpus, NodeState.READY)
            await conn.execute("DELETE FROM node_templates WHERE node_id = ANY($1::text[])", ids)
            for name, digest in self.templates.items():
                await conn.execute("INSERT INTO node_templates (node_id, template, digest)"
                                   " SELECT id, $2, $3 FROM unnest($1::text[]) id", ids, name, digest)

    async def start(self) -> None:
        """Register, put a first heartbeat of every node, then run the heartbeats and the consumers."""
        await self.register()
        kv = await self.bus.nodes_kv()
        names = sorted(self.templates)
        await asyncio.gather(*(kv.put(n.node_id, n.heartbeat(names).model_dump_json().encode())
                               for n in self.nodes.values()))
        self._tasks.append(asyncio.create_task(self.relay.run(), name="simfleet-relay"))
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="simfleet-heartbeats"))
        ids = list(self.nodes)
        for i in range(0, len(ids), NODES_PER_CONSUMER):
            group = ids[i:i + NODES_PER_CONSUMER]
            durable = f"{self.consumer_prefix}-{i // NODES_PER_CONSUMER}"
            self._consumers.append(durable)
            cfg = ConsumerConfig(durable_name=durable, filter_subjects=[subjects.node_cmd_filter(n) for n in group],
                                 ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30.0,
                                 max_deliver=MAX_DELIVER, max_ack_pending=1024)
            await self.bus.js.add_consumer(subjects.CMD_STREAM, cfg)
            sub = await self.bus.js.pull_subscribe_bind(durable=durable, stream=subjects.CMD_STREAM)
            self._tasks.append(asyncio.create_task(consume(sub, self._one, self._stop, finish_timeout_s=5),
                                                   name=f"simfleet-consume-{durable}"))

    async def stop(self) -> None:
        """Stop consuming and heartbeating, delete the heartbeats and the consumers, flush the outbox."""
        self._stop.set()
        relay, rest = self._tasks[:1], self._tasks[1:]
        await asyncio.wait(rest, timeout=15) if rest else None
        for t in relay:
            t.cancel()
        try:
            await self.relay.flush()
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.warning("simulated fleet: outbox flush failed: %s", exc)
        kv = await self.bus.nodes_kv()
        for n in self.nodes:
            try:
                await kv.delete(n)
            except Exception:  # noqa: BLE001 - the TTL removes it anyway
                pass
        for durable in self._consumers:
            try:
                await self.bus.js.delete_consumer(subjects.CMD_STREAM, durable)
            except Exception:  # noqa: BLE001 - gone with the server anyway
                pass

    # --- heartbeats ---------------------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        """Every ``heartbeat_s``, each node's put, spread evenly over the period."""
        kv = await self.bus.nodes_kv()
        names = sorted(self.templates)
        nodes = list(self.nodes.values())
        gap = self.heartbeat_s / max(1, len(nodes))
        while not self._stop.is_set():
            t0 = time.monotonic()
            for i, n in enumerate(nodes):
                if self._stop.is_set():
                    return
                if not self.link_up(n.node_id):
                    continue
                try:
                    await kv.put(n.node_id, n.heartbeat(names).model_dump_json().encode())
                except Exception as exc:  # noqa: BLE001 - a real agent logs and tries again next period
                    log.warning("simulated heartbeat of %s failed: %s", n.node_id, exc)
                delay = t0 + (i + 1) * gap - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

    # --- a host's link ------------------------------------------------------------------------------------

    def link_up(self, node_id: str) -> bool:
        """Whether ``node_id``'s link is up (not cut by :meth:`cut_link`)."""
        ev = self._links.get(node_id)
        return ev is None or ev.is_set()

    def cut_link(self, node_id: str) -> None:
        """Cut ``node_id`` off: no heartbeats, its commands wait until :meth:`restore_link`. ``KeyError``: no
        such node."""
        if node_id not in self.nodes:
            raise KeyError(node_id)
        self._links[node_id] = asyncio.Event()

    async def restore_link(self, node_id: str) -> list[str]:
        """Bring ``node_id`` back as its agent would: fence sweep, rejoin, then its waiting commands. Returns
        the sandboxes it dropped (their rows name another node, none, or a higher generation)."""
        node = self.nodes[node_id]
        held = {sid: max((g for n, g in self.started.get(sid, []) if n == node_id), default=0)
                for sid in node.running}
        rows = {r["id"]: r for r in await self.pool.fetch(
            "SELECT id, node_id, generation FROM sandboxes WHERE id = ANY($1::text[])", list(held))}
        dropped = []
        for sid, gen in held.items():
            r = rows.get(sid)
            # The rule of services/nodeagent/ops/fence.py (stale): the row is gone, elsewhere, or newer.
            if r is None or r["node_id"] != node_id or r["generation"] > gen:
                node.running.pop(sid, None)
                dropped.append(sid)
        self.fenced += dropped
        await self.pool.execute("UPDATE nodes SET state=$2, lost_at=NULL, state_changed_at=now()"
                                " WHERE id=$1 AND state=$3", node_id, NodeState.READY, NodeState.LOST)
        kv = await self.bus.nodes_kv()
        await kv.put(node_id, node.heartbeat(sorted(self.templates)).model_dump_json().encode())
        ev = self._links.pop(node_id, None)
        if ev is not None:
            ev.set()
        return dropped

    async def _wait_link(self, node_id: str, msg: Any) -> None:
        """Hold ``msg`` while ``node_id``'s link is cut, telling JetStream it is still being worked on (so it is
        not redelivered meanwhile, as a command in flight to an unreachable host is not)."""
        while (ev := self._links.get(node_id)) is not None and not ev.is_set():
            try:
                await asyncio.wait_for(ev.wait(), timeout=5.0)
            except TimeoutError:
                await msg.in_progress()

    # --- commands -----------------------------------------------------------------------------------------

    async def _one(self, msg: Any) -> None:
        # podbay.cmd.node.<node>.<verb>
        parts = msg.subject.split(".")
        node_id, verb = parts[3], parts[-1]
        if not self.link_up(node_id):
            await self._wait_link(node_id, msg)
        self.commands[verb] += 1
        node = self.nodes.get(node_id)
        try:
            if node is not None and verb == "create":
                await self._create(node, CreateSandboxCmd.model_validate_json(msg.data), _stored_at(msg))
            elif node is not None and verb == "delete":
                await self._delete(node, DeleteSandboxCmd.model_validate_json(msg.data))
        except ValueError as exc:
            log.error("simulated node: malformed %s command dropped: %s", verb, exc)
            await msg.term()
            return
        except Exception:
            log.exception("simulated node: %s failed; it will be redelivered", verb)
            await msg.nak(delay=1.0)
            return
        await msg.ack()

    async def _create(self, node: SimNode, cmd: CreateSandboxCmd, stored_at: datetime) -> None:
        """``CreateOps.create`` with a VM that starts at once: fenced by node, generation and ``starting``.
        ``stored_at``: when JetStream stored the command (the scheduler's publish, after its commit)."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow("SELECT state, generation, node_id, created_at, updated_at FROM sandboxes"
                                      " WHERE id = $1", cmd.sandbox_id)
            if row is None or row["node_id"] != node.node_id or row["generation"] != cmd.generation \
                    or row["state"] != "starting":
                self.refused += 1
                return
            updated = await lifecycle.apply(
                conn, cmd.sandbox_id, Verb.STARTED, states="starting", generation=cmd.generation,
                node=node.node_id, values={"failure_reason": None},
                operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED),
                event=SandboxEvent(EventType.STARTED, node_id=node.node_id, tenant_id=cmd.tenant_id,
                                   generation=cmd.generation, data={"ms": 0.0, "simulated": True}))
        if updated is None:
            self.refused += 1
            return
        self.relay.kick()
        node.running[cmd.sandbox_id] = (cmd.resources.memory_mib, cmd.resources.vcpus)
        self.started[cmd.sandbox_id].append((node.node_id, cmd.generation))
        # updated_at is the placing transaction's start (now() of the scheduler's PLACE update).
        self.timings.setdefault(cmd.sandbox_id, Timing(row["created_at"], row["updated_at"], stored_at))

    async def _delete(self, node: SimNode, cmd: DeleteSandboxCmd) -> None:
        """``DeleteOps.delete`` without a VM to stop."""
        row = await self.pool.fetchrow("SELECT state, node_id, tenant_id, generation FROM sandboxes WHERE id = $1",
                                       cmd.sandbox_id)
        if row is None or row["state"] == "deleted" or row["node_id"] != node.node_id:
            return
        async with self.pool.acquire() as conn, conn.transaction():
            await lifecycle.apply(
                conn, cmd.sandbox_id, Verb.DELETED, states=lifecycle.sources(Verb.DELETED),
                operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED, always=True),
                event=SandboxEvent(EventType.DELETED, node_id=node.node_id, tenant_id=row["tenant_id"],
                                   generation=row["generation"]))
        self.relay.kick()
        node.running.pop(cmd.sandbox_id, None)
