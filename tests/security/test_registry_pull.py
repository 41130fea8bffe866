"""Image vs host, the pull: ``FROM docker://`` makes the node pull from a registry over its own network, outside
every egress policy, so only the operator's tenant may build from a registry (services/api/routes/templates.py);
other tenants get 403 before any build starts and put images in the build context instead."""

from __future__ import annotations

from typing import Any

import httpx
from access_helpers import new_tenant, sql

DOCKERFILE = "FROM docker://registry.invalid/library/busybox:latest\nRUN true\n"


def test_a_tenant_cannot_make_the_node_pull_from_a_registry(stack: Any) -> None:
    tenant = new_tenant(stack, "pull")
    with tenant.http() as c:
        r = c.post("/v1/templates", data={"name": "pulled", "dockerfile": DOCKERFILE})
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "forbidden" and err["details"]["from"].startswith("docker://")
    assert "oci-archive" in err["message"]
    assert not sql(stack, "SELECT 1 FROM template_builds WHERE name='pulled'")


def test_the_operator_tenant_is_not_refused_a_registry_pull(stack: Any) -> None:
    # The stack's dev key is the operator's tenant: its build starts (and fails later, on the node, for want
    # of the registry), so the answer is never the tenant refusal.
    with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}"},
                      timeout=120) as c, c.stream("POST", "/v1/templates",
                                                  data={"name": "pulled-op", "dockerfile": DOCKERFILE}) as r:
        assert r.status_code != 403, r.read()
