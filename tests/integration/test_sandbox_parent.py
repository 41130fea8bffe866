"""``parent_id`` of ``GET /v1/sandboxes/{id}`` and ``GET /v1/sandboxes`` against the real API and PostgreSQL,
with rows set up directly (no VM): a fork child names the sandbox it was forked from (the console's link to
its parent); a sandbox made from a template names none."""

from __future__ import annotations

import secrets

import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "parentof")


def test_a_fork_child_names_its_parent(stack: Stack, acme: Tenant) -> None:
    tpl, parent, child = f"parentof-{secrets.token_hex(3)}", f"sbx_{secrets.token_hex(12)}", f"sbx_{secrets.token_hex(12)}"
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'sha256:none', 256, 1)", tpl)
    for sid, up in ((parent, None), (child, parent)):
        sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
            " vcpus, hostname, generation, parent_sandbox_id) VALUES ($1, $2, $3, 'sha256:none', 'paused', 'running',"
            " 256, 1, 'h', 1, $4)", sid, acme.tenant_id, tpl, up)
    with acme.http() as http:
        assert http.get(f"/v1/sandboxes/{child}").json()["parent_id"] == parent
        assert http.get(f"/v1/sandboxes/{parent}").json()["parent_id"] is None
        listed = {s["id"]: s["parent_id"] for s in http.get("/v1/sandboxes").json()["sandboxes"]}
        assert listed[child] == parent and listed[parent] is None
