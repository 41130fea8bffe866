"""The node agent's parts, built in start-up order, each handed everything it needs when it is made.

The rooms (each a sub-package; lower ones never import the agent's wiring):

- ``vm/``: QEMU and QMP, the accelerator, confinement, the driver over the store's templates, pause/resume,
  live migration;
- ``storage/``: the btrfs store, snapshots, diffs, disk growth, volumes;
- ``net/``: taps and leases, the nftables ruleset, tap repair, guest ports;
- ``ops/``: the VM registry and the ``SandboxManager`` on it, create/delete/suspend, and the node's loops
  (leases, reconciliation, heartbeats, fencing, warm slots, memory, snapshot cadence);
- ``dataplane/``, ``computer/``, ``envd/``: the HTTP app the API calls and what it serves;
- ``build/``: base images, template snapshots, template builds.

:func:`build` makes, in the order main.py's docstring gives: the store (prepared, stale diff mounts
removed), the sandbox network (its ruleset in place), PostgreSQL (migrated), NATS, the outbox relay, the VM
driver (accelerator resolved), the object store, the node's templates (imported from the build cache and found
in the store), then the :class:`~podbay_nodeagent.ops.sandboxes.SandboxManager` with the object store and the
templates as constructor arguments (it builds its operations, suspend, migrations and the template builder on
itself), and the warm pool with the memory watch it makes. No part is given a collaborator after it is made.
Starting them (registration, reconciliation, loops) and stopping them is main.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import asyncpg

from podbay import db
from podbay.bus import Bus, connect_bus
from podbay.config import Settings
from podbay.objstore import ObjectStore, open_store
from podbay.outbox import Relay

from .net.network import SandboxNetwork
from .ops.memory import MemoryWatch
from .ops.sandboxes import SandboxManager
from .ops.warm import WarmPool
from .storage.diff import cleanup_stale_mounts
from .storage.store import NodeStore
from .vm.vmdriver import VmDriver

__all__ = ["NodeParts", "build"]

log = logging.getLogger("podbay.nodeagent")


@dataclass
class NodeParts:
    """What :func:`build` made. ``objects_cm`` is the object store's open context (main.py exits it last but
    two, before the bus and the pool close); ``dataplane_url`` is the URL the node registers for its data plane."""

    settings: Settings
    store: NodeStore
    net: SandboxNetwork
    pool: asyncpg.Pool
    bus: Bus
    relay: Relay
    driver: VmDriver
    objects: ObjectStore
    objects_cm: contextlib.AbstractAsyncContextManager[ObjectStore]
    manager: SandboxManager
    warm: WarmPool
    memwatch: MemoryWatch
    dataplane_url: str


async def build(settings: Settings) -> NodeParts:
    """Make the node's parts (module docstring). Raises what each step raises: a store that cannot be
    prepared, a network whose ruleset cannot be installed (no guest runs without it), an unreachable
    PostgreSQL, NATS or object store, an unusable VMM."""
    store = NodeStore(settings.data_dir, settings.node_id, settings.node_store_size_gib)
    await asyncio.to_thread(store.prepare)
    # Read-only mounts a crashed agent left behind while diffing snapshots.
    await asyncio.to_thread(cleanup_stale_mounts, store.root / "tmp")
    log.info("node store at %s%s", store.root, " (loop-backed btrfs file)" if store.loop_backed else "")
    net = SandboxNetwork(settings)
    await asyncio.to_thread(net.start)  # raises: no guest runs on a node without its ruleset
    log.info("sandbox network %s: taps %s*, traffic to the gateway on :%d (DNS :%d)", net.cidr,
             net.tap_prefix, settings.gateway_proxy_port, settings.gateway_dns_port)
    pool = await db.connect_pool(settings.pg_dsn, min_size=2, max_size=10)
    await db.migrate(pool)
    bus = await connect_bus(settings.nats_url, name=f"podbay-nodeagent-{settings.node_id}",
                            heartbeat_ttl_s=settings.node_heartbeat_ttl_s)
    relay = Relay(pool, bus)
    driver = await VmDriver.create(settings, store)
    objects_cm = open_store(settings)
    objects = await objects_cm.__aenter__()
    templates = await driver.import_templates(pool)
    templates.update(await driver.load_built_templates(pool))
    if not templates:
        log.warning("no template is built: run `podbay template build base`")
    manager = SandboxManager(settings, pool, bus, relay, store, driver, net, objects=objects, templates=templates)
    warm = WarmPool(manager, memory=lambda pool_: MemoryWatch(manager, pool_))
    assert warm.memory is not None  # made just above
    return NodeParts(settings=settings, store=store, net=net, pool=pool, bus=bus, relay=relay, driver=driver,
                     objects=objects, objects_cm=objects_cm, manager=manager, warm=warm, memwatch=warm.memory,
                     dataplane_url=f"http://{settings.node_host}:{settings.node_port}")
