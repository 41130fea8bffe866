"""``podbay-nodeagent``: one per host; runs the sandboxes' VMs (docs/DESIGN.md §1).

    podbay-nodeagent [serve]                      run the agent
    podbay-nodeagent template build NAME [--force]  build NAME's images, boot once, save its snapshot

Start-up order: storage (btrfs) -> sandbox network (the nftables table, before any VM: fail closed; leases)
-> PostgreSQL (migrations) -> NATS -> VMM (accelerator) -> templates
(imported from the build cache into the store and registered; built ones found in the store) -> node row ->
template builder (half-written layers removed, interrupted builds failed) -> reconcile with PostgreSQL ->
data plane and heartbeats -> commands from ``podbay.cmd.node.<node>.>``. On SIGTERM it stops taking
commands, finishes the ones in flight, disconnects from guests and leaves their VMs running, so the next
start re-attaches to them.
"""

from __future__ import annotations

import asyncio
import logging
import sys


from podbay import db
from podbay.bus import connect_bus, consume
from podbay.config import ConfigError, get_settings
from podbay.contracts import subjects
from podbay.contracts.messages import (
    CreateSandboxCmd,
    DeleteSandboxCmd,
    ForkCmd,
    MigrateOutCmd,
    RestoreCmd,
    SandboxOpCmd,
    SnapshotCmd,
    WakeCmd,
)
from podbay.grants import GrantKeyError, GrantVerifier
from podbay.logs import bind_from_message
from podbay.objstore import open_store
from podbay.outbox import Relay
from podbay.service import run_service, serve_http

from .build.builder import TemplateBuilder
from .cadence import cadence_loop
from .dataplane import create_dataplane_app
from .fence import fence_loop, rejoin
from .diff import cleanup_stale_mounts
from .heartbeat import heartbeat_loop, register_node
from .lease import lease_loop
from .memory import MemoryWatch
from .migrate import MigrationOps
from .network import SandboxNetwork
from .reconcile import reconcile
from .sandboxes import SandboxManager
from .store import NodeStore
from .suspend import SuspendOps
from .volumes import sweep_loop as volume_sweep_loop
from .tapwatch import tap_watch_loop
from .vmdriver import VmDriver
from .warm import WarmPool

__all__ = ["main"]

log = logging.getLogger("podbay.nodeagent")


async def _consume(manager: SandboxManager, stop: asyncio.Event) -> None:
    node = manager.node_id
    sub = await manager.bus.pull_subscribe(subjects.node_consumer(node), subjects.node_cmd_filter(node),
                                           ack_wait_s=manager.settings.restore_timeout_s * 2 + 30)
    manager.command_sub = sub  # for /readyz: the node's command consumer is bound
    async def one(msg: object) -> None:
        verb = msg.subject.rsplit(".", 1)[-1]  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
        data = msg.data  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
        bind_from_message(data)  # this handler's task: every log line names the sandbox and operation
        try:
            if verb == "create":
                await manager.create(CreateSandboxCmd.model_validate_json(data))
            elif verb == "delete":
                await manager.delete(DeleteSandboxCmd.model_validate_json(data))
            elif verb == "snapshot":
                await manager.snapshots.snapshot(SnapshotCmd.model_validate_json(data))
            elif verb == "restore":
                await manager.snapshots.restore(RestoreCmd.model_validate_json(data))
            elif verb == "fork":
                await manager.snapshots.fork(ForkCmd.model_validate_json(data))
            elif verb == "pause":
                await manager.pause(SandboxOpCmd.model_validate_json(data))
            elif verb == "resume":
                await manager.resume(SandboxOpCmd.model_validate_json(data))
            elif verb == "suspend":
                await manager.suspend_ops.suspend(SandboxOpCmd.model_validate_json(data))
            elif verb == "wake":
                await manager.suspend_ops.wake(WakeCmd.model_validate_json(data))
            elif verb == "migrate_out":
                await manager.migrations.migrate_out(MigrateOutCmd.model_validate_json(data))
            else:
                log.error("unknown node command %s; dropping", verb)
                await msg.term()  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
                return
        except ValueError as exc:
            log.error("malformed %s command dropped: %s", verb, exc)
            await msg.term()  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
            return
        except Exception:
            log.exception("%s command failed; it will be redelivered", verb)
            await msg.nak(delay=2.0)  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
            return
        await msg.ack()  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback

    await consume(sub, one, stop, finish_timeout_s=60)


async def _serve(stop: asyncio.Event) -> None:
    settings = get_settings()
    if not settings.internal_token:
        log.warning("PODBAY_INTERNAL_TOKEN is empty: the data plane accepts any caller that sends an empty token")
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
    manager = SandboxManager(settings, pool, bus, relay, store, driver, net)
    objstore_cm = open_store(settings)
    manager.objects = await objstore_cm.__aenter__()
    manager.suspend_ops = SuspendOps(manager, manager.objects)
    manager.templates = await driver.import_templates(pool)
    manager.templates.update(await driver.load_built_templates(pool))
    if not manager.templates:
        log.warning("no template is built: run `podbay template build base`")
    dataplane_url = f"http://{settings.node_host}:{settings.node_port}"
    await register_node(pool, settings, dataplane_url, driver.accel)
    await driver.register_node_templates(pool, settings.node_id, manager.templates)
    manager.builder = TemplateBuilder(manager)
    await manager.builder.recover()
    relay_task = asyncio.create_task(relay.run(), name="outbox-relay")
    warm = WarmPool(manager)
    await warm.reset()
    await reconcile(manager)
    await rejoin(manager)  # a node declared lost takes placements again only now, its stale VMs gone
    manager.migrations = MigrationOps(manager)
    await manager.migrations.start()  # answers migrations into this node (drain of another node)
    http = asyncio.create_task(serve_http(create_dataplane_app(manager), settings.node_host, settings.node_port, stop))
    memwatch = MemoryWatch(manager, warm)
    warm.memory = memwatch
    await memwatch.measure()  # the first heartbeat already carries measured memory
    hb = asyncio.create_task(heartbeat_loop(bus, settings, dataplane_url, driver.accel, manager.load, stop,
                                            memwatch.report))
    memory = asyncio.create_task(memwatch.run(stop), name="memory")
    consumer = asyncio.create_task(_consume(manager, stop))
    cadence = asyncio.create_task(cadence_loop(manager, stop), name="snapshot-cadence")
    leases = asyncio.create_task(lease_loop(manager, stop), name="leases")
    fencing = asyncio.create_task(fence_loop(manager, stop), name="fencing")
    taps = asyncio.create_task(tap_watch_loop(manager, stop), name="tap-watch")
    vol_sweep = asyncio.create_task(volume_sweep_loop(manager.volumes, stop), name="volume-sweep")
    await warm.start()
    refill = asyncio.create_task(warm.run(stop), name="warm-pool")
    manager.ready = True
    log.info("node agent %s ready: accel=%s, templates=%s, sandboxes=%d", settings.node_id, driver.accel,
             sorted(manager.templates), len(manager.vms))
    await stop.wait()
    manager.ready = False
    # 60 s for in-flight commands, then up to 10 s to cancel and hand back the rest (bus.consume).
    await asyncio.wait({consumer, hb, http, cadence, leases, refill, fencing, memory, taps, vol_sweep}, timeout=75)
    await warm.close()
    await manager.migrations.close()
    await manager.close()
    relay_task.cancel()
    try:
        await relay.flush()
    except Exception:
        pass
    await objstore_cm.__aexit__(None, None, None)
    await bus.close()
    await pool.close()
    net.close()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["template"]:
        from .template import template_main

        raise SystemExit(template_main(args[1:]))
    if args and args[0] not in ("serve",):
        print("usage: podbay-nodeagent [serve] | template build NAME [--force]", file=sys.stderr)
        raise SystemExit(2)
    try:
        verify_key = get_settings().grant_verify_key
    except ConfigError:
        verify_key = None  # run_service reports a bad config file in one line
    try:
        # The data plane serves only calls that carry the API's grant (grant_check.py): it needs the key.
        if verify_key is not None:
            GrantVerifier(verify_key)
    except GrantKeyError as exc:
        print(f"podbay-nodeagent: PODBAY_GRANT_VERIFY_KEY: {exc}: the node checks the API's grants with it "
              "(base64 of the raw 32-byte Ed25519 public key of PODBAY_GRANT_SIGNING_KEY)", file=sys.stderr)
        raise SystemExit(2) from exc
    raise SystemExit(run_service("nodeagent", _serve))
