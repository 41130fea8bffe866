"""Every service of a real stack answers ``/readyz`` 200 with each of its checks ``ok`` (the node agent's store
is mounted and its command consumer bound, the snapshotter's S3 answers, the gateway's proxy listens)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

EXPECTED = {
    "api": {"postgres", "nats", "outbox relay"},
    "nodeagent": {"agent", "store", "nats", "postgres", "consumer"},
    "scheduler": {"nats", "postgres", "consumer"},
    "snapshotter": {"nats", "postgres", "s3", "consumer"},
    "warmpool": {"nats", "postgres", "targets loop"},
    "gateway": {"proxy", "nats", "postgres", "node addresses"},
}


def test_every_service_is_ready_with_all_its_checks(stack: Any) -> None:
    ports = stack.ports
    port_of = {"api": ports.api, "nodeagent": ports.node, "scheduler": ports.scheduler,
               "snapshotter": ports.snapshotter, "warmpool": ports.warmpool, "gateway": ports.gateway}
    for name, port in port_of.items():
        deadline = time.monotonic() + 60
        while True:
            r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, (name, r.text)
        body = r.json()
        assert body["service"] == name and body["ready"] is True
        assert set(body["checks"]) == EXPECTED[name], (name, body)
        assert all(v == "ok" for v in body["checks"].values()), (name, body)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200, name
