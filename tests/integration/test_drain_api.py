"""``POST /v1/nodes/{id}/drain`` against the real stack (no microVM needed): only the operator tenant may
drain; unknown nodes are 404, lost ones 409; a drain runs through the real scheduler, reports its progress
in ``GET /v1/operations/{id}`` and leaves an empty node ``drained``; the CLI follows it."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time

import httpx
import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


def _node(stack: Stack, state: str = "ready") -> str:
    node = f"dn-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
               " ($1, 'http://127.0.0.1:1', 1024, 2, 'tcg', $2)", node, state)
    return node


def _operator(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"})


def test_only_the_operator_may_drain(stack: Stack) -> None:
    acme: Tenant = new_tenant(stack, "acme")
    node = _node(stack)
    with acme.http() as http:
        r = http.post(f"/v1/nodes/{node}/drain")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert sql(stack, "SELECT state FROM nodes WHERE id=$1", node)[0]["state"] == "ready"
    with _operator(stack) as op:
        r = op.post("/v1/nodes/no-such-node/drain")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        lost = _node(stack, "lost")
        r = op.post(f"/v1/nodes/{lost}/drain")
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state", r.text


def test_drain_of_an_empty_node_ends_drained_with_progress(stack: Stack) -> None:
    node = _node(stack)
    with _operator(stack) as op:
        r = op.post(f"/v1/nodes/{node}/drain")
        assert r.status_code == 202, r.text
        started = r.json()
        assert started["node_id"] == node and started["state"] == "draining"
        for _ in range(300):
            got = op.get(f"/v1/operations/{started['operation_id']}").json()
            if got["state"] in ("succeeded", "failed"):
                break
            time.sleep(0.1)
        assert got["state"] == "succeeded", got
        assert got["kind"] == "drain" and got["node_id"] == node
        assert got["progress"] == {"total": 0, "moved": 0, "failed": [], "moves": []}
    assert sql(stack, "SELECT state FROM nodes WHERE id=$1", node)[0]["state"] == "drained"
    audit = sql(stack, "SELECT action FROM audit_log WHERE target=$1", node)
    assert [a["action"] for a in audit] == ["node.drain"]


def test_undrain_takes_a_drained_or_stuck_node_back_and_refuses_a_running_drain_or_a_lost_node(
        stack: Stack) -> None:
    acme = new_tenant(stack, "acme")
    stuck = _node(stack, "draining")  # what a drain that ended drain_incomplete leaves
    with acme.http() as http:
        r = http.post(f"/v1/nodes/{stuck}/undrain")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert sql(stack, "SELECT state FROM nodes WHERE id=$1", stuck)[0]["state"] == "draining"
    with _operator(stack) as op:
        r = op.post(f"/v1/nodes/{stuck}/undrain")
        assert r.status_code == 200 and r.json() == {"node_id": stuck, "state": "ready", "previous": "draining"}, r.text
        assert sql(stack, "SELECT state FROM nodes WHERE id=$1", stuck)[0]["state"] == "ready"
        assert [a["action"] for a in sql(stack, "SELECT action FROM audit_log WHERE target=$1", stuck)] == [
            "node.undrain"]
        r = op.post(f"/v1/nodes/{stuck}/undrain")  # already ready: answered as it is
        assert r.status_code == 200 and r.json()["previous"] == "ready", r.text
        drained = _node(stack, "drained")
        assert op.post(f"/v1/nodes/{drained}/undrain").json()["previous"] == "drained"
        lost = _node(stack, "lost")
        r = op.post(f"/v1/nodes/{lost}/undrain")
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state", r.text
        assert sql(stack, "SELECT state FROM nodes WHERE id=$1", lost)[0]["state"] == "lost"
        busy = _node(stack, "draining")
        sql(stack, "INSERT INTO operations (id, tenant_id, kind, state, node_id) SELECT $1, id, 'drain', 'running',"
                   " $2 FROM tenants LIMIT 1", f"op-{busy}", busy)
        r = op.post(f"/v1/nodes/{busy}/undrain")
        assert r.status_code == 409 and r.json()["error"]["details"]["operation_id"] == f"op-{busy}", r.text
        assert sql(stack, "SELECT state FROM nodes WHERE id=$1", busy)[0]["state"] == "draining"
        assert op.post("/v1/nodes/no-such-node/undrain").status_code == 404
    env = {**_base_env(), "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": stack.api_key}
    again = _node(stack, "drained")
    out = subprocess.run([sys.executable, "-m", "podbay.cli.main", "node", "undrain", again], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout == f"{again}: ready\n", out.stderr
    out = subprocess.run([sys.executable, "-m", "podbay.cli.main", "node", "undrain", lost], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 2 and out.stderr.strip().endswith("(invalid_state)"), out.stderr


def test_cli_drain_waits_and_reports(stack: Stack) -> None:
    node = _node(stack)
    env = {"PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": stack.api_key}
    out = subprocess.run([sys.executable, "-m", "podbay.cli.main", "node", "drain", node], capture_output=True,
                         text=True, timeout=120, env={**_base_env(), **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"{node}: drained"
    acme = new_tenant(stack, "acme")
    other = _node(stack)
    out = subprocess.run([sys.executable, "-m", "podbay.cli.main", "node", "drain", other, "--no-wait"],
                         capture_output=True, text=True, timeout=60,
                         env={**_base_env(), "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": acme.key})
    assert out.returncode == 2 and out.stderr.strip().endswith("(forbidden)"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
