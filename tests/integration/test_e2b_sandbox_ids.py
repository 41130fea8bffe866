"""E2B's spelling of sandbox ids (``sbx-<hex>``, podbay.naming.e2b_sandbox_id) against the real stack, with
sandbox rows that no node runs (no microVM): E2B's REST answers spell ids so, every E2B path and envd host
takes either spelling (the access tokens are the same), and another tenant's id in either spelling, an
encoded ``_``, upper case or extra host labels reach nothing."""

from __future__ import annotations

import httpx
import pytest
from access_helpers import Tenant, new_tenant, template_and_sandbox

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "e2bids")


@pytest.fixture(scope="module")
def other(stack: Stack) -> Tenant:
    return new_tenant(stack, "e2bids-other")


def _e2b(stack: Stack, tenant: Tenant, method: str, path: str) -> httpx.Response:
    return httpx.request(method, f"{stack.api_url}/e2b{path}", headers={"x-api-key": tenant.key}, timeout=30)


def _dash(sid: str) -> str:
    return sid.replace("_", "-", 1)


def test_rest_answers_spell_ids_as_host_labels_and_take_both_spellings(stack: Stack, acme: Tenant,
                                                                       other: Tenant) -> None:
    _, sid = template_and_sandbox(stack, acme, state="paused")
    by_dash, by_underscore = (_e2b(stack, acme, "GET", f"/sandboxes/{s}") for s in (_dash(sid), sid))
    assert by_dash.status_code == by_underscore.status_code == 200, by_dash.text
    assert by_dash.json()["sandboxID"] == by_underscore.json()["sandboxID"] == _dash(sid)
    # One sandbox, one envd token, whichever spelling asked.
    assert by_dash.json()["envdAccessToken"] == by_underscore.json()["envdAccessToken"]
    listed = _e2b(stack, acme, "GET", "/v2/sandboxes?state=paused").json()
    assert _dash(sid) in {s["sandboxID"] for s in listed} and sid not in {s["sandboxID"] for s in listed}
    # Calls with an id in the path act on it in either spelling: set_timeout, then the other tenant's view.
    for s in (_dash(sid), sid):
        r = httpx.post(f"{stack.api_url}/e2b/sandboxes/{s}/timeout", json={"timeout": 300},
                       headers={"x-api-key": acme.key}, timeout=30)
        assert r.status_code == 204, r.text
    # The native API is unchanged: it spells the id with "_".
    with acme.http() as http:
        assert http.get(f"/v1/sandboxes/{sid}").json()["id"] == sid


def test_other_tenants_ids_and_odd_spellings_are_not_found(stack: Stack, acme: Tenant, other: Tenant) -> None:
    _, sid = template_and_sandbox(stack, acme, state="paused")
    for s in (_dash(sid), sid):
        for method, path in (("GET", f"/sandboxes/{s}"), ("DELETE", f"/sandboxes/{s}"),
                             ("POST", f"/sandboxes/{s}/pause"), ("POST", f"/v2/sandboxes/{s}/connect")):
            r = _e2b(stack, other, method, path)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["code"] == 404
    for odd in (sid.upper(), _dash(sid).upper(), sid.replace("_", "%5f"), sid.replace("_", "%5F"),
                _dash(sid).replace("-", "%2d"), "sbx--" + sid[4:]):
        r = _e2b(stack, acme, "GET", f"/sandboxes/{odd}")
        assert r.status_code == 404, (odd, r.text)
    # A NUL byte is bad text wherever it stands (as for any E2B path): 400, and the sandbox is not reached.
    r = _e2b(stack, acme, "GET", f"/sandboxes/{_dash(sid)}%00")
    assert r.status_code == 400 and "NUL" in r.json()["message"], r.text
    assert _e2b(stack, acme, "GET", f"/sandboxes/{_dash(sid)}").status_code == 200  # the id itself is there


def test_envd_by_host_name_takes_either_spelling_and_refuses_malformed_hosts(stack: Stack, acme: Tenant,
                                                                             other: Tenant) -> None:
    domain = stack.env["PODBAY_E2B_DOMAIN"]
    _, sid = template_and_sandbox(stack, acme, state="running")
    _, theirs = template_and_sandbox(stack, other, state="running")
    token = _e2b(stack, acme, "GET", f"/sandboxes/{_dash(sid)}").json()["envdAccessToken"]

    def health(host: str, tok: str = token, **headers: str) -> httpx.Response:
        return httpx.get(f"{stack.api_url}/health", headers={"host": host, "x-access-token": tok, **headers},
                         timeout=30)

    for s in (_dash(sid), sid):
        assert health(f"49983-{s}.{domain}").status_code == 204
        # E2B_SANDBOX_URL's form: the id in E2b-Sandbox-Id.
        r = httpx.get(f"{stack.api_url}/health", headers={"e2b-sandbox-id": s, "x-access-token": token}, timeout=30)
        assert r.status_code == 204, r.text
    # My token opens nothing of the other tenant's, in either spelling.
    for s in (_dash(theirs), theirs):
        r = health(f"49983-{s}.{domain}")
        assert r.status_code == 401 and r.json()["code"] == 401
    for host in (f"49983-{_dash(sid).upper()}.{domain}", f"49983-{sid.replace('_', '%5f')}.{domain}",
                 f"49983-{_dash(sid)}.extra.{domain}", f"x.49983-{_dash(sid)}.{domain}",
                 f"70000-{_dash(sid)}.{domain}", f"49983-{_dash(sid)}-.{domain}"):
        r = health(host)
        assert r.status_code in (400, 502) and r.status_code != 204, (host, r.text)
    # Refused before any route: an API call under a malformed sandbox host is not served either.
    r = httpx.get(f"{stack.api_url}/e2b/sandboxes/{_dash(sid)}",
                  headers={"host": f"49983-{_dash(sid)}.extra.{domain}", "x-api-key": acme.key}, timeout=30)
    assert r.status_code == 400 and r.json()["code"] == 400


def test_port_hosts_take_either_spelling(stack: Stack, acme: Tenant) -> None:
    domain = stack.env["PODBAY_E2B_DOMAIN"]
    _, sid = template_and_sandbox(stack, acme, state="failed")
    for s in (_dash(sid), sid):
        # Known (so not 404), private without an e2b_sandboxes row: E2B's 403 asks for the traffic token.
        r = httpx.get(f"{stack.api_url}/", headers={"host": f"8000-{s}.{domain}"}, timeout=30)
        assert r.status_code == 403 and "e2b-traffic-access-token" in r.json()["error"]["message"], r.text
    missing = "sbx-" + "0" * 20
    assert httpx.get(f"{stack.api_url}/", headers={"host": f"8000-{missing}.{domain}"}, timeout=30).status_code == 404
    r = httpx.get(f"{stack.api_url}/", headers={"host": f"8000-{_dash(sid).upper()}.{domain}"}, timeout=30)
    assert r.status_code == 400
