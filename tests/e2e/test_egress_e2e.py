"""Secrets never enter the sandbox, end to end (issue "Secrets never enter the sandbox"; docs/DESIGN.md §6): a real
microVM behind its tap, the node's nftables table, the real gateway of the stack, and an HTTPS destination in
its own network namespace (so it is reachable from the host, but from a guest only through the gateway).

The guest calls the allowed destination over TLS: the request arrives there with the credential injected,
while the guest sees a redacted echo, finds the value nowhere (environment, files, /proc) and only the
``PODBAY_CRED_<NAME>`` placeholder; a name outside the policy does not resolve, a plain HTTP request to the
destination's address gets the gateway's 403 ``egress_denied``; the audit log has the credential use and the
denial.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from e2e_http import api_client

from podbay.naming import sandbox_id_from_e2b

pytestmark = pytest.mark.e2e

_PEERS = Path(__file__).parent.parent / "integration" / "gateway_peers.py"
# Documentation addresses (RFC 5737), outside the sandbox network; the test stacks' operator allow-list opens
# them (PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS), as private addresses are shut to every sandbox otherwise.
_UP_HOST, _UP_NS = "198.51.100.1", "198.51.100.2"
_ALLOWED, _OTHER = "api.upstream.test", "other.upstream.test"

#: Runs in the guest: ``python3 -c GUEST_CALLS``; prints one JSON object.
GUEST_CALLS = r"""
import json, urllib.request, urllib.error
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return {"status": r.status, "headers": dict(r.headers), "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "headers": dict(e.headers), "body": e.read().decode()}
    except Exception as e:
        return {"error": repr(e)}
print(json.dumps({"allowed": get("https://%s/repos/echo" % ALLOWED), "other_path": get("https://%s/else" % ALLOWED),
                  "denied_name": get("https://%s/" % OTHER), "denied_addr": get("http://%s/" % ADDR),
                  "closed_port": get("http://%s:8080/" % ADDR)}))
"""

#: Runs in the guest with the secret REVERSED as argv[1] (so no command line holds it): every file under
#: the usual writable trees, and every process's environ and cmdline, searched for the value.
GUEST_SCAN = r"""
import os, sys
needle = sys.argv[1][::-1].encode()
hits = []
for root in ("/etc", "/root", "/home", "/tmp", "/var", "/usr/local", "/opt", "/run", "/srv"):
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.path.islink(p) or os.path.getsize(p) > 8 << 20:
                    continue
                with open(p, "rb") as fh:
                    if needle in fh.read():
                        hits.append(p)
            except OSError:
                pass
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for what in ("environ", "cmdline"):
            try:
                with open("/proc/%s/%s" % (pid, what), "rb") as fh:
                    if needle in fh.read():
                        hits.append("/proc/%s/%s" % (pid, what))
            except OSError:
                pass
print("\n".join(hits) or "clean")
"""


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


def _pki(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a leaf for both test names: ``(ca.pem, leaf.pem, leaf.key)``."""
    now = dt.datetime.now(dt.UTC)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "upstream test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _ALLOWED)]))
            .issuer_name(ca_name).public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(_ALLOWED), x509.DNSName(_OTHER)]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca.public_bytes(pem))
    (d / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (d / "leaf.key").write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return d / "ca.pem", d / "leaf.pem", d / "leaf.key"


@pytest.fixture(scope="module")
def upstream(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The HTTPS echo server in namespace ``pbup<pid>``, and the stack's gateway restarted to resolve its
    names (hosts file) and trust its CA; yields the file where the server logs each Authorization it got."""
    d = tmp_path_factory.mktemp("upstream")
    ca, leaf, key = _pki(d)
    log = d / "auth.log"
    log.touch()
    ns, veth = f"pbup{time.time_ns() % 100000}", f"pbu{time.time_ns() % 100000}"
    _ip("netns", "add", ns)
    server: subprocess.Popen[str] | None = None
    gateway = stack.services["gateway"]
    saved = dict(gateway.env)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{_UP_HOST}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{_UP_NS}/30", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(_PEERS), "upstream", str(leaf),
                                   str(key), str(log)], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        hosts = d / "hosts"
        hosts.write_text(f"{_UP_NS} {_ALLOWED} {_OTHER}\n")
        gateway.env.update({"PODBAY_GATEWAY_HOSTS_FILE": str(hosts), "PODBAY_GATEWAY_UPSTREAM_CA": str(ca)})
        stack.restart("gateway")
        yield log
    finally:
        gateway.env.clear()
        gateway.env.update(saved)
        stack.restart("gateway")
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_credential_is_injected_at_the_gateway_and_appears_nowhere_in_the_guest(stack: Any, upstream: Path) -> None:
    secret = "pbtest-" + secrets.token_hex(16)
    name = f"upstream-{secrets.token_hex(3)}"
    with api_client(stack) as c:
        r = c.post("/v1/credentials", json={"name": name, "value": secret, "hosts": [_ALLOWED],
                                            "path_prefix": "/repos", "header": "Authorization",
                                            "format": "Bearer {value}", "rate_limit_per_min": 100})
        assert r.status_code == 201, r.text
        assert secret not in r.text
        sb = c.post("/v1/sandboxes", json={"template": "base", "network": {
            # Port 80 is open to another name only: a plain request to the destination's address on it is read
            # and refused with the gateway's 403; port 8080 no rule opens, so it is closed at once.
            "allow": [{"domain": _ALLOWED, "ports": [443]}, {"domain": "plain.upstream.test", "ports": [80]}]}})
        assert sb.status_code == 201, sb.text
        sid = sb.json()["id"]
        try:
            script = GUEST_CALLS.replace("ALLOWED", repr(_ALLOWED)).replace("OTHER", repr(_OTHER)).replace(
                "ADDR", repr(_UP_NS))
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", script]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            seen = json.loads(r.json()["stdout"])

            # The destination received the real value, for the allowed path only.
            received = upstream.read_text()
            assert f"/repos/echo Bearer {secret}" in received, received
            assert "/else" not in received
            allowed = seen["allowed"]
            assert allowed.get("status") == 200, allowed
            # The echo of what arrived upstream comes back to the guest redacted.
            assert "[podbay:redacted]" in allowed["body"] + json.dumps(allowed["headers"])
            assert seen["other_path"].get("status") == 200 and "Authorization" not in seen["other_path"]["body"]
            # Outside the policy: the name does not resolve, a plain request to the address is refused.
            assert "error" in seen["denied_name"], seen["denied_name"]
            denied = seen["denied_addr"]
            assert denied.get("status") == 403 and "egress_denied" in denied["body"], denied
            assert "X-Podbay-Denied" in denied["headers"] or "x-podbay-denied" in denied["headers"], denied
            assert "error" in seen["closed_port"], seen["closed_port"]
            assert secret not in r.text

            # The value is nowhere in the guest; the placeholder is in its environment.
            env = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["env"]}).json()["stdout"]
            placeholder = name.upper().replace("-", "_")
            assert f"PODBAY_CRED_{placeholder}=podbay-credential:{name}" in env
            scan = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", GUEST_SCAN, secret[::-1]]})
            assert scan.status_code == 200 and scan.json()["stdout"].strip() == "clean", scan.text

            # Audited: the credential use (allow) and the denial, for this sandbox.
            deadline = time.monotonic() + 30
            while True:
                rows = c.get("/v1/audit", params={"sandbox_id": sid, "limit": 100}).json()
                items = rows["entries"]
                actions = {(a["action"], a.get("decision")) for a in items}
                if {("credential.use", "allow"), ("egress.deny", "deny")} <= actions or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert ("credential.use", "allow") in actions, actions
            assert ("egress.deny", "deny") in actions, actions
            assert secret not in json.dumps(items)
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
            c.delete(f"/v1/credentials/{name}")


#: Runs in the guest: one HTTPS GET of ``URL`` with urllib (the system's trust store), result as JSON.
GUEST_GET = r"""
import json, sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as r:
        print(json.dumps({"status": r.status, "headers": dict(r.headers), "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "headers": dict(e.headers), "body": e.read().decode()}))
"""


def test_e2b_rules_with_a_secret_and_a_workload_identity_token(stack: Any, upstream: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The unmodified e2b SDK: a secret (Secret.create) and an iam token in network.rules, a transform callable
    as E2B documents it. The destination receives the secret's value and a JWT that verifies against the JWKS
    the API serves (discovery document first), with the audience asked for and a subject naming this sandbox;
    the guest sees neither; get_info returns the rules; update_network replaces them."""
    import httpx
    import jwt

    e2b = pytest.importorskip("e2b")
    monkeypatch.setenv("E2B_API_URL", f"{stack.api_url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.api_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    value = "pbsecret-" + secrets.token_hex(16)
    name = f"upstream-key-{secrets.token_hex(3)}"
    e2b.Secret.create(name, value)
    rules = {_ALLOWED: [{"transform": lambda ctx: {"headers": {
        "Authorization": f"Bearer {ctx.iam.tokens['aws']}", "X-Api-Key": e2b.Secret.fill(name), "X-Team": "blue"}}}]}
    sb = e2b.Sandbox.create(
        template="base", timeout=600,
        network={"allow_out": [_ALLOWED], "deny_out": lambda ctx: [ctx.all_traffic], "rules": rules},
        iam={"tokens": {"aws": e2b.Secret.iam_token(audience="sts.upstream.test", token_type="JWT-SVID")}})
    try:
        info = sb.get_info()
        assert info.network is not None and info.network["allow_out"] == [_ALLOWED], info.network
        assert info.network["rules"][_ALLOWED][0]["transform"]["headers"] == {
            "Authorization": "Bearer ${e2b.identity.tokens.aws}", "X-Api-Key": e2b.Secret.fill(name),
            "X-Team": "blue"}
        before = upstream.read_text()
        run = sb.commands.run(f"python3 -c '{GUEST_GET}' https://{_ALLOWED}/identity", timeout=120)
        seen = json.loads(run.stdout)
        assert seen["status"] == 200, seen
        echoed = json.loads(seen["body"])["headers"]
        assert echoed["Authorization"] == "Bearer [podbay:redacted]" and echoed["X-Team"] == "blue", echoed
        assert echoed["X-Api-Key"] == "[podbay:redacted]" and value not in run.stdout, echoed
        sent = [ln for ln in upstream.read_text()[len(before):].splitlines() if ln.startswith("/identity ")]
        assert len(sent) == 1, sent
        token = sent[0].split(" ", 2)[2]
        assert token not in run.stdout

        # A relying party: discovery document, then the JWKS it names, from the API without a key.
        doc = httpx.get(f"{stack.api_url}/.well-known/openid-configuration", timeout=30).json()
        keys = httpx.get(doc["jwks_uri"], timeout=30).json()
        kid = jwt.get_unverified_header(token)["kid"]
        jwk = next(k for k in keys["keys"] if k["kid"] == kid)
        claims = jwt.decode(token, jwt.PyJWK(jwk), algorithms=doc["id_token_signing_alg_values_supported"],
                            audience="sts.upstream.test", issuer=doc["issuer"])
        # The token names podbay's stored id; E2B's SDK shows it in E2B's spelling (sbx-<hex>).
        stored = sandbox_id_from_e2b(sb.sandbox_id)
        assert stored is not None and stored != sb.sandbox_id
        assert claims["sub"].startswith("spiffe://") and claims["sub"].endswith(f"/sandbox/{stored}")
        assert claims["sandbox_id"] == stored and 0 < claims["exp"] - claims["iat"] <= 300

        # A fork keeps the rules and tokens; its token names the child.
        [child] = sb.fork(count=1, timeout=300)
        assert not isinstance(child, Exception), child
        try:
            assert child.get_info().network["rules"] == info.network["rules"]
            child.commands.run(f"python3 -c '{GUEST_GET}' https://{_ALLOWED}/child", timeout=120)
            sent = [ln for ln in upstream.read_text().splitlines() if ln.startswith("/child ")]
            assert len(sent) == 1, sent
            child_token = sent[0].split(" ", 2)[2]
            child_jwk = next(k for k in keys["keys"] if k["kid"] == jwt.get_unverified_header(child_token)["kid"])
            child_claims = jwt.decode(child_token, jwt.PyJWK(child_jwk), algorithms=["RS256"],
                                      audience="sts.upstream.test", issuer=doc["issuer"])
            assert child_claims["sandbox_id"] == sandbox_id_from_e2b(child.sandbox_id) != stored
        finally:
            child.kill()

        # update_network replaces the rules: no token, no secret from the next request on.
        sb.update_network({"allow_out": [_ALLOWED], "deny_out": ["0.0.0.0/0"],
                           "rules": {_ALLOWED: [{"transform": {"headers": {"X-Team": "green"}}}]}})
        assert sb.get_info().network["rules"] == {_ALLOWED: [{"transform": {"headers": {"X-Team": "green"}}}]}
        run = sb.commands.run(f"python3 -c '{GUEST_GET}' https://{_ALLOWED}/after", timeout=120)
        echoed = json.loads(json.loads(run.stdout)["body"])["headers"]
        assert echoed["X-Team"] == "green" and "Authorization" not in echoed and "X-Api-Key" not in echoed, echoed
    finally:
        sb.kill()
        e2b.Secret.destroy(name)
