"""``drain_operation_id`` of ``GET /v1/nodes`` against the real stack (no microVM): null for a node never
drained; after a drain, that drain's operation, whose progress ``GET /v1/operations/{id}`` shows (how the
console follows a drain opened in another window)."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from access_helpers import sql

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


def test_nodes_name_their_newest_drain(stack: Stack) -> None:
    node = f"dop-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
               " ($1, 'http://127.0.0.1:1', 1024, 2, 'tcg', 'ready')", node)
    with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"}) as op:
        nodes = {n["id"]: n for n in op.get("/v1/nodes").json()["nodes"]}
        assert nodes[node]["drain_operation_id"] is None
        first = op.post(f"/v1/nodes/{node}/drain").json()["operation_id"]
        for _ in range(300):
            if op.get(f"/v1/operations/{first}").json()["state"] in ("succeeded", "failed"):
                break
            time.sleep(0.1)
        assert op.post(f"/v1/nodes/{node}/undrain").status_code == 200
        second = op.post(f"/v1/nodes/{node}/drain").json()["operation_id"]
        assert second != first
        nodes = {n["id"]: n for n in op.get("/v1/nodes").json()["nodes"]}
        assert nodes[node]["drain_operation_id"] == second
        assert op.get(f"/v1/operations/{second}").json()["node_id"] == node
