"""E2B's sandbox host names at the API's edges (services/api/edge/envd.parse_host, used by EnvdRouting and the
port edge), over the TLS edge as the SDK reaches them and over plain HTTP with a forged Host: a name opens
only the sandbox it spells, in either spelling of its id (``sbx-<hex>``, ``sbx_<hex>``), and only with that
sandbox's own token; another tenant's id, upper case, an encoded ``_``, extra labels or an out-of-range port
reach no sandbox and no route (400), and a TLS connection opened for one spelling does not carry a request for
another name (421).

Boundary: tenant vs tenant at the envd and port edges (docs/SECURITY.md). Sandbox rows that no node runs: no
microVM needed.
"""

from __future__ import annotations

import ssl

import httpx
import pytest
from access_helpers import Tenant, new_tenant, template_and_sandbox

from podbay.devstack.stack import Stack


@pytest.fixture(scope="module")
def mine(stack: Stack) -> Tenant:
    return new_tenant(stack, "hostids")


@pytest.fixture(scope="module")
def theirs(stack: Stack) -> Tenant:
    return new_tenant(stack, "hostids-other")


def _dash(sid: str) -> str:
    return sid.replace("_", "-", 1)


def _token(stack: Stack, tenant: Tenant, sid: str) -> str:
    r = httpx.get(f"{stack.api_url}/e2b/sandboxes/{_dash(sid)}", headers={"x-api-key": tenant.key}, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["envdAccessToken"])


def _tls(stack: Stack) -> ssl.SSLContext:
    bundle = stack.edge_client()["ca_bundle"]
    if not bundle:
        pytest.skip("the stack runs no TLS edge of its own")
    return ssl.create_default_context(cafile=bundle)


def test_over_tls_a_host_opens_only_its_own_sandbox_with_its_own_token(stack: Stack, mine: Tenant,
                                                                      theirs: Tenant) -> None:
    domain = stack.env["PODBAY_E2B_DOMAIN"]
    _, a = template_and_sandbox(stack, mine, state="running")
    _, b = template_and_sandbox(stack, theirs, state="running")
    tok_a, tok_b = _token(stack, mine, a), _token(stack, theirs, b)
    with httpx.Client(verify=_tls(stack), timeout=30, trust_env=False) as client:
        for spelling in (_dash(a), a):
            url = f"https://49983-{spelling}.{domain}/health"
            assert client.get(url, headers={"x-access-token": tok_a}).status_code == 204
            assert client.get(url, headers={"x-access-token": tok_b}).status_code == 401
            assert client.get(url).status_code == 401
        for spelling in (_dash(b), b):
            r = client.get(f"https://49983-{spelling}.{domain}/health", headers={"x-access-token": tok_a})
            assert r.status_code == 401 and r.json()["code"] == 401, r.text
        # A connection opened (SNI, certificate) for one spelling carries no request for another name.
        r = client.get(f"https://49983-{_dash(a)}.{domain}/health",
                       headers={"x-access-token": tok_a, "host": f"49983-{a}.{domain}"})
        assert r.status_code == 421


@pytest.mark.parametrize("label", [
    "49983-{dash_upper}", "49983-{enc}", "49983-{enc_upper}", "49983-{dash}.extra", "extra.49983-{dash}",
    "0-{dash}", "65536-{dash}", "49983-{dash}-", "49983-sbx--{hex}", "49983-vol_{hex}",
])
def test_malformed_hosts_reach_no_sandbox_and_no_route(stack: Stack, mine: Tenant, label: str) -> None:
    domain = stack.env["PODBAY_E2B_DOMAIN"]
    _, a = template_and_sandbox(stack, mine, state="running")
    tok = _token(stack, mine, a)
    head = label.format(dash=_dash(a), dash_upper=_dash(a).upper(), enc=a.replace("_", "%5f"),
                        enc_upper=a.replace("_", "%5F"), hex=a[4:])
    host = f"{head}.{domain}"
    for path, headers in (("/health", {"x-access-token": tok}), ("/files?path=x", {"x-access-token": tok}),
                          ("/", {}), (f"/e2b/sandboxes/{_dash(a)}", {"x-api-key": mine.key})):
        r = httpx.get(f"{stack.api_url}{path}", headers={"host": host, **headers}, timeout=30)
        assert r.status_code == 400 and r.json()["code"] == 400, (host, path, r.text)


def test_the_e2b_sandbox_id_header_takes_only_the_two_spellings(stack: Stack, mine: Tenant, theirs: Tenant) -> None:
    _, a = template_and_sandbox(stack, mine, state="running")
    _, b = template_and_sandbox(stack, theirs, state="running")
    tok = _token(stack, mine, a)

    def health(sid: str) -> int:
        return httpx.get(f"{stack.api_url}/health", headers={"e2b-sandbox-id": sid, "x-access-token": tok},
                         timeout=30).status_code

    assert health(_dash(a)) == health(a) == 204
    assert health(_dash(b)) == health(b) == 401
    for odd in (a.upper(), _dash(a).upper(), a.replace("_", "%5f"), f"{_dash(a)}.x", f"{a}/../{b}"):
        assert health(odd) == 400, odd
