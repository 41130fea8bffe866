"""``POST /v1/sandboxes/{id}/suspend`` of a fork's parent against the real API and PostgreSQL, with rows set up
directly (no VM): while a child is still starting from one of the parent's snapshots (its fork command left
to be redelivered after a node agent restart), the suspend answers 409 ``conflict`` and changes nothing, since
the suspend would drop the node-local snapshot that start reads; once the child runs, it is accepted."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "forksusp")


@pytest.fixture(scope="module")
def node(stack: Stack) -> Iterator[str]:
    """A node row no placement or node-loss pass takes (drained), so the rows placed on it stay as set."""
    nid = f"forksusp-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
               " ($1, 'http://127.0.0.1:1', 1024, 2, 'tcg', 'drained')", nid)
    yield nid


def _fork(stack: Stack, tenant: Tenant, node: str, snap_state: str) -> tuple[str, str, str]:
    """A running parent on ``node``, its fork snapshot (``snap_state``) and a child ``starting`` from it."""
    tpl, parent, child = f"forksusp-{secrets.token_hex(3)}", f"sbx_{secrets.token_hex(12)}", f"sbx_{secrets.token_hex(12)}"
    snap = f"snap_{secrets.token_hex(12)}"
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'sha256:none', 256, 1)", tpl)
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname, node_id, generation) VALUES ($1, $2, $3, 'sha256:none', 'running', 'running', 256, 1,"
        " 'p', $4, 1)", parent, tenant.tenant_id, tpl, node)
    sql(stack, "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, generation)"
        " VALUES ($1, $2, $3, $4, 'full', $5, 1)", snap, tenant.tenant_id, parent, node, snap_state)
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname, node_id, generation, parent_sandbox_id, source_snapshot_id) VALUES ($1, $2, $3,"
        " 'sha256:none', 'starting', 'running', 256, 1, 'c', $4, 1, $5, $6)", child, tenant.tenant_id, tpl, node,
        parent, snap)
    return parent, snap, child


@pytest.mark.parametrize("snap_state", ["creating", "ready"])
def test_suspend_of_a_parent_waits_for_its_starting_fork_child(stack: Stack, acme: Tenant, node: str,
                                                                snap_state: str) -> None:
    parent, snap, child = _fork(stack, acme, node, snap_state)
    with acme.http() as http:
        r = http.post(f"/v1/sandboxes/{parent}/suspend", params={"wait": "false"})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "conflict"
        assert child in err["message"] and "retry" in err["message"]
        assert err["details"]["starting_sandbox_id"] == child
        # Refused before anything was written: the parent runs on, the child's snapshot is as it was, no
        # suspend snapshot or operation exists.
        assert tuple(sql(stack, "SELECT state, suspended_snapshot_id FROM sandboxes WHERE id=$1", parent)[0]) == (
            "running", None)
        assert [tuple(s) for s in sql(stack, "SELECT id, state FROM snapshots WHERE sandbox_id=$1", parent)] == [
            (snap, snap_state)]
        assert sql(stack, "SELECT id FROM operations WHERE sandbox_id=$1 AND kind='suspend'", parent) == []

        # The child is up (its restore no longer reads the snapshot): the suspend is accepted.
        sql(stack, "UPDATE sandboxes SET state='running' WHERE id=$1", child)
        r = http.post(f"/v1/sandboxes/{parent}/suspend", params={"wait": "false"})
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "suspending"
        assert sql(stack, "SELECT state FROM snapshots WHERE id=$1", snap)[0]["state"] == snap_state
