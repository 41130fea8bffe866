"""``Bus.live_nodes`` against a real JetStream KV bucket: what it keeps, skips and refuses to hide."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import pytest

from podbay.bus import connect_bus
from podbay.contracts.messages import NodeHeartbeat


async def test_live_nodes_keeps_heartbeats_skips_garbage_and_deleted_keys(nats_url: str) -> None:
    tag = os.urandom(3).hex()
    good, garbage, deleted = f"ok-{tag}", f"junk-{tag}", f"gone-{tag}"
    bus = await connect_bus(nats_url, name="live-nodes-test", heartbeat_ttl_s=60)
    kv = await bus.nodes_kv()
    try:
        hb = NodeHeartbeat(node_id=good, dataplane_url="http://127.0.0.1:1", memory_mib=1024, memory_used_mib=0,
                           vcpus=2, vcpus_used=0, sandboxes=0, templates=["base"], accel="tcg", at=datetime.now(UTC))
        await kv.put(good, hb.model_dump_json().encode())
        await kv.put(garbage, b"{not a heartbeat")
        await kv.put(deleted, hb.model_copy(update={"node_id": deleted}).model_dump_json().encode())
        await kv.delete(deleted)
        ids = {n.node_id for n in await bus.live_nodes()}
        assert good in ids and deleted not in ids and garbage not in ids
    finally:
        for key in (good, garbage):
            await kv.delete(key)
        await bus.close()


async def test_live_nodes_does_not_hide_a_lost_connection(nats_url: str) -> None:
    bus = await connect_bus(nats_url, name="live-nodes-closed", heartbeat_ttl_s=60)
    await bus.nodes_kv()
    await bus.close()
    # An outage must surface, not read as "no nodes" (which would make placement fail silently).
    with pytest.raises(Exception) as info:
        await bus.live_nodes()
    assert "NoKeys" not in type(info.value).__name__
