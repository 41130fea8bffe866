"""Template names are per tenant (services/api/services/template_access.py, migration 0037): two tenants' ``web`` are two
templates with two internal keys; each tenant lists, reads, tags, pools, removes and creates from its own; a
shared name is the operator's. Against the real stack with two tenants; no microVM: template rows are written
as a build registers them (key in ``templates.name``, the tenant's name in ``templates.alias``), and the warm
claim and the restore path are run up to the point where a node would be asked (tests/e2e builds for real)."""

from __future__ import annotations

import secrets

import asyncpg
import httpx
import pytest
from access_helpers import Tenant, sql

from podbay.devstack.stack import Stack
from podbay.naming import e2b_sandbox_id
from podbay.outbox import new_id

pytestmark = pytest.mark.integration


def _own(stack: Stack, tenant: Tenant | None, alias: str, digest: str, tag: str | None = None) -> str:
    """A registered template of ``tenant`` (None: shared) named ``alias``, as a build leaves it; its key."""
    from podbay_api.services.template_access import new_key  # noqa: PLC0415  # the service's own key rule

    key = new_key(tenant.tenant_id if tenant else None, alias)
    sql(stack, "INSERT INTO templates (name, alias, digest, memory_mib, vcpus, parent, owner_tenant)"
        " VALUES ($1, $2, $3, 256, 1, 'base', $4)", key, alias, digest, tenant.tenant_id if tenant else None)
    if tag:
        sql(stack, "INSERT INTO template_tags (name, tag, digest, memory_mib, vcpus) VALUES ($1, $2, $3, 256, 1)",
            key, tag, digest)
    return key


def _listed(http: httpx.Client, alias: str) -> list[dict[str, object]]:
    return [t for t in http.get("/v1/templates").json()["templates"] if t["name"] == alias]


def test_two_tenants_each_have_their_own_web(stack: Stack, acme: Tenant, other: Tenant) -> None:
    web = f"web-{secrets.token_hex(3)}"
    key_a = _own(stack, acme, web, "sha256:a", tag="v1")
    key_b = _own(stack, other, web, "sha256:b", tag="v1")
    assert key_a != key_b and web not in (key_a, key_b)
    shared = f"pub-{secrets.token_hex(3)}"
    _own(stack, None, shared, "sha256:s")
    with acme.http() as a, other.http() as b:
        # Each lists its own web (its own build) and the shared one, under the names given; never a key.
        for http, digest in ((a, "sha256:a"), (b, "sha256:b")):
            mine = _listed(http, web)
            assert [(t["digest"], [g["tag"] for g in t["tags"]]) for t in mine] == [(digest, ["v1"])]
            names = {t["name"] for t in http.get("/v1/templates").json()["templates"]}
            assert shared in names and key_a not in names and key_b not in names
            e2b = [t for t in http.get("/e2b/templates").json() if t["templateID"] == web]
            assert len(e2b) == 1 and e2b[0]["aliases"] == [web]
            assert http.get(f"/e2b/templates/aliases/{web}").json()["templateID"] == web
            # The key is no name of the tenant's: not even its own template answers to it.
            assert http.get(f"/v1/templates/{key_a}/network").status_code == 404
        # Pools: each sets its own; the other's stays as it was.
        assert a.put(f"/v1/pools/{web}", json={"size": 0, "max_size": 0}).status_code == 200
        assert b.put(f"/v1/pools/{web}", json={"size": 0, "max_size": 1}).status_code == 200
        pools = {r["template"]: r["max_size"] for r in sql(stack, "SELECT template, max_size FROM warm_pools"
                                                                  " WHERE template = ANY($1::text[])", [key_a, key_b])}
        assert pools == {key_a: 0, key_b: 1}
        assert [p["max_size"] for p in b.get("/v1/pools").json()["pools"] if p["template"] == web] == [1]
        assert [p["max_size"] for p in a.get("/v1/pools").json()["pools"] if p["template"] == web] == [0]
        sql(stack, "DELETE FROM warm_pools WHERE template = ANY($1::text[])", [key_a, key_b])
        # Untag and remove A's: B's web, its tag and its row are untouched.
        assert a.delete(f"/v1/templates/{web}:v1").status_code == 204
        assert [[g["tag"] for g in t["tags"]] for t in _listed(b, web)] == [["v1"]]
        assert a.delete(f"/v1/templates/{web}").status_code == 204
        assert _listed(a, web) == [] and len(_listed(b, web)) == 1
        assert a.post("/v1/sandboxes", json={"template": web}).status_code == 404
        assert sql(stack, "SELECT deleted_at IS NULL AS live FROM templates WHERE name=$1", key_b)[0]["live"]
        # E2B's removal is by the caller's name too.
        assert b.delete(f"/e2b/templates/{web}").status_code == 204
        assert _listed(b, web) == []
    audit = sql(stack, "SELECT tenant_id, target FROM audit_log WHERE action='template.delete' AND target=$1", web)
    assert sorted(r["tenant_id"] for r in audit) == sorted([acme.tenant_id, other.tenant_id])


def test_a_shared_name_is_the_operators_and_a_tenants_own_shadows_a_later_shared_one(
        stack: Stack, acme: Tenant, other: Tenant) -> None:
    shared = f"pub-{secrets.token_hex(3)}"
    _own(stack, None, shared, "sha256:s")
    with acme.http() as a:
        r = a.post("/v1/templates", data={"name": shared, "dockerfile": "FROM base\nRUN true\n"})
        assert r.status_code == 403 and r.json()["error"]["details"]["reason"] == "shared_name", r.text
        assert a.post("/e2b/v3/templates", json={"name": shared}).status_code == 403
    # A name a tenant had before the operator published it stays the tenant's own for that tenant.
    web = f"web-{secrets.token_hex(3)}"
    key_a = _own(stack, acme, web, "sha256:a")
    key_s = _own(stack, None, web, "sha256:s")
    sql(stack, "INSERT INTO warm_pools (template, min_size, max_size) VALUES ($1, 0, 2), ($2, 0, 3)", key_a, key_s)
    try:
        with acme.http() as a, other.http() as b:
            assert [t["digest"] for t in _listed(a, web)] == ["sha256:a"]
            assert [t["digest"] for t in _listed(b, web)] == ["sha256:s"]
            assert [t["templateID"] for t in a.get("/e2b/templates").json()].count(web) == 1
            # Pools likewise: A's web is A's pool, B's the shared one.
            assert [p["max_size"] for p in a.get("/v1/pools").json()["pools"] if p["template"] == web] == [2]
            assert [p["max_size"] for p in b.get("/v1/pools").json()["pools"] if p["template"] == web] == [3]
    finally:
        sql(stack, "DELETE FROM warm_pools WHERE template = ANY($1::text[])", [key_a, key_s])


def test_sandboxes_record_the_key_and_show_the_name(stack: Stack, acme: Tenant, other: Tenant) -> None:
    web = f"web-{secrets.token_hex(3)}"
    key_a, key_b = _own(stack, acme, web, "sha256:a"), _own(stack, other, web, "sha256:b")
    sbx = f"sbx_{secrets.token_hex(12)}"
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname) VALUES ($1, $2, $3, 'sha256:a', 'running', 'running', 256, 1, 'h')", sbx,
        acme.tenant_id, key_a)
    with acme.http() as a:
        assert a.get(f"/v1/sandboxes/{sbx}").json()["template"] == web
        assert sbx in {s["id"] for s in a.get("/v1/sandboxes").json()["sandboxes"]}
        listed = [s for s in a.get("/e2b/v2/sandboxes", params={"state": "running"}).json()
                  if s["sandboxID"] == e2b_sandbox_id(sbx)]
        assert [(s["templateID"], s["alias"]) for s in listed] == [(web, web)]
        # The restore path resolves A's name to A's key (the create waits for no node: wait=false).
        r = a.post("/v1/sandboxes", params={"wait": "false"}, json={"template": web})
        assert r.status_code in (200, 201, 202), r.text
        created = r.json()["id"]
        assert r.json()["template"] == web
    row = sql(stack, "SELECT template, template_digest FROM sandboxes WHERE id=$1", created)[0]
    assert (row["template"], row["template_digest"]) == (key_a, "sha256:a")
    del key_b


async def test_the_warm_claim_takes_a_slot_of_the_callers_own_template(pool: asyncpg.Pool) -> None:
    """services/api/services/warm.CLAIM_SQL resolves the tenant's name in its one statement: each tenant's create of
    ``web`` claims a slot of its own ``web`` (its key), never the other's."""
    from podbay_api.services.template_access import new_key  # noqa: PLC0415
    from podbay_api.services.warm import CLAIM_SQL  # noqa: PLC0415  # the service's own statement, run directly

    a, b = new_id("tnt"), new_id("tnt")
    web = f"web-{secrets.token_hex(3)}"
    node = f"node-own-{secrets.token_hex(3)}"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:9', 1024, 1, 'tcg', 'ready')", node)
    keys = {}
    for t in (a, b):
        await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", t)
        keys[t] = new_key(t, web)
        await pool.execute("INSERT INTO templates (name, alias, digest, memory_mib, vcpus, owner_tenant)"
                           " VALUES ($1, $2, $3, 256, 1, $4)", keys[t], web, f"d-{t}", t)

    def args(tenant: str) -> list[object]:
        event = {"sandbox_id": "", "type": "created", "data": {}}
        return [web, None, tenant, None, f"podbay.evt.audit.{tenant}.sandbox.create", {}, 600, "pause",
                new_id("op"), "key_test", new_id("evt"), "podbay.evt.sandbox.", ".created", event,
                {"sandbox_id": "", "data": {"audit_id": 0, "target": None}}, {"warm": True}, None, new_id("evt"),
                None, None, 100, 100, 1 << 20, 1 << 20]

    try:
        # Only B's web has a ready slot: A's create of web claims nothing.
        await pool.execute(
            "INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state, ready_at)"
            " VALUES ($1, $2, $3, $4, 256, 1, 'ready', now())", f"sbx_{secrets.token_hex(12)}", node, keys[b],
            f"d-{b}")
        assert await pool.fetchrow(CLAIM_SQL, *args(a)) is None
        row = await pool.fetchrow(CLAIM_SQL, *args(b))
        assert row is not None and (row["tenant_id"], row["template"], row["template_digest"]) == (
            b, keys[b], f"d-{b}")
    finally:
        await pool.execute("UPDATE nodes SET state='drained' WHERE id=$1", node)
