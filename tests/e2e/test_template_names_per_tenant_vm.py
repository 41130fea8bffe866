"""End to end: two tenants both build a template named ``web`` (template names are per tenant,
services/api/services/template_access.py); each gets its own build under its own internal key, and each tenant's
sandbox of ``web`` runs its own content. A credential scoped to ``web`` follows the name its tenant gave."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, sh

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from access_helpers import new_tenant, sql  # noqa: E402


def _build(c: httpx.Client, name: str, marker: str) -> dict[str, Any]:
    """Build ``name`` FROM base with one RUN that writes ``marker``; the ``done`` event's template."""
    r = c.post("/v1/templates", data={"name": name, "dockerfile": f"FROM base\nRUN echo {marker} > /etc/who\n"})
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert events[-1]["type"] == "done", events[-3:]
    return dict(events[-1]["template"])


def test_two_tenants_build_and_run_their_own_web(stack: Any) -> None:
    web = f"web-{secrets.token_hex(3)}"
    tenants = [new_tenant(stack, "names-a"), new_tenant(stack, "names-b")]
    markers = [f"tenant-{i}-{secrets.token_hex(4)}" for i in range(2)]
    sandboxes: list[tuple[httpx.Client, str]] = []
    try:
        for t, marker in zip(tenants, markers, strict=True):
            with api_client(stack, t.key) as c:
                built = _build(c, web, marker)
                assert built["name"] == web and built["parent"] == "base"  # the tenant's names, not keys
        keys = sql(stack, "SELECT name, owner_tenant FROM templates WHERE alias=$1 AND deleted_at IS NULL", web)
        assert len({r["name"] for r in keys}) == 2 and web not in {r["name"] for r in keys}
        assert {r["owner_tenant"] for r in keys} == {t.tenant_id for t in tenants}
        for t, marker in zip(tenants, markers, strict=True):
            c = api_client(stack, t.key)
            r = c.post("/v1/credentials", json={"name": "web-token", "value": "v-" + secrets.token_hex(8),
                                                "hosts": ["example.com"], "templates": [web]})
            assert r.status_code == 201, r.text
            r = c.post("/v1/sandboxes", json={"template": web})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            sandboxes.append((c, sid))
            assert r.json()["template"] == web
            assert sh(c, sid, "cat /etc/who").strip() == marker
            assert "PODBAY_CRED_WEB_TOKEN=podbay-credential:web-token" in sh(c, sid, "env")
            assert [t["name"] for t in c.get("/v1/templates").json()["templates"]].count(web) == 1
    finally:
        for c, sid in sandboxes:
            c.delete(f"/v1/sandboxes/{sid}")
            c.close()
