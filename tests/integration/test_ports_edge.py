"""The port edge's decisions that come before any guest (services/api/edge/ports.py), against the real stack
with sandbox rows that no node runs (no microVM): unknown sandboxes, missing and wrong credentials, another
tenant's key, the token link exchanged for a cookie, a sandbox that cannot serve (409, JSON or HTML), a public
port passing access, and the audit rows of access changes."""

from __future__ import annotations

import json

import httpx
import pytest
from access_helpers import Tenant, new_tenant, sql, template_and_sandbox

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "ports")


@pytest.fixture(scope="module")
def other(stack: Stack) -> Tenant:
    return new_tenant(stack, "ports-other")


def _get(stack: Stack, sid: str, path: str = "/", port: int = 3000, **headers: str) -> httpx.Response:
    return httpx.get(f"{stack.api_url}{path}", headers={"host": f"{port}-{sid.replace('_', '-')}.localhost",
                                                        **headers}, timeout=30)


def test_access_is_decided_before_the_guest(stack: Stack, acme: Tenant, other: Tenant) -> None:
    _, sid = template_and_sandbox(stack, acme, state="failed")
    with acme.http() as http:
        r = http.get(f"/v1/sandboxes/{sid}/ports/3000/url")
        assert r.status_code == 200, r.text
        token = r.json()["token"]
    assert _get(stack, "sbx_" + "0" * 24).status_code == 404
    r = _get(stack, sid)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert _get(stack, sid, **{"x-podbay-access-token": "f" * 64}).status_code == 403
    assert _get(stack, sid, authorization=f"Bearer {other.key}").status_code == 403
    assert _get(stack, sid, path="/?podbay_token=nope").status_code == 403
    # A good link: a cookie and the same address without the token (other parameters kept).
    r = _get(stack, sid, path=f"/a/b?x=1&podbay_token={token}")
    assert r.status_code == 303 and r.headers["location"] == "/a/b?x=1"
    assert r.headers["set-cookie"].startswith(f"podbay_port_token={token};") and "HttpOnly" in r.headers["set-cookie"]
    assert "Secure" not in r.headers["set-cookie"]
    # Behind a TLS terminator (X-Forwarded-Proto: https) the cookie is Secure.
    r = _get(stack, sid, path=f"/?podbay_token={token}", **{"x-forwarded-proto": "https"})
    assert r.status_code == 303 and r.headers["set-cookie"].endswith("; Secure")
    # Authorised, but a failed sandbox cannot serve: 409, as JSON or as a page for a browser.
    for creds in ({"x-podbay-access-token": token}, {"cookie": f"podbay_port_token={token}"},
                  {"authorization": f"Bearer {acme.key}"}):
        r = _get(stack, sid, **creds)
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state", r.text
    page = _get(stack, sid, accept="text/html,*/*", **{"x-podbay-access-token": token})
    assert page.status_code == 409 and page.headers["content-type"].startswith("text/html")
    # The path form decides the same, and adds the slash it needs.
    r = httpx.get(f"{stack.api_url}/ports/3000-{sid.replace('_', '-')}", timeout=30)
    assert r.status_code == 308 and r.headers["location"] == f"/ports/3000-{sid.replace('_', '-')}/"
    r = httpx.get(f"{stack.api_url}/ports/3000-{sid.replace('_', '-')}/", timeout=30)
    assert r.status_code == 401


def test_a_public_port_passes_access_and_each_change_is_audited(stack: Stack, acme: Tenant, other: Tenant) -> None:
    _, sid = template_and_sandbox(stack, acme, state="failed")
    with acme.http() as http, other.http() as theirs:
        assert theirs.put(f"/v1/sandboxes/{sid}/ports/3000", json={"public": True}).status_code == 404
        assert http.put(f"/v1/sandboxes/{sid}/ports/0", json={"public": True}).status_code == 422
        assert http.put(f"/v1/sandboxes/{sid}/ports/3000", json={"public": True}).status_code == 200
        assert _get(stack, sid).status_code == 409  # past access, stopped by the state
        assert _get(stack, sid, port=3001).status_code == 401  # another port stays private
        assert http.put(f"/v1/sandboxes/{sid}/ports/3000", json={"public": True}).status_code == 200  # no change
        assert http.put(f"/v1/sandboxes/{sid}/ports/3000", json={"public": False}).status_code == 200
        assert _get(stack, sid).status_code == 401
    rows = sql(stack, "SELECT action, detail FROM audit_log WHERE sandbox_id = $1 AND action LIKE 'sandbox.port.%'"
               " ORDER BY id", sid)
    assert [(r["action"], json.loads(r["detail"])["port"]) for r in rows] == [("sandbox.port.public", 3000),
                                                                 ("sandbox.port.private", 3000)]
