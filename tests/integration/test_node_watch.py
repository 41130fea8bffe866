"""``podbay.nodewatch.NodeWatch`` and ``Bus.live_nodes`` against a real JetStream KV bucket: lookups come from
one watcher's cache (no consumer per lookup), a key whose TTL ran out or that was deleted drops out, and a
put made after the watcher started shows up."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

from nats.js.api import KeyValueConfig

from podbay.bus import connect_bus
from podbay.contracts import subjects
from podbay.contracts.messages import NodeHeartbeat
from podbay.nodewatch import NodeWatch


def _hb(node_id: str) -> bytes:
    return NodeHeartbeat(node_id=node_id, dataplane_url="http://127.0.0.1:1", memory_mib=1024, memory_used_mib=0,
                         vcpus=2, vcpus_used=0, sandboxes=0, templates=["base"], accel="tcg",
                         at=datetime.now(UTC)).model_dump_json().encode()


async def _until(pred, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_a_key_whose_ttl_runs_out_drops_out_and_a_kept_one_stays(nats_url: str) -> None:
    bus = await connect_bus(nats_url, name="node-watch-ttl")
    bucket = f"nodewatch_{os.urandom(3).hex()}"
    kv = await bus.js.create_key_value(KeyValueConfig(bucket=bucket, ttl=2.0, history=1))

    async def get_kv():  # type: ignore[no-untyped-def]
        return kv

    watch = NodeWatch(bus.nc, get_kv, ttl_s=2.0)
    try:
        await kv.put("early", _hb("early"))  # before the watcher: comes with the initial load
        assert [n.node_id for n in await watch.live()] == ["early"]
        await kv.put("kept", _hb("kept"))  # after it: arrives as an update
        await _until(lambda: _ids(watch, {"early", "kept"}))
        # "kept" keeps heartbeating, "early" goes silent: once its TTL runs out it is gone (from the bucket
        # too, with no message to the watcher), while "kept" stays.
        for _ in range(8):
            await kv.put("kept", _hb("kept"))
            await asyncio.sleep(0.5)
        assert [n.node_id for n in await watch.live()] == ["kept"]
        assert watch.watchers_opened == 1
    finally:
        await watch.close()
        await bus.js.delete_key_value(bucket)
        await bus.close()


async def _ids(watch: NodeWatch, want: set[str]) -> bool:
    return {n.node_id for n in await watch.live()} == want


async def test_lookups_open_no_consumer_and_see_puts_and_deletes(nats_url: str) -> None:
    tag = os.urandom(3).hex()
    bus = await connect_bus(nats_url, name="node-watch-bus", heartbeat_ttl_s=60)
    kv = await bus.nodes_kv()
    stream = f"KV_{subjects.NODES_KV}"
    try:
        await bus.live_nodes()  # starts the one watcher
        consumers = (await bus.js.stream_info(stream)).state.consumer_count
        a, b = f"a-{tag}", f"b-{tag}"
        await kv.put(a, _hb(a))
        await kv.put(b, _hb(b))
        await _until(lambda: _has(bus, {a, b}))
        for _ in range(200):  # a burst of lookups, as a burst of placements makes
            await bus.live_nodes()
        assert (await bus.js.stream_info(stream)).state.consumer_count == consumers
        await kv.delete(b)
        await _until(lambda: _lacks(bus, b))
        assert a in {n.node_id for n in await bus.live_nodes()}
    finally:
        for key in (f"a-{tag}", f"b-{tag}"):
            await kv.delete(key)
        await bus.close()


async def _has(bus, want: set[str]) -> bool:  # type: ignore[no-untyped-def]
    return want <= {n.node_id for n in await bus.live_nodes()}


async def _lacks(bus, key: str) -> bool:  # type: ignore[no-untyped-def]
    return key not in {n.node_id for n in await bus.live_nodes()}


async def test_the_watcher_is_rebuilt_after_the_server_restarts(test_root) -> None:  # type: ignore[no-untyped-def]
    from podbay.devstack.procs import free_port
    from podbay.devstack.servers import start_nats

    port = free_port()
    store = test_root / f"nats-watch-{os.urandom(2).hex()}"
    server = start_nats(store, port, log_dir=test_root / "logs")
    bus = await connect_bus(server.url, name="node-watch-restart", heartbeat_ttl_s=60)
    try:
        kv = await bus.nodes_kv()
        await kv.put("before", _hb("before"))
        await _until(lambda: _has(bus, {"before"}))
        server.stop()
        server = start_nats(store, port, log_dir=test_root / "logs")  # same store: the bucket survives
        await _until(lambda: _connected(bus), timeout_s=30)
        # The old watcher's consumer died with the server; a put now must still reach lookups.
        await _until(lambda: _put(kv, "after"), timeout_s=30)  # JetStream may need a moment after the restart
        await _until(lambda: _has(bus, {"before", "after"}), timeout_s=30)
    finally:
        await bus.close()
        server.stop()


async def _put(kv, key: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        await kv.put(key, _hb(key))
    except Exception:  # noqa: BLE001 - not ready yet: try again
        return False
    return True


async def _connected(bus) -> bool:  # type: ignore[no-untyped-def]
    return bool(bus.nc.is_connected)
