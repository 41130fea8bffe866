"""Asynchronous lifecycle calls (``?wait=false`` and operations) and the services' metrics."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from e2e_http import api_client as _client

pytestmark = pytest.mark.e2e



def _wait_op(c: httpx.Client, op_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    op: dict[str, Any] = {}
    while time.monotonic() < deadline:
        op = c.get(f"/v1/operations/{op_id}").json()
        if op["state"] in ("succeeded", "failed"):
            return op
        time.sleep(0.1)
    return op


def test_wait_false_returns_an_operation_that_completes(stack: Any) -> None:
    with _client(stack) as c:
        r = c.post("/v1/sandboxes", params={"wait": "false"}, json={"template": "base"})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["state"] in ("pending", "starting") and body["operation_id"]
        op = _wait_op(c, body["operation_id"])
        assert op["state"] == "succeeded" and op["kind"] == "create" and op["sandbox_id"] == body["id"]
        assert c.get(f"/v1/sandboxes/{body['id']}").json()["state"] == "running"

        r = c.delete(f"/v1/sandboxes/{body['id']}", params={"wait": "false"})
        assert r.status_code == 202 and r.json()["state"] == "deleting"
        assert _wait_op(c, r.json()["operation_id"])["state"] == "succeeded"
        assert c.get(f"/v1/sandboxes/{body['id']}").json()["state"] == "deleted"
        assert c.get("/v1/operations/op_unknown").status_code == 404


def test_every_service_serves_health_and_metrics(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
        c.delete(f"/v1/sandboxes/{sid}")
    ports = stack.ports
    for name, port in (("api", ports.api), ("nodeagent", ports.node), ("scheduler", ports.scheduler),
                       ("snapshotter", ports.snapshotter), ("warmpool", ports.warmpool)):
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, name
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=_creds(stack)).text
        assert "process_cpu_seconds_total" in text, name
    api = _samples(ports.api, _creds(stack))
    assert api[("podbay_lifecycle_operation_seconds_count", (("kind", "create"), ("outcome", "ok"), ("service", "api")))] >= 1
    assert any(name == "podbay_http_request_seconds_count" and ("route", "/v1/sandboxes/{sandbox_id}/exec") in labels
               for name, labels in api)
    node = _samples(ports.node, _creds(stack))
    assert node[("podbay_lifecycle_operations_total", (("kind", "create"), ("outcome", "ok"), ("service", "nodeagent")))] >= 1
    assert node[("podbay_hop_seconds_count", (("hop", "qemu_restore"), ("service", "nodeagent")))] >= 1
    sched = _samples(ports.scheduler)
    assert sched[("podbay_lifecycle_operations_total", (("kind", "place"), ("outcome", "ok"), ("service", "scheduler")))] >= 1


def _creds(stack: Any) -> dict[str, str]:
    """What a scraper sends: the API's /metrics takes an operator key (the stack's is the operator tenant's),
    the node's its internal token; the other health ports are loopback and need none without a metrics token."""
    return {"authorization": f"Bearer {stack.api_key}",
            "x-podbay-internal-token": stack.env.get("PODBAY_INTERNAL_TOKEN", "")}


def _samples(port: int, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers).text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out
