"""``podbay-nodeagent``: one per host; runs the sandboxes' VMs (docs/DESIGN.md §1).

    podbay-nodeagent [serve]                      run the agent
    podbay-nodeagent template build NAME [--force]  build NAME's images, boot once, save its snapshot

Start-up order (wiring.py makes the parts, this module starts them): storage (btrfs) -> sandbox network (the
nftables table, before any VM: fail closed; leases) -> PostgreSQL (migrations) -> NATS -> VMM (accelerator) -> templates
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


from podbay.bus import consume
from podbay.config import ConfigError, get_settings
from podbay.contracts import subjects
from podbay.contracts.messages import NodeHandlers, UnknownNodeCommand, dispatch_node_command
from podbay.grants import GrantKeyError, GrantVerifier
from podbay.logs import bind_from_message
from podbay.service import run_service, serve_http

from .dataplane.dataplane import create_dataplane_app
from .net.tapwatch import tap_watch_loop
from .ops.cadence import cadence_loop
from .ops.fence import fence_loop, rejoin
from .ops.heartbeat import heartbeat_loop, register_node
from .ops.lease import lease_loop
from .ops.reconcile import reconcile
from .ops.sandboxes import SandboxManager
from .storage.volumes import sweep_loop as volume_sweep_loop
from .wiring import build

__all__ = ["main"]

log = logging.getLogger("podbay.nodeagent")


def command_handlers(manager: SandboxManager) -> NodeHandlers:
    """The handler of every ``podbay.cmd.node.<node>.<verb>`` (``NodeHandlers``: one per verb, typed)."""
    return {
        "create": manager.create,
        "delete": manager.delete,
        "snapshot": manager.snapshots.snapshot,
        "restore": manager.snapshots.restore,
        "fork": manager.snapshots.fork,
        "pause": manager.pause,
        "resume": manager.resume,
        "suspend": manager.suspend_ops.suspend,
        "wake": manager.suspend_ops.wake,
        "migrate_out": manager.migrations.migrate_out,
    }


async def _consume(manager: SandboxManager, stop: asyncio.Event) -> None:
    node = manager.node_id
    handlers = command_handlers(manager)
    sub = await manager.bus.pull_subscribe(subjects.node_consumer(node), subjects.node_cmd_filter(node),
                                           ack_wait_s=manager.settings.restore_timeout_s * 2 + 30)
    manager.command_sub = sub  # for /readyz: the node's command consumer is bound
    async def one(msg: object) -> None:
        verb = msg.subject.rsplit(".", 1)[-1]  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
        data = msg.data  # type: ignore[attr-defined]  # a nats-py JetStream Msg, typed object at the consumer callback
        bind_from_message(data)  # this handler's task: every log line names the sandbox and operation
        try:
            await dispatch_node_command(handlers, verb, data)
        except UnknownNodeCommand:
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
    parts = await build(settings)  # wiring.py: every part made, in start-up order, with what it needs
    net, pool, bus, relay, driver = parts.net, parts.pool, parts.bus, parts.relay, parts.driver
    manager, warm, memwatch, dataplane_url = parts.manager, parts.warm, parts.memwatch, parts.dataplane_url
    await register_node(pool, settings, dataplane_url, driver.accel)
    await driver.register_node_templates(pool, settings.node_id, manager.templates)
    await manager.builder.recover()
    relay_task = asyncio.create_task(relay.run(), name="outbox-relay")
    await warm.reset()
    await reconcile(manager)
    await rejoin(manager)  # a node declared lost takes placements again only now, its stale VMs gone
    await manager.migrations.start()  # answers migrations into this node (drain of another node)
    http = asyncio.create_task(serve_http(create_dataplane_app(manager), settings.node_host, settings.node_port, stop))
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
    await parts.objects_cm.__aexit__(None, None, None)
    await bus.close()
    await pool.close()
    net.close()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["template"]:
        from .build.template import template_main

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
