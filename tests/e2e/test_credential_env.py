"""End to end: a real sandbox gets credential placeholders (never values) in its command environment, keeps
its egress policy, and a fork inherits the policy and gets placeholders of its own."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import pytest
from e2e_http import api_client, sh

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from access_helpers import new_tenant  # noqa: E402


def test_placeholders_policy_and_fork(stack) -> None:  # type: ignore[no-untyped-def]
    tenant = new_tenant(stack, "cred-e2e")
    value = "ghp_" + secrets.token_hex(20)
    policy = {"allow": [{"domain": "api.github.com", "ports": [443]}], "deny": []}
    with api_client(stack, tenant.key) as c:
        r = c.post("/v1/credentials", json={"name": "gh-token", "value": value, "hosts": ["api.github.com"],
                                            "templates": ["base"]})
        assert r.status_code == 201, r.text
        r = c.post("/v1/sandboxes", json={"template": "base", "network": policy})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        children: list[str] = []
        try:
            env = sh(c, sid, "env")
            assert "PODBAY_CRED_GH_TOKEN=podbay-credential:gh-token" in env
            assert value not in env
            # The request's own env wins over a placeholder.
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["printenv", "PODBAY_CRED_GH_TOKEN"],
                                                          "env": {"PODBAY_CRED_GH_TOKEN": "mine"}})
            assert r.json()["stdout"] == "mine\n"
            # Nowhere in the guest: no process environment and no file under /etc, /root, /run or /tmp.
            found = sh(c, sid, f"grep -rl '{value}' /proc/[0-9]*/environ /etc /root /run /tmp 2>/dev/null; true")
            assert found == ""
            net = c.get(f"/v1/sandboxes/{sid}/network").json()
            assert net["source"] == "sandbox" and net["policy"]["allow"][0]["domain"] == "api.github.com"

            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
            assert r.status_code == 200, r.text
            children = [ch["sandbox_id"] for ch in r.json()["children"]]
            child = children[0]
            assert c.get(f"/v1/sandboxes/{child}/network").json() == net
            assert "PODBAY_CRED_GH_TOKEN=podbay-credential:gh-token" in sh(c, child, "env")

            actions = [e["action"] for e in c.get("/v1/audit", params={"sandbox_id": sid}).json()["entries"]]
            assert {"sandbox.create", "sandbox.exec", "sandbox.fork"} <= set(actions)
        finally:
            for child in children:
                c.delete(f"/v1/sandboxes/{child}")
            c.delete(f"/v1/sandboxes/{sid}")
