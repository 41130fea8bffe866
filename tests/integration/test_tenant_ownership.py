"""Templates, their tags, builds and pools belong to a tenant; shared templates are the operator's; per-tenant
quotas (services/api/services/template_access.py, services/api/services/quotas.py), against the real stack with two tenants.
No microVM: template rows are written directly, and every refusal comes before a node is asked."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import httpx
import pytest
from access_helpers import Tenant, sql

from podbay.devstack.stack import Stack
from podbay.outbox import new_id

pytestmark = pytest.mark.integration




def _template(stack: Stack, owner: Tenant | None, tag: str | None = None) -> str:
    """A built template's row (owned by ``owner``; None: shared), optionally with a tag."""
    name = f"own-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus, parent, owner_tenant)"
        " VALUES ($1, 'sha256:none', 256, 1, 'base', $2)", name, owner.tenant_id if owner else None)
    if tag:
        sql(stack, "INSERT INTO template_tags (name, tag, digest, memory_mib, vcpus)"
            " VALUES ($1, $2, 'sha256:none', 256, 1)", name, tag)
    return name


def _operator(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"}, timeout=30)


def _build(http: httpx.Client, name: str, parent: str) -> httpx.Response:
    return http.post("/v1/templates", data={"name": name, "dockerfile": f"FROM {parent}\nRUN true\n"})


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


def test_another_tenants_template_is_invisible_and_untouchable(stack: Stack, acme: Tenant, other: Tenant) -> None:
    mine = _template(stack, acme, tag="v1")
    shared = _template(stack, None)
    with other.http() as b, acme.http() as a:
        # Lists: A sees its own and the shared one; B only the shared one (native and E2B).
        assert {mine, shared} <= {t["name"] for t in a.get("/v1/templates").json()["templates"]}
        names_b = {t["name"] for t in b.get("/v1/templates").json()["templates"]}
        assert shared in names_b and mine not in names_b
        assert mine not in {t["templateID"] for t in b.get("/e2b/templates").json()}
        assert mine in {t["templateID"] for t in a.get("/e2b/templates").json()}
        # Every change, and every read of it, is 404 for B, as if it did not exist.
        refused = [
            b.delete(f"/v1/templates/{mine}"),
            b.delete(f"/v1/templates/{mine}:v1"),
            b.put(f"/v1/pools/{mine}", json={"size": 1}),
            b.get(f"/v1/templates/{mine}/builds"),
            b.get(f"/v1/templates/{mine}/network"),
            b.post("/v1/sandboxes", json={"template": mine}),
            b.post("/v1/sandboxes", json={"template": f"{mine}:v1"}),
        ]
        for r in refused:
            assert r.status_code == 404 and _code(r) == "not_found", (r.request.url, r.text)
        for r in [b.get(f"/e2b/templates/{mine}"), b.delete(f"/e2b/templates/{mine}"),
                  b.get(f"/e2b/templates/{mine}/tags"), b.get(f"/e2b/templates/aliases/{mine}"),
                  b.get(f"/e2b/templates/{mine}/files/{'ab' * 32}"),
                  b.post("/e2b/templates/tags", json={"target": mine, "tags": ["default"]}),
                  b.request("DELETE", "/e2b/templates/tags", json={"name": mine, "tags": ["v1"]})]:
            assert r.status_code == 404, (r.request.url, r.text)
        # Names are per tenant: B's build of the same name is B's own template (not refused for the name: no
        # node holds the FROM template here, so it gets as far as looking for one), and says nothing of A's.
        # FROM A's template is FROM no template.
        own = _build(b, mine, shared)
        assert own.status_code == 503 and _code(own) == "unavailable", own.text
        assert acme.tenant_id not in own.text and acme.name not in own.text
        assert b.post("/e2b/v3/templates", json={"name": mine}).status_code == 202
        from_it = _build(b, f"own-{secrets.token_hex(3)}", mine)
        assert from_it.status_code == 404 and _code(from_it) == "not_found", from_it.text
        # Nothing changed for A.
        assert a.get(f"/e2b/templates/aliases/{mine}").status_code == 200
        assert [g["tag"] for t in a.get("/v1/templates").json()["templates"] if t["name"] == mine
                for g in t["tags"]] == ["v1"]
        # A may change its own: the pool (0 ends it), the tag, the template.
        assert a.put(f"/v1/pools/{mine}", json={"size": 0}).status_code == 200
        assert mine in {p["template"] for p in a.get("/v1/pools").json()["pools"]}
        assert mine not in {p["template"] for p in b.get("/v1/pools").json()["pools"]}
        assert a.delete(f"/v1/templates/{mine}:v1").status_code == 204
        sql(stack, "DELETE FROM warm_pools WHERE template=$1", mine)
        assert a.delete(f"/v1/templates/{mine}").status_code == 204
        # Every refusal is in B's audit log, with its route; none in A's.
        rows = sql(stack, "SELECT tenant_id, actor, decision, detail FROM audit_log WHERE action='tenant.refused'"
                   " AND target=$1", mine)
        # (B's two builds of the name are no longer refusals: names are per tenant.)
        assert len(rows) >= 13 and {r["tenant_id"] for r in rows} == {other.tenant_id}
        assert all(r["decision"] == "deny" for r in rows)
        routes = {r["detail"]["route"] if isinstance(r["detail"], dict) else r["detail"] for r in rows}
        assert any("DELETE /v1/templates" in str(x) for x in routes) and any("/e2b/" in str(x) for x in routes)


def test_shared_templates_are_read_only_for_tenants_and_the_operators_to_manage(
        stack: Stack, acme: Tenant, other: Tenant) -> None:
    shared = _template(stack, None, tag="v1")
    for tenant in (acme, other):
        with tenant.http() as t:
            assert shared in {x["name"] for x in t.get("/v1/templates").json()["templates"]}
            assert t.get(f"/e2b/templates/aliases/{shared}").status_code == 200
            for r in [t.delete(f"/v1/templates/{shared}"), t.delete(f"/v1/templates/{shared}:v1"),
                      t.put(f"/v1/pools/{shared}", json={"size": 1}), _build(t, shared, "base")]:
                assert r.status_code == 403 and _code(r) == "forbidden", (r.request.url, r.text)
            for r in [t.delete(f"/e2b/templates/{shared}"),
                      t.post("/e2b/templates/tags", json={"target": shared, "tags": ["default"]})]:
                assert r.status_code == 403, (r.request.url, r.text)
    # base (where the stack has it) is shared too: read, never changed by a tenant.
    if sql(stack, "SELECT 1 FROM templates WHERE name='base' AND deleted_at IS NULL"):
        with other.http() as t:
            assert "base" in {x["name"] for x in t.get("/v1/templates").json()["templates"]}
            assert t.put("/v1/pools/base", json={"size": 5}).status_code == 403
            assert t.delete("/v1/templates/base").status_code == 403
    # The operator tenant manages it.
    with _operator(stack) as op:
        assert op.put(f"/v1/pools/{shared}", json={"size": 0}).status_code == 200
        assert op.delete(f"/v1/templates/{shared}:v1").status_code == 204
    sql(stack, "DELETE FROM warm_pools WHERE template=$1", shared)
    with _operator(stack) as op:
        assert op.delete(f"/v1/templates/{shared}").status_code == 204
    rows = sql(stack, "SELECT tenant_id, detail FROM audit_log WHERE action='tenant.refused' AND target=$1", shared)
    assert {r["tenant_id"] for r in rows} == {acme.tenant_id, other.tenant_id}


def test_a_removed_templates_name_is_free_for_another_tenant(stack: Stack, acme: Tenant, other: Tenant) -> None:
    name = _template(stack, acme)
    with acme.http() as a:
        assert a.delete(f"/v1/templates/{name}").status_code == 204
    with other.http() as b:
        # No node holds the shared FROM template here: the build gets as far as looking for one (503).
        r = _build(b, name, "base")
        assert r.status_code != 409 and r.status_code != 403, r.text


def test_quotas_refuse_before_any_vm_and_only_the_operator_sets_them(stack: Stack, acme: Tenant,
                                                                      other: Tenant) -> None:
    shared = _template(stack, None)
    with acme.http() as a:
        mine = a.get(f"/v1/tenants/{acme.tenant_id}/quota")
        assert mine.status_code == 200 and mine.json()["set"]["sandboxes"] is None
        assert mine.json()["limits"]["sandboxes"] >= 100  # the generous default
        assert a.get(f"/v1/tenants/{other.tenant_id}/quota").status_code == 404
        r = a.put(f"/v1/tenants/{acme.tenant_id}/quota", json={"sandboxes": 100})
        assert r.status_code == 403 and _code(r) == "forbidden"
    with _operator(stack) as op:
        r = op.put(f"/v1/tenants/{acme.name}/quota", json={"sandboxes": 1, "vcpus": 3, "builds": 0})
        assert r.status_code == 200, r.text
        assert r.json()["limits"]["sandboxes"] == 1 and r.json()["set"]["memory_mib"] is None
    # One sandbox (a row: no VM) fills the sandboxes quota; the next create is refused before any placement.
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname) VALUES ($1, $2, $3, 'sha256:none', 'running', 'running', 256, 1, 'h')",
        f"sbx_{secrets.token_hex(12)}", acme.tenant_id, shared)
    before = sql(stack, "SELECT count(*) AS n FROM sandboxes WHERE tenant_id=$1", acme.tenant_id)[0]["n"]
    with acme.http() as a:
        for r in [a.post("/v1/sandboxes", json={"template": shared}),
                  a.post("/e2b/sandboxes", json={"templateID": shared})]:
            assert r.status_code == 403, r.text
        r = a.post("/v1/sandboxes", json={"template": shared})
        err = r.json()["error"]
        assert err["code"] == "quota_exceeded" and err["details"]["limit"] == "sandboxes"
        assert err["details"]["quota"] == 1 and err["details"]["usage"] == 1
        # Builds: a quota of 0 running builds.
        r = _build(a, f"own-{secrets.token_hex(3)}", shared)
        assert r.status_code == 403 and _code(r) == "quota_exceeded" and r.json()["error"]["details"]["limit"] == "builds"
        assert a.get(f"/v1/tenants/{acme.tenant_id}/quota").json()["usage"]["sandboxes"] == 1
    assert sql(stack, "SELECT count(*) AS n FROM sandboxes WHERE tenant_id=$1", acme.tenant_id)[0]["n"] == before
    # vCPUs: room for one more sandbox, not for its vCPUs.
    with _operator(stack) as op:
        assert op.put(f"/v1/tenants/{acme.tenant_id}/quota", json={"sandboxes": 5, "vcpus": 1}).status_code == 200
    with acme.http() as a:
        r = a.post("/v1/sandboxes", json={"template": shared})
        assert r.status_code == 403 and r.json()["error"]["details"]["limit"] == "vcpus", r.text
    refusals = sql(stack, "SELECT detail FROM audit_log WHERE action='quota.refused' AND tenant_id=$1", acme.tenant_id)
    assert len(refusals) >= 4
    # The other tenant is not bound by acme's quota (its create gets past the quota to placement).
    assert not sql(stack, "SELECT 1 FROM audit_log WHERE action='quota.refused' AND tenant_id=$1", other.tenant_id)


def test_the_quota_lock_serialises_one_tenants_checks(stack: Stack, acme: Tenant) -> None:
    """Two transactions of one tenant: the second's lock waits for the first to end (no double pass)."""
    from podbay_api.services.quotas import lock_tenant  # noqa: PLC0415  # the service's own statement, run directly

    from podbay.config import Settings

    async def run() -> float:
        c1, c2 = await asyncpg.connect(stack.pg_dsn), await asyncpg.connect(stack.pg_dsn)
        try:
            t1 = c1.transaction()
            await t1.start()
            await lock_tenant(c1, Settings(), acme.tenant_id)
            async with c2.transaction():
                second = asyncio.create_task(lock_tenant(c2, Settings(), acme.tenant_id))
                await asyncio.sleep(0.3)
                assert not second.done()  # waits for the first transaction
                await t1.commit()
                await asyncio.wait_for(second, 5)
            return 0.0
        finally:
            await c1.close()
            await c2.close()

    asyncio.run(run())


async def test_the_warm_claim_takes_no_slot_over_a_quota_or_of_another_tenants_template(pool: asyncpg.Pool) -> None:
    """The warm path's one statement (services/api/services/warm.CLAIM_SQL) claims nothing when the tenant's use plus
    the template's sandbox would pass a limit ($21-$24), or when the template is another tenant's."""
    from podbay_api.services.warm import CLAIM_SQL  # noqa: PLC0415  # the service's own statement, run directly

    tenant, owner = new_id("tnt"), new_id("tnt")
    for t in (tenant, owner):
        await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", t)
    shared, private = f"own-{secrets.token_hex(3)}", f"own-{secrets.token_hex(3)}"
    for name, who in ((shared, None), (private, owner)):
        await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus, size_bytes, owner_tenant)"
                           " VALUES ($1, 'd-own', 256, 2, $2, $3)", name, 100 << 20, who)
    node = f"node-own-{secrets.token_hex(3)}"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:9', 1024, 1, 'tcg', 'ready')", node)

    def args(template: str, limits: tuple[int, int, int, int]) -> list[object]:
        event = {"sandbox_id": "", "type": "created", "data": {}}
        return [template, None, tenant, None, f"podbay.evt.audit.{tenant}.sandbox.create", {}, 600, "pause",
                new_id("op"), "key_test", new_id("evt"), "podbay.evt.sandbox.", ".created", event,
                {"sandbox_id": "", "data": {"audit_id": 0, "target": None}}, {"warm": True}, None, new_id("evt"),
                None, None, *limits]

    try:
        for name in (shared, private):
            await pool.execute(
                "INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state, ready_at)"
                " VALUES ($1, $2, $3, 'd-own', 256, 2, 'ready', now())", f"sbx_{secrets.token_hex(12)}", node, name)
        # Another tenant's template: nothing, whatever the limits.
        assert await pool.fetchrow(CLAIM_SQL, *args(private, (100, 100, 1 << 20, 1 << 20))) is None
        # Each limit one short: nothing (sandboxes 0; vCPUs 1 < 2; memory 255 < 256; disk 99 < 100 MiB).
        for short in [(0, 100, 1 << 20, 1 << 20), (100, 1, 1 << 20, 1 << 20), (100, 100, 255, 1 << 20),
                      (100, 100, 1 << 20, 99)]:
            assert await pool.fetchrow(CLAIM_SQL, *args(shared, short)) is None, short
        # Exactly enough: the slot.
        row = await pool.fetchrow(CLAIM_SQL, *args(shared, (1, 2, 256, 100)))
        assert row is not None and row["tenant_id"] == tenant
        # Now that sandbox counts: the next one needs room for two.
        await pool.execute("INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus,"
                           " state, ready_at) VALUES ($1, $2, $3, 'd-own', 256, 2, 'ready', now())",
                           f"sbx_{secrets.token_hex(12)}", node, shared)
        assert await pool.fetchrow(CLAIM_SQL, *args(shared, (1, 100, 1 << 20, 1 << 20))) is None
        assert await pool.fetchrow(CLAIM_SQL, *args(shared, (2, 4, 512, 200))) is not None
    finally:
        await pool.execute("UPDATE nodes SET state='drained' WHERE id=$1", node)


def test_forks_and_wakes_count_against_the_quota(stack: Stack, acme: Tenant) -> None:
    """A fork's children and a suspended sandbox woken count as new sandboxes: refused over the quota before
    any node is asked (rows only)."""
    shared = _template(stack, None)
    paused, suspended = f"sbx_{secrets.token_hex(12)}", f"sbx_{secrets.token_hex(12)}"
    for sid, state in ((paused, "paused"), (suspended, "suspended")):
        sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state,"
            " memory_mib, vcpus, hostname) VALUES ($1, $2, $3, 'sha256:none', $4, $4, 256, 1, 'h')",
            sid, acme.tenant_id, shared, state)
    with _operator(stack) as op:
        assert op.put(f"/v1/tenants/{acme.tenant_id}/quota", json={"sandboxes": 3}).status_code == 200
    with acme.http() as a:
        # One sandbox holds a VM (paused): a fork of 3 children would make 4.
        r = a.post(f"/v1/sandboxes/{paused}/fork", json={"count": 3})
        assert r.status_code == 403 and _code(r) == "quota_exceeded", r.text
        assert r.json()["error"]["details"] == {"limit": "sandboxes", "quota": 3, "usage": 1, "requested": 3}
        assert not sql(stack, "SELECT 1 FROM sandboxes WHERE parent_sandbox_id=$1", paused)
        assert not sql(stack, "SELECT 1 FROM snapshots WHERE sandbox_id=$1", paused)
    with _operator(stack) as op:
        assert op.put(f"/v1/tenants/{acme.tenant_id}/quota", json={"sandboxes": 1}).status_code == 200
    with acme.http() as a:
        r = a.post(f"/v1/sandboxes/{suspended}/resume")
        assert r.status_code == 403 and _code(r) == "quota_exceeded", r.text
    assert sql(stack, "SELECT state FROM sandboxes WHERE id=$1", suspended)[0]["state"] == "suspended"
    actions = sql(stack, "SELECT detail->>'route' AS route FROM audit_log WHERE action='quota.refused'"
                  " AND tenant_id=$1", acme.tenant_id)
    assert {"fork sandbox", "resume sandbox"} <= {r["route"] for r in actions}


async def test_the_nodes_registration_keeps_a_name_to_its_owner(pool: asyncpg.Pool, tmp_path: Path) -> None:
    """services/nodeagent/build/builder.py ``_register``: the template gets its build's owner; a name another
    owner holds (not removed) is left alone and the build fails ``template_name_taken``; a removed name is
    taken over; a root template (no build) keeps the owner it has."""
    from podbay_nodeagent.build.builder import TemplateBuilder, TemplateNameTaken  # noqa: PLC0415

    a, b = new_id("tnt"), new_id("tnt")
    for t in (a, b):
        await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", t)
    node = f"node-own-{secrets.token_hex(3)}"
    await pool.execute("INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                       " ($1, 'http://127.0.0.1:9', 1024, 1, 'tcg', 'drained')", node)
    (tmp_path / "disk.img").write_bytes(b"\0" * 4096)
    builder = TemplateBuilder.__new__(TemplateBuilder)
    builder.m = SimpleNamespace(pool=pool, node_id=node, templates={})  # type: ignore[assignment]

    async def register(name: str, digest: str, owner: str | None) -> Any:
        build = new_id("bld")
        # (finished: the partial unique index allows one running build per name)
        await pool.execute("INSERT INTO template_builds (id, name, tenant_id, node_id, dockerfile, owner_tenant,"
                           " state) VALUES ($1, $2, $3, $4, 'FROM base', $5, 'succeeded')", build, name, owner or a,
                           node, owner)
        img = SimpleNamespace(name=name, digest=digest, snapshot=SimpleNamespace(
            dir=tmp_path, memory_mib=256, vcpus=1, config=None))
        return await builder._register(img, "base", build_id=build)  # type: ignore[arg-type]

    name = f"own-{secrets.token_hex(3)}"
    await register(name, "d1", a)
    assert await pool.fetchval("SELECT owner_tenant FROM templates WHERE name=$1", name) == a
    await register(name, "d2", a)  # the owner's rebuild
    with pytest.raises(TemplateNameTaken) as err:
        await register(name, "d3", b)
    assert err.value.code == "template_name_taken" and err.value.http_status == 409
    with pytest.raises(TemplateNameTaken):
        await register(name, "d3", None)  # the operator's build does not take a tenant's name either
    row = await pool.fetchrow("SELECT digest, owner_tenant FROM templates WHERE name=$1", name)
    assert (row["digest"], row["owner_tenant"]) == ("d2", a)
    await pool.execute("UPDATE templates SET deleted_at=now() WHERE name=$1", name)
    await register(name, "d4", b)  # removed: free
    row = await pool.fetchrow("SELECT digest, owner_tenant, deleted_at FROM templates WHERE name=$1", name)
    assert (row["digest"], row["owner_tenant"], row["deleted_at"]) == ("d4", b, None)
    # A root template (an image's, registered without a build) is shared and stays so.
    root = f"own-{secrets.token_hex(3)}"
    img = SimpleNamespace(name=root, digest="r1", snapshot=SimpleNamespace(dir=tmp_path, memory_mib=256, vcpus=1,
                                                                           config=None))
    await builder._register(img, None)  # type: ignore[arg-type]
    await builder._register(img, None)  # type: ignore[arg-type]
    assert await pool.fetchval("SELECT owner_tenant FROM templates WHERE name=$1", root) is None


def test_an_e2b_create_from_a_stored_snapshot_over_the_quota_is_403_and_leaves_no_sandbox(
        stack: Stack, acme: Tenant) -> None:
    shared = _template(stack, None)
    src, snap = f"sbx_{secrets.token_hex(12)}", f"snap_{secrets.token_hex(10)}"
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname) VALUES ($1, $2, $3, 'sha256:none', 'suspended', 'suspended', 256, 1, 'h')",
        src, acme.tenant_id, shared)
    sql(stack, "INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation, promotion)"
        " VALUES ($1, $2, $3, 'full', 'ready', 1, 'promoted')", snap, acme.tenant_id, src)
    with _operator(stack) as op:
        assert op.put(f"/v1/tenants/{acme.tenant_id}/quota", json={"sandboxes": 0}).status_code == 200
    with acme.http() as a:
        r = a.post("/e2b/sandboxes", json={"templateID": snap})
        assert r.status_code == 403 and "quota" in r.text, r.text
    left = sql(stack, "SELECT state FROM sandboxes WHERE parent_sandbox_id=$1", src)
    assert all(row["state"] in ("deleting", "deleted") for row in left), left


def test_a_tenants_pools_stay_within_its_sandboxes_quota(stack: Stack, acme: Tenant) -> None:
    one, two = _template(stack, acme), _template(stack, acme)
    with _operator(stack) as op:
        assert op.put(f"/v1/tenants/{acme.tenant_id}/quota", json={"sandboxes": 3}).status_code == 200
    with acme.http() as a:
        assert a.put(f"/v1/pools/{one}", json={"size": 1, "max_size": 2}).status_code == 200
        r = a.put(f"/v1/pools/{two}", json={"size": 2})
        assert r.status_code == 403 and _code(r) == "quota_exceeded", r.text
        assert r.json()["error"]["details"] == {"limit": "sandboxes", "quota": 3, "usage": 2, "requested": 2}
        assert a.put(f"/v1/pools/{two}", json={"size": 1}).status_code == 200
        assert a.put(f"/v1/pools/{one}", json={"size": 2}).status_code == 200  # its own old size is not counted
        for name in (one, two):
            assert a.put(f"/v1/pools/{name}", json={"size": 0}).status_code == 200
    sql(stack, "DELETE FROM warm_pools WHERE template = ANY($1::text[])", [one, two])
