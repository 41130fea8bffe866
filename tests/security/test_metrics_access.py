"""Client vs operator: ``/metrics`` needs credentials and its labels carry no tenant or sandbox ids
(docs/SECURITY.md; podbay.metricsauth, services/api/app.py, services/api/edge/ports_access.py)."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from access_helpers import new_tenant, second_api, template_and_sandbox

# Ids podbay mints (podbay.outbox.new_id and the tests' own rows): sbx_..., ten_..., key_..., op_...
_ID = re.compile(r"\b(sbx|ten|key|op|vol|snap|sch|wh|cred)[_-][0-9a-f]{8,}")


def _label_values(text: str) -> set[str]:
    return {v for fam in text_string_to_metric_families(text) for s in fam.samples for v in s.labels.values()}


def test_api_metrics_refuse_anonymous_and_tenants_and_answer_the_operator(stack: Any) -> None:
    url = f"{stack.api_url}/metrics"
    anon = httpx.get(url, timeout=10)
    assert anon.status_code == 401 and anon.json()["error"]["code"] == "unauthorized"
    assert httpx.get(url, headers={"authorization": "Bearer pb_00000000_" + "0" * 40}, timeout=10).status_code == 401
    tenant = new_tenant(stack, "metrics")
    other = httpx.get(url, headers={"authorization": f"Bearer {tenant.key}"}, timeout=10)
    assert other.status_code == 403 and other.json()["error"]["code"] == "forbidden"
    assert "podbay_" not in other.text
    ok = httpx.get(url, headers={"authorization": f"Bearer {stack.api_key}"}, timeout=10)  # the operator tenant
    assert ok.status_code == 200 and "process_cpu_seconds_total" in ok.text


def test_api_metrics_token(stack: Any, tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    with second_api(stack, tmp_path / "api.log", PODBAY_METRICS_TOKEN=token) as api:
        assert httpx.get(f"{api}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{api}/metrics", headers={"authorization": "Bearer wrong"}, timeout=10).status_code == 401
        r = httpx.get(f"{api}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=10)
        assert r.status_code == 200 and "process_cpu_seconds_total" in r.text


def test_no_metric_label_names_a_sandbox_or_tenant(stack: Any) -> None:
    tenant = new_tenant(stack, "labels")
    _, sbx = template_and_sandbox(stack, tenant)
    label = sbx.replace("_", "-")
    with tenant.http() as c:
        # Routes with the id in their path (route templates must be the label, not the raw path) ...
        for path in (f"/v1/sandboxes/{sbx}", f"/v1/sandboxes/{sbx}/files?path=/etc/hostname",
                     f"/v1/sandboxes/sbx_{'ab' * 10}", f"/e2b/sandboxes/{sbx}", f"/nowhere/{sbx}"):
            c.get(path)
        # ... and the port edge, which knows the sandbox (its row exists) before it authorises the caller.
        for path in (f"/ports/8080-{label}/", f"/ports/3000-{label}/x"):
            httpx.get(f"{stack.api_url}{path}", timeout=10)
        httpx.get(f"{stack.api_url}/", headers={"host": f"8080-{label}.{stack.env.get('PODBAY_PORTS_DOMAIN', 'x')}"},
                  timeout=10)
    text = httpx.get(f"{stack.api_url}/metrics", headers={"authorization": f"Bearer {stack.api_key}"},
                     timeout=10).text
    assert 'podbay_port_requests_total{' in text  # the port edge's series exist: the check below saw them
    values = _label_values(text)
    leaked = {v for v in values if _ID.search(v) or sbx in v or label in v or tenant.tenant_id in v
              or tenant.name in v}
    assert not leaked, f"metric labels carrying ids: {sorted(leaked)}"
