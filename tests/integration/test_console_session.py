"""The web console's session and CSRF (services/api/console/session.py) against the real stack: an API key
signs in to an HttpOnly, SameSite=Strict cookie; the cookie reads the public API as that key's tenant, and
changes nothing without the session's CSRF token; the terminal WebSocket needs the token and the API's own
origin, and finds only the caller's sandboxes. No microVM is needed (sandbox rows that no node runs)."""

from __future__ import annotations

import asyncio
from contextlib import closing
from typing import Any

import httpx
import pytest
import websockets
from access_helpers import Tenant, new_tenant, sql, template_and_sandbox
from websockets.exceptions import InvalidStatus

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def alice(stack: Stack) -> Tenant:
    return new_tenant(stack, "console-a")


@pytest.fixture(scope="module")
def bob(stack: Stack) -> Tenant:
    return new_tenant(stack, "console-b")


def _sign_in(stack: Stack, key: str, **headers: str) -> tuple[httpx.Client, dict[str, Any], httpx.Response]:
    client = httpx.Client(base_url=stack.api_url, timeout=30)
    r = client.post("/console/session", json={"key": key}, headers=headers)
    assert r.status_code == 200, r.text
    return client, r.json(), r


def test_sign_in_sets_a_strict_httponly_cookie_and_never_echoes_the_key(stack: Stack, alice: Tenant) -> None:
    with httpx.Client(base_url=stack.api_url, timeout=30) as anon:
        bad = anon.post("/console/session", json={"key": "pb_00000000_" + "0" * 40})
        assert bad.status_code == 401 and "set-cookie" not in bad.headers
        assert anon.get("/console/session").status_code == 401
    client, info, r = _sign_in(stack, alice.key)
    with closing(client):
        cookie = r.headers["set-cookie"]
        attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
        assert cookie.startswith("podbay_session=") and {"httponly", "path", "max-age"} <= attrs
        assert "samesite=strict" in cookie.lower() and "secure" not in attrs  # plain http here
        assert alice.key not in r.text and alice.key not in cookie
        assert info["tenant_id"] == alice.tenant_id and info["operator"] is False and len(info["csrf_token"]) >= 40
        # Only a digest of the session id is stored.
        sid = client.cookies["podbay_session"]
        rows = sql(stack, "SELECT id_hash FROM console_sessions WHERE tenant_id=$1", alice.tenant_id)
        assert rows and all(sid.encode() not in bytes(row["id_hash"]) for row in rows)
        assert client.get("/console/session").json()["csrf_token"] == info["csrf_token"]
    _, _, https = _sign_in(stack, alice.key, **{"x-forwarded-proto": "https"})
    assert "secure" in {a.strip().lower() for a in https.headers["set-cookie"].split(";")}


def test_the_cookie_reads_as_its_tenant_and_changes_only_with_the_csrf_token(stack: Stack, alice: Tenant,
                                                                              bob: Tenant) -> None:
    client, info, _ = _sign_in(stack, alice.key)
    _, b_sandbox = template_and_sandbox(stack, bob)
    with closing(client):
        listed = client.get("/v1/keys")
        assert listed.status_code == 200
        assert {k["id"] for k in listed.json()["keys"]} == {
            r["id"] for r in sql(stack, "SELECT id FROM api_keys WHERE tenant_id=$1", alice.tenant_id)}
        assert client.get(f"/v1/sandboxes/{b_sandbox}").status_code == 404  # tenant-scoped like the key
        before = sql(stack, "SELECT count(*) AS n FROM api_keys WHERE tenant_id=$1", alice.tenant_id)[0]["n"]
        for headers in ({}, {"x-csrf-token": "x" * 43}, {"x-csrf-token": ""}):
            refused = client.post("/v1/keys", json={"name": "csrf-less"}, headers=headers)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "csrf_refused"
        for method in ("PUT", "DELETE", "PATCH"):
            r = client.request(method, f"/v1/sandboxes/{b_sandbox}")
            assert r.status_code in (403, 405), (method, r.status_code)
            if r.status_code == 403:
                assert r.json()["error"]["code"] == "csrf_refused"
        assert client.delete("/console/session").status_code == 403  # signing out is a change too
        after = sql(stack, "SELECT count(*) AS n FROM api_keys WHERE tenant_id=$1", alice.tenant_id)[0]["n"]
        assert after == before
        made = client.post("/v1/keys", json={"name": "with-csrf"}, headers={"x-csrf-token": info["csrf_token"]})
        assert made.status_code == 201, made.text
        # A bearer key always wins over the cookie (API clients never meet CSRF): this acts as bob.
        as_bob = client.post("/v1/keys", json={"name": "bearer"}, headers={"authorization": f"Bearer {bob.key}"})
        assert as_bob.status_code == 201
        assert sql(stack, "SELECT tenant_id FROM api_keys WHERE id=$1", as_bob.json()["id"])[0]["tenant_id"] == bob.tenant_id
        # A change through the session: revoking the key it just made.
        revoked = client.delete(f"/v1/keys/{made.json()['id']}", headers={"x-csrf-token": info["csrf_token"]})
        assert revoked.status_code in (200, 204)
    c2, info2, _ = _sign_in(stack, alice.key)
    with closing(c2):
        key2 = c2.post("/v1/keys", json={"name": "short-lived"}, headers={"x-csrf-token": info2["csrf_token"]}).json()
    c3, info3, _ = _sign_in(stack, key2["key"])
    with closing(c3):
        assert c3.get("/v1/sandboxes").status_code == 200
        with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {alice.key}"}) as admin:
            assert admin.delete(f"/v1/keys/{key2['id']}").status_code in (200, 204)
        assert c3.get("/v1/sandboxes").status_code == 401
        assert c3.get("/console/session").status_code == 401


def test_sessions_expire_and_sign_out_ends_them(stack: Stack, alice: Tenant) -> None:
    client, info, _ = _sign_in(stack, alice.key)
    with closing(client):
        sql(stack, "UPDATE console_sessions SET expires_at = now() - interval '1 second' WHERE csrf_token=$1",
            info["csrf_token"])
        assert client.get("/v1/sandboxes").status_code == 401
    client, info, _ = _sign_in(stack, alice.key)
    with closing(client):
        assert client.get("/v1/sandboxes").status_code == 200
        out = client.delete("/console/session", headers={"x-csrf-token": info["csrf_token"]})
        assert out.status_code == 204 and "max-age=0" in out.headers["set-cookie"].lower()
        assert not sql(stack, "SELECT 1 FROM console_sessions WHERE csrf_token=$1", info["csrf_token"])


def test_page_and_assets(stack: Stack) -> None:
    with httpx.Client(base_url=stack.api_url, timeout=30) as anon:
        page = anon.get("/console")
        assert page.status_code == 200, page.text[:200]
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "script-src 'self';" in csp
        assets = [p.split('"')[0] for p in page.text.split('/console/assets/')[1:]]
        assert assets and all(anon.get(f"/console/assets/{a}").status_code == 200 for a in assets)
        for bad in ("..%2f..%2fpyproject.toml", "%2e%2e", "index.html", ".built", "x.py"):
            assert anon.get(f"/console/assets/{bad}").status_code == 404, bad


def _ws(stack: Stack, path: str, **headers: str) -> int:
    """The outcome of a WebSocket handshake: its HTTP refusal status, or 101 when it was accepted."""

    async def run() -> int:
        url = stack.api_url.replace("http://", "ws://") + path
        try:
            async with websockets.connect(url, additional_headers=headers, open_timeout=20) as ws:
                await ws.close()
                return 101
        except InvalidStatus as exc:
            return int(exc.response.status_code)

    return asyncio.run(run())


def test_terminal_websocket_needs_the_token_the_origin_and_the_tenant(stack: Stack, alice: Tenant,
                                                                     bob: Tenant) -> None:
    client, info, _ = _sign_in(stack, alice.key)
    _, a_sandbox = template_and_sandbox(stack, alice)
    _, b_sandbox = template_and_sandbox(stack, bob)
    host = stack.api_url.split("://", 1)[1]
    cookie = f"podbay_session={client.cookies['podbay_session']}"
    own = {"cookie": cookie, "origin": f"http://{host}"}
    csrf = info["csrf_token"]
    with closing(client):
        assert _ws(stack, f"/v1/sandboxes/{a_sandbox}/pty", **own) == 403  # no token
        assert _ws(stack, f"/v1/sandboxes/{a_sandbox}/pty?csrf={'x' * 43}", **own) == 403
        assert _ws(stack, f"/v1/sandboxes/{a_sandbox}/pty?csrf={csrf}", cookie=cookie,
                   origin="http://evil.example") == 403
        assert _ws(stack, f"/v1/sandboxes/{b_sandbox}/pty?csrf={csrf}", **own) == 404  # bob's
        assert _ws(stack, f"/v1/sandboxes/{a_sandbox}/pty?csrf={csrf}", **own) == 409  # alice's, not running
        assert _ws(stack, f"/v1/sandboxes/{a_sandbox}/pty") == 401
        assert _ws(stack, f"/v1/sandboxes/{b_sandbox}/pty", authorization=f"Bearer {alice.key}") == 404
