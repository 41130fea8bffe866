"""Warm-pool hits and misses of ``GET /v1/pools`` against the real API and PostgreSQL, with rows set up
directly (no VM): the caller's creates of the last hour, counted from their audit rows (a warm claim's says
``warm``), and none of another tenant's creates of the same template."""

from __future__ import annotations

import json
import secrets

import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "poolhits")


@pytest.fixture(scope="module")
def other(stack: Stack) -> Tenant:
    return new_tenant(stack, "poolhits-other")


def _create(stack: Stack, tenant: Tenant, template: str, *, warm: bool, age_s: float = 60) -> None:
    detail = {"template": template, "network": False, **({"warm": True} if warm else {})}
    sql(stack, "INSERT INTO audit_log (tenant_id, actor, action, target, detail, at) VALUES ($1, 'key_x',"
        " 'sandbox.create', $2, $3::jsonb, now() - make_interval(secs => $4))", tenant.tenant_id, f"sbx_{secrets.token_hex(12)}",
        json.dumps(detail), age_s)


def test_pools_count_the_callers_warm_hits_and_misses(stack: Stack, acme: Tenant, other: Tenant) -> None:
    tpl = f"poolhits-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus, owner_tenant) VALUES ($1, 'sha256:none',"
        " 256, 1, $2)", tpl, acme.tenant_id)
    try:
        with acme.http() as http:
            assert http.put(f"/v1/pools/{tpl}", json={"size": 0}).status_code == 200
            pool = {p["template"]: p for p in http.get("/v1/pools").json()["pools"]}[tpl]
            assert (pool["hits"], pool["misses"], pool["hit_rate"]) == (0, 0, None)
            for warm in (True, True, True, False):
                _create(stack, acme, tpl, warm=warm)
            _create(stack, acme, tpl, warm=True, age_s=7200)  # older than the window
            _create(stack, other, tpl, warm=False)  # another tenant's create is not the caller's to count
            pool = {p["template"]: p for p in http.get("/v1/pools").json()["pools"]}[tpl]
            assert (pool["hits"], pool["misses"], pool["hit_rate"]) == (3, 1, 0.75)
    finally:
        sql(stack, "DELETE FROM warm_pools WHERE template=$1", tpl)
