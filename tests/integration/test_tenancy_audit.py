"""API keys, the audit log, egress policy and tenancy against the real stack (no microVM needed)."""

from __future__ import annotations

import json
import secrets

import asyncpg
import httpx
import pytest
from access_helpers import Tenant, sql, template_and_sandbox

from podbay.devstack.stack import Stack
from podbay.naming import sandbox_hostname

pytestmark = pytest.mark.integration




def test_keys_create_list_revoke(stack: Stack, acme: Tenant) -> None:
    with acme.http() as http:
        r = http.post("/v1/keys", json={"name": "ci"})
        assert r.status_code == 201, r.text
        new = r.json()
        assert new["key"].startswith(f"pb_{new['prefix']}_") and new["name"] == "ci"
        listed = http.get("/v1/keys")
        assert listed.status_code == 200
        assert new["key"] not in listed.text and "key_hash" not in listed.text
        assert {k["id"] for k in listed.json()["keys"]} >= {new["id"]}
        assert all(set(k) == {"id", "name", "prefix", "created_at", "revoked_at"} for k in listed.json()["keys"])
    # The new key works, and can revoke the first one.
    with acme.http(new["key"]) as http2:
        assert http2.get("/v1/sandboxes").status_code == 200
        first_id = next(k["id"] for k in http2.get("/v1/keys").json()["keys"] if k["id"] != new["id"])
        revoked = http2.delete(f"/v1/keys/{first_id}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    # Refused at once (no cache grace), with an audit row for the attempt under the key's tenant.
    with acme.http() as old:
        r = old.get("/v1/sandboxes")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    with acme.http(new["key"]) as http2:
        page = http2.get("/v1/audit", params={"action": "api_key.refused"}).json()
        assert page["entries"] and page["entries"][0]["actor"] == first_id
        assert page["entries"][0]["decision"] == "deny"
        assert [k["id"] for k in http2.get("/v1/keys").json()["keys"]] == [new["id"]]
        assert first_id in http2.get("/v1/keys", params={"all": "true"}).text
        # The last live key cannot revoke itself: the tenant would be locked out.
        last = http2.delete(f"/v1/keys/{new['id']}")
        assert last.status_code == 409 and last.json()["error"]["code"] == "conflict"
        assert http2.get("/v1/sandboxes").status_code == 200
        actions = [e["action"] for e in http2.get("/v1/audit", params={"action": "api_key.*"}).json()["entries"]]
        assert actions[:3] == ["api_key.refused", "api_key.revoke", "api_key.create"]


def test_key_revoked_while_cached_is_refused_on_the_next_request(acme: Tenant) -> None:
    with acme.http() as http:
        spare = http.post("/v1/keys", json={"name": "spare"}).json()
    with acme.http(spare["key"]) as victim:
        assert victim.get("/v1/keys").status_code == 200  # now in the API's verification cache
        with acme.http() as http:
            assert http.delete(f"/v1/keys/{spare['id']}").status_code == 200
        assert victim.get("/v1/keys").status_code == 401


def test_cross_tenant_access_is_404(stack: Stack, acme: Tenant, other: Tenant) -> None:
    tpl, sbx = template_and_sandbox(stack, acme)
    with acme.http() as http:
        key_id = http.post("/v1/keys", json={"name": "mine"}).json()["id"]
        assert http.post("/v1/credentials", json={"name": "c1", "value": "v" * 20,
                                                   "hosts": ["x.example.com"]}).status_code == 201
    with other.http() as http:
        assert http.delete(f"/v1/keys/{key_id}").status_code == 404
        assert key_id not in http.get("/v1/keys", params={"all": "true"}).text
        assert http.get("/v1/credentials/c1").status_code == 404
        assert http.get(f"/v1/sandboxes/{sbx}/network").status_code == 404
        put = http.put(f"/v1/sandboxes/{sbx}/network", json={"allow": [{"domain": "evil.example"}]})
        assert put.status_code == 404 and put.json()["error"]["code"] == "not_found"
        mine = http.get("/v1/audit", params={"limit": 1000}).json()["entries"]
        assert all(e["target"] not in (key_id, sbx) for e in mine)
        assert http.get("/v1/audit", params={"sandbox_id": sbx}).json()["entries"] == []
    with acme.http() as http:
        assert http.get(f"/v1/sandboxes/{sbx}/network").json()["source"] == "default"


def test_network_policy_of_sandbox_and_template(stack: Stack, acme: Tenant) -> None:
    tpl, sbx = template_and_sandbox(stack, acme)
    with acme.http() as http:
        assert http.get(f"/v1/sandboxes/{sbx}/network").json() == {"policy": {"allow": [], "deny": []},
                                                                   "source": "default"}
        # A template's default reaches every tenant's sandboxes: only the operator tenant may set it.
        t = http.put(f"/v1/templates/{tpl}/network", json={"allow": [{"domain": "0.0.0.0", "ports": [443]}]})
        assert t.status_code in (403, 422)
        t = http.put(f"/v1/templates/{tpl}/network", json={"allow": [{"cidr": "0.0.0.0/0"}]})
        assert t.status_code == 403 and t.json()["error"]["code"] == "forbidden", t.text
        assert http.get(f"/v1/sandboxes/{sbx}/network").json()["source"] == "default"
    with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"}) as op:
        t = op.put(f"/v1/templates/{tpl}/network", json={"allow": [{"domain": "pypi.org", "ports": [443]}]})
        assert t.status_code == 200 and t.json()["source"] == "template", t.text
    with acme.http() as http:
        got = http.get(f"/v1/sandboxes/{sbx}/network").json()
        assert got["source"] == "template" and got["policy"]["allow"][0]["domain"] == "pypi.org"
        policy = {"allow": [{"domain": "*.GitHub.com.", "ports": [443]}, {"cidr": "192.0.2.0/24"}],
                  "deny": [{"domain": "gist.github.com"}]}
        s = http.put(f"/v1/sandboxes/{sbx}/network", json=policy)
        assert s.status_code == 200, s.text
        assert s.json()["source"] == "sandbox" and s.json()["policy"]["allow"][0]["domain"] == "*.github.com"
        # What the gateway reads per connection: the row.
        stored = sql(stack, "SELECT egress_policy FROM sandboxes WHERE id=$1", sbx)[0]["egress_policy"]
        stored = json.loads(stored) if isinstance(stored, str) else stored
        assert stored["deny"] == [{"domain": "gist.github.com", "cidr": None, "ports": []}]
        for bad in ({"allow": [{"domain": "a b"}]}, {"allow": [{"cidr": "10.0.0.0/99"}]},
                    {"allow": [{"domain": "x.com", "cidr": "10.0.0.0/8"}]}, {"allow": [{"domain": "x.com", "ports": [0]}]},
                    {"allow": [], "extra": 1}):
            r = http.put(f"/v1/sandboxes/{sbx}/network", json=bad)
            assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", (bad, r.text)
        assert http.get(f"/v1/templates/{tpl}-missing/network").status_code == 404
        # Builds of a template that does not exist: 404, not an empty list; a template with no build of the
        # caller's: an empty list.
        r = http.get(f"/v1/templates/{tpl}-missing/builds")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert http.get(f"/v1/templates/{tpl}/builds").json() == {"builds": []}
        assert http.get("/v1/sandboxes/sbx_nope/network").status_code == 404
        entries = http.get("/v1/audit", params={"sandbox_id": sbx}).json()["entries"]
        assert [e["action"] for e in entries] == ["sandbox.network"]
    with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"}) as op:
        assert [e["action"] for e in op.get("/v1/audit", params={"action": "template.network"}).json()["entries"]]
    _, gone = template_and_sandbox(stack, acme, state="deleted")
    with acme.http() as http:
        r = http.put(f"/v1/sandboxes/{gone}/network", json={"allow": []})
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"


def test_create_stores_the_policy_and_the_placeholders(stack: Stack, acme: Tenant) -> None:
    """``POST /v1/sandboxes`` keeps ``network`` and the credential placeholders on the row (the template here
    exists on no node, so the sandbox never starts: nothing of this needs a microVM)."""
    tpl, _ = template_and_sandbox(stack, acme)
    with acme.http() as http:
        for name, scope in (("gh", {}), ("only-tpl", {"templates": [tpl]}), ("elsewhere", {"templates": ["x"]})):
            assert http.post("/v1/credentials", json={"name": name, "value": "secret-" + name,
                                                       "hosts": ["api.github.com"], **scope}).status_code == 201
        r = http.post("/v1/sandboxes", params={"wait": "false"},
                      json={"template": tpl, "network": {"allow": [{"domain": "api.github.com"}]}})
        assert r.status_code == 202, r.text
        sbx = r.json()["id"]
        assert http.get(f"/v1/sandboxes/{sbx}/network").json()["source"] == "sandbox"
        bad = http.post("/v1/sandboxes", params={"wait": "false"},
                        json={"template": tpl, "network": {"allow": [{"domain": "not valid"}]}})
        assert bad.status_code == 422
    row = sql(stack, "SELECT guest_env FROM sandboxes WHERE id=$1", sbx)[0]
    env = json.loads(row["guest_env"]) if isinstance(row["guest_env"], str) else row["guest_env"]
    assert env == {"PODBAY_CRED_GH": "podbay-credential:gh", "PODBAY_CRED_ONLY_TPL": "podbay-credential:only-tpl"}
    created = sql(stack, "SELECT actor, sandbox_id FROM audit_log WHERE action='sandbox.create' AND target=$1", sbx)
    assert created and created[0]["sandbox_id"] == sbx


def test_audit_filters_and_pages(acme: Tenant) -> None:
    with acme.http() as http:
        for i in range(5):
            assert http.post("/v1/keys", json={"name": f"k{i}"}).status_code == 201
        first = http.get("/v1/audit", params={"action": "api_key.create", "limit": 2}).json()
        assert len(first["entries"]) == 2 and first["next_before"] == first["entries"][-1]["id"]
        ids = [e["id"] for e in first["entries"]]
        rest = http.get("/v1/audit", params={"action": "api_key.create", "limit": 100,
                                             "before": first["next_before"]}).json()
        ids += [e["id"] for e in rest["entries"]]
        assert rest["next_before"] is None
        assert ids == sorted(ids, reverse=True) and len(ids) == 6  # five here, one for the tenant's first key
        assert http.get("/v1/audit", params={"since": "2999-01-01T00:00:00Z"}).json()["entries"] == []
        assert http.get("/v1/audit", params={"limit": 0}).status_code == 422


def test_audit_log_is_append_only(stack: Stack, acme: Tenant) -> None:
    with acme.http() as http:
        http.post("/v1/keys", json={"name": "x"})
    row_id = sql(stack, "SELECT max(id) AS id FROM audit_log WHERE tenant_id=$1", acme.tenant_id)[0]["id"]
    for statement in ("UPDATE audit_log SET action='forged' WHERE id=$1", "DELETE FROM audit_log WHERE id=$1"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            sql(stack, statement, row_id)
    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
        sql(stack, "TRUNCATE audit_log")
    assert sql(stack, "SELECT action FROM audit_log WHERE id=$1", row_id)[0]["action"] == "api_key.create"


def test_audit_rows_are_events_too(stack: Stack, acme: Tenant) -> None:
    """Each audit row goes out through the outbox on ``podbay.evt.audit.<tenant>.<action>``."""
    with acme.http() as http:
        key_id = http.post("/v1/keys", json={"name": "evt"}).json()["id"]
    rows = sql(stack, "SELECT subject, payload FROM outbox WHERE subject = $1 ORDER BY id DESC LIMIT 5",
               f"podbay.evt.audit.{acme.tenant_id}.api_key.create")
    payloads = [json.loads(r["payload"]) if isinstance(r["payload"], str) else r["payload"] for r in rows]
    assert any(p["data"]["target"] == key_id for p in payloads)


def test_warm_create_keeps_policy_placeholders_and_audit_event(stack: Stack, acme: Tenant) -> None:
    """The one-statement warm create (``warm.CLAIM_SQL``) writes the policy, the placeholders, the hostname (by
    ``podbay.naming``'s rule), the audit row and its event. The slot's node here is a row only: the claim is not answered and the create falls back to a
    restore that cannot happen, so only the rows the claim wrote are checked (no microVM)."""
    tpl, _ = template_and_sandbox(stack, acme)
    node = f"node-fake-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel) VALUES ($1, 'http://127.0.0.1:9',"
        " 1024, 1, 'tcg')", node)
    with acme.http() as http:
        assert http.post("/v1/credentials", json={"name": "warm-cred", "value": "v" * 20,
                                                   "hosts": ["x.example.com"]}).status_code == 201
    # The warm-pool service drops ready slots of nodes without a heartbeat (this one) every interval: a slot
    # it removed before the create claimed it just means another try.
    for _ in range(5):
        slot = f"sbx_{secrets.token_hex(12)}"
        sql(stack, "INSERT INTO warm_slots (id, node_id, template, template_digest, memory_mib, vcpus, state,"
            " ready_at) VALUES ($1, $2, $3, 'sha256:none', 256, 1, 'ready', now())", slot, node, tpl)
        with acme.http() as http:
            try:
                http.post("/v1/sandboxes", json={"template": tpl,
                                                 "network": {"allow": [{"domain": "x.example.com"}]}},
                          timeout=httpx.Timeout(15.0))
            except httpx.TimeoutException:
                pass  # the fallback restore waits for a node that has no such template
        if sql(stack, "SELECT 1 FROM sandboxes WHERE id=$1", slot):
            break
    else:
        pytest.fail("the warm-pool service removed every test slot before a create claimed it")
    row = sql(stack, "SELECT tenant_id, egress_policy, guest_env, hostname FROM sandboxes WHERE id=$1", slot)[0]
    assert row["hostname"] == sandbox_hostname(slot)
    policy = json.loads(row["egress_policy"]) if isinstance(row["egress_policy"], str) else row["egress_policy"]
    env = json.loads(row["guest_env"]) if isinstance(row["guest_env"], str) else row["guest_env"]
    assert row["tenant_id"] == acme.tenant_id and policy["allow"][0]["domain"] == "x.example.com"
    assert env == {"PODBAY_CRED_WARM_CRED": "podbay-credential:warm-cred"}
    audit = sql(stack, "SELECT id, actor, detail FROM audit_log WHERE action='sandbox.create' AND sandbox_id=$1", slot)
    assert len(audit) == 1 and _json(audit[0]["detail"])["warm"] is True
    events = sql(stack, "SELECT payload FROM outbox WHERE subject=$1",
                 f"podbay.evt.audit.{acme.tenant_id}.sandbox.create")
    payloads = [json.loads(e["payload"]) if isinstance(e["payload"], str) else e["payload"] for e in events]
    mine = [p for p in payloads if p.get("sandbox_id") == slot]
    assert len(mine) == 1 and mine[0]["data"]["audit_id"] == audit[0]["id"] and mine[0]["data"]["target"] == slot


def _json(value: object) -> dict[str, object]:
    return json.loads(value) if isinstance(value, str) else value  # type: ignore[return-value]


def test_a_template_is_not_removed_while_a_build_from_it_runs(stack: Stack, acme: Tenant) -> None:
    """A running build FROM a template holds it: removing it would leave the build's result with a parent
    that does not exist."""
    tpl, _ = template_and_sandbox(stack, acme, state="deleted")
    build = f"bld_{secrets.token_hex(8)}"
    sql(stack, "INSERT INTO template_builds (id, name, tenant_id, node_id, dockerfile, parent) VALUES"
        " ($1, $2, $3, 'node-x', 'FROM podbay/x', $4)", build, f"{tpl}-child", acme.tenant_id, tpl)
    with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"}) as op:
        r = op.delete(f"/v1/templates/{tpl}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
        assert r.json()["error"]["details"]["building"] == [f"{tpl}-child"] and "running" in r.json()["error"]["message"]
        sql(stack, "UPDATE template_builds SET state='failed', finished_at=now() WHERE id=$1", build)
        assert op.delete(f"/v1/templates/{tpl}").status_code == 204
