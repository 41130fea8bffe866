"""Tenant vs tenant for the console's resource samples, ``GET /console/sandboxes/{id}/metrics``
(services/api/console/routes.py): a tenant's console session reads its own sandbox's samples; another
tenant's session (or key) gets 404 (400 or 422 for an id refused earlier) with none of them, for the plain
id and for encoded forms of it and of other paths; without a session or key, 401. Rows set up directly (no
microVM: a paused sandbox answers the samples kept so far, without sampling)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import httpx
from access_helpers import Tenant, new_tenant, sql, template_and_sandbox

from podbay.devstack.stack import Stack


@contextmanager
def _session(tenant: Tenant) -> Iterator[httpx.Client]:
    """A client holding ``tenant``'s console session cookie (as a browser would)."""
    with httpx.Client(base_url=tenant.api_url, timeout=30) as c:
        assert c.post("/console/session", json={"key": tenant.key}).status_code == 200
        yield c


def test_another_tenant_never_reads_a_sandboxs_samples(stack: Stack) -> None:
    a, b = new_tenant(stack, "cmeta"), new_tenant(stack, "cmetb")
    _, sbx = template_and_sandbox(stack, a, state="paused")
    sample = {"timestamp": "2026-01-01T00:00:00Z", "timestampUnix": 1767225600, "cpuCount": 1, "cpuUsedPct": 12.5,
              "memUsed": 1, "memTotal": 2, "memCache": 0, "diskUsed": 3, "diskTotal": 4}
    sql(stack, "INSERT INTO e2b_metrics (sandbox_id, at, sample) VALUES ($1, $2, $3::jsonb)", sbx,
        datetime(2026, 1, 1, tzinfo=UTC), json.dumps(sample))
    with _session(a) as own:
        r = own.get(f"/console/sandboxes/{sbx}/metrics")
        assert r.status_code == 200 and r.json() == [sample], r.text
    with _session(b) as other, b.http() as other_key:
        for client in (other, other_key):
            for path in (sbx, sbx.upper(), f"{sbx}%00", f"..%2F{sbx}", f"%2e%2e/sandboxes/{sbx}", f"{sbx}%2F..",
                         sbx.replace("_", "%5F")):
                r = client.get(f"/console/sandboxes/{path}/metrics")
                assert r.status_code in (400, 404, 422), (path, r.status_code, r.text)
                assert "cpuUsedPct" not in r.text and "12.5" not in r.text, (path, r.text)
    with httpx.Client(base_url=a.api_url, timeout=30) as nobody:
        assert nobody.get(f"/console/sandboxes/{sbx}/metrics").status_code == 401
