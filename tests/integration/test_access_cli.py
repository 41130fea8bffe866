"""``podbay credential|key|audit|sandbox network`` against the real stack, as a user runs them."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from access_helpers import Tenant, new_tenant, template_and_sandbox

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


def _cli(stack: Stack, tenant: Tenant, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("podbay")
    env = {**stack.env, "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": tenant.key}
    return subprocess.run([str(exe), *args], env=env, input=stdin, capture_output=True, text=True, timeout=300)


def test_credentials_from_stdin_and_file(stack: Stack, tmp_path: Path) -> None:
    t = new_tenant(stack, "cli")
    value = "tok_" + secrets.token_hex(16)
    r = _cli(stack, t, "credential", "add", "github", "--host", "api.github.com", "--rate-limit", "10",
             stdin=value + "\n")
    assert r.returncode == 0, r.stderr
    assert "PODBAY_CRED_GITHUB=podbay-credential:github" in r.stdout and value not in r.stdout + r.stderr
    f = tmp_path / "token"
    f.write_text(value)
    r = _cli(stack, t, "credential", "add", "second", "--host", "*.example.com", "--value-file", str(f), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["hosts"] == ["*.example.com"]
    listed = _cli(stack, t, "credential", "list", "--json")
    assert [c["name"] for c in json.loads(listed.stdout)] == ["github", "second"] and value not in listed.stdout
    dup = _cli(stack, t, "credential", "add", "github", "--host", "x.com", stdin="v")
    assert dup.returncode == 2 and dup.stderr.startswith("error: ") and "(conflict)" in dup.stderr
    bad = _cli(stack, t, "credential", "add", "third", "--host", "not a host", stdin=value)
    assert bad.returncode == 2 and "hosts" in bad.stderr and value not in bad.stderr
    empty = _cli(stack, t, "credential", "add", "fourth", "--host", "x.com", stdin="")
    assert empty.returncode == 2 and "empty" in empty.stderr
    assert _cli(stack, t, "credential", "rm", "second").returncode == 0
    assert _cli(stack, t, "credential", "rm", "second").returncode == 2


def test_keys_audit_and_network(stack: Stack) -> None:
    t = new_tenant(stack, "cli")
    made = _cli(stack, t, "key", "create", "ci")
    assert made.returncode == 0 and made.stdout.startswith("pb_") and "not shown again" in made.stderr
    keys = json.loads(_cli(stack, t, "key", "list", "--json").stdout)
    assert len(keys) == 2 and made.stdout.strip() not in json.dumps(keys)
    ci = next(k["id"] for k in keys if k["name"] == "ci")
    assert _cli(stack, t, "key", "revoke", ci).returncode == 0
    _, sbx = template_and_sandbox(stack, t)
    r = _cli(stack, t, "sandbox", "network", "set", sbx, "--allow", "api.github.com:443", "--allow-cidr",
             "192.0.2.0/24", "--deny", "gist.github.com")
    assert r.returncode == 0, r.stderr
    got = json.loads(_cli(stack, t, "sandbox", "network", "get", sbx, "--json").stdout)
    assert got["source"] == "sandbox"
    assert [(x["domain"], x["cidr"], x["ports"]) for x in got["policy"]["allow"]] == [
        ("api.github.com", None, [443]), (None, "192.0.2.0/24", [])]
    assert got["policy"]["deny"][0]["domain"] == "gist.github.com"
    bad = _cli(stack, t, "sandbox", "network", "set", sbx, "--allow", "bad host")
    assert bad.returncode == 2 and "invalid rule" in bad.stderr
    audit = json.loads(_cli(stack, t, "audit", "--json", "--limit", "10").stdout)
    assert [e["action"] for e in audit["entries"]][:3] == ["sandbox.network", "api_key.revoke", "api_key.create"]
    only = json.loads(_cli(stack, t, "audit", "--json", "--sandbox", sbx).stdout)
    assert [e["action"] for e in only["entries"]] == ["sandbox.network"]
