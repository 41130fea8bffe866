"""The egress gateway as a real process between real network namespaces (needs root: netns, veth, nftables).

Layout (S is a per-run subnet number):

    netns client A  10.250.S.2 --veth-- pbtgSa 10.250.S.1 ┐ netns "node": nftables redirect TCP -> proxy
    netns client B  10.250.S.6 --veth-- pbtgSb 10.250.S.5 ├ port, port 53 -> DNS port; podbay-gateway
    netns upstream  10.251.S.2, .3, .4 --veth-- pbguS 10.251.S.1 ┘ (PostgreSQL/NATS relayed in from the host)

The node is a namespace of its own so that the test's rules and taps stay apart from any other stack's
``pbt*`` devices and nftables tables on the same host.

The upstream namespace runs an HTTPS (and HTTP) echo server with its own CA, which the gateway trusts only
as the host does: its process's ``SSL_CERT_FILE`` is certifi's roots plus that CA (as on a network that
inspects TLS), and no ``gateway_upstream_ca`` is set; its names are in ``gateway_hosts_file``. Each client namespace is one sandbox with a
NetBinding and its own CA; PostgreSQL holds the sandboxes, policies and credentials.

Every address here is private (10/8), which no sandbox reaches unless the operator allow-lists it: the
gateway runs with ``PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS`` = the upstream's .2 and .3 only, so .4 (listening
too) stands for a private network behind the node that a policy of ``0.0.0.0/0`` must not reach.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import certifi
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from podbay import db
from podbay.contracts.egress import NetBinding, binding_path
from podbay.credentials import PgCredentialStore, new_key
from podbay.devstack.procs import free_ports, stop_process
from podbay.devstack.stack import gateway_executable
from podbay.outbox import new_id
from podbay.sandbox_ca import new_sandbox_ca

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nftables"),
]

PEERS = str(Path(__file__).with_name("gateway_peers.py"))
NAMES = ["www.test", "api.test", "scoped.test", "expired.test", "limited.test", "tpl.test", "elsewhere.test"]
SECRET_A = "sekret-api-A-7f3e9d"
SECRET_B = "sekret-api-B-41c2aa"
SECRET_SCOPED = "sekret-scoped-9b1d"
BASE_POLICY = {"allow": [{"domain": "*.test", "ports": [80, 443]}], "deny": [{"domain": "denied.test"}]}
ISSUER = "https://issuer.podbay.test"


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def _pem_cert(builder: x509.CertificateBuilder, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    return builder.sign(key, hashes.SHA256())


def _upstream_pki(d: Path, names: list[str], ips: list[str]) -> tuple[Path, Path, Path]:
    """A private CA and a leaf certificate for ``names`` and ``ips``: (ca.pem, leaf.pem, leaf.key)."""
    import ipaddress

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "upstream test CA")])
    ca = _pem_cert(x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True), ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    leaf = _pem_cert(x509.CertificateBuilder()
                     .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
                     .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
                     .add_extension(x509.SubjectAlternativeName(sans), critical=False), ca_key)
    paths = d / "upstream-ca.pem", d / "upstream.pem", d / "upstream.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@dataclass
class Box:
    """One sandbox: its namespace, addresses, ids and CA file (trusted by its client)."""

    ns: str
    tap: str
    host_addr: str
    guest_addr: str
    tenant: str
    sandbox: str
    ca_cert: Path

    def run(self, op: dict) -> dict:
        done = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, PEERS, "client", json.dumps(op)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def dns(self, name: str, qtype: str = "A") -> dict:
        return self.run({"op": "dns", "server": self.host_addr, "name": name, "qtype": qtype})

    def https(self, addr: str, sni: str, cafile: Path, path: str = "/") -> dict:
        return self.run({"op": "https", "addr": addr, "port": 443, "sni": sni, "cafile": str(cafile), "path": path})


@dataclass
class Env:
    a: Box
    b: Box
    up_addr: str
    denied_addr: str
    node_addr: str
    upstream_ca: Path
    upstream_log: Path
    health_url: str
    creds: dict[str, str]
    private_addr: str
    key: str  # the credential store's key (pg backend), as the gateway has it


@pytest.fixture(scope="module")
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.connect_pool(pg_dsn, min_size=1, max_size=4)
    await db.migrate(p)
    yield p
    await p.close()


async def _sandbox_rows(pool: asyncpg.Pool, tenant: str, sandbox: str) -> None:
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1) ON CONFLICT DO NOTHING", tenant)
    await pool.execute("INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ('gw-test', 'd', 256, 1)"
                       " ON CONFLICT DO NOTHING")
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib, vcpus,"
        " hostname, egress_policy) VALUES ($1,$2,'gw-test','d','running','running',256,1,'h',$3)",
        sandbox, tenant, BASE_POLICY)


async def _credential(pool: asyncpg.Pool, key: str, tenant: str, value: str, hosts: list[str], *,
                      path_prefix: str | None = None, expires_at: dt.datetime | None = None,
                      rate: int | None = None, sandboxes: list[str] | None = None,
                      templates: list[str] | None = None) -> str:
    cid = new_id("cred")
    sealed = await PgCredentialStore(key).seal(cid, tenant, value)
    await pool.execute(
        "INSERT INTO credentials (id, tenant_id, name, hosts, path_prefix, header, format, expires_at,"
        " rate_limit_per_min, backend, ciphertext, scope_sandboxes, scope_templates)"
        " VALUES ($1,$2,$3,$4,$5,'Authorization','Bearer {value}',$6,$7,'pg',$8,$9,$10)",
        cid, tenant, cid, hosts, path_prefix, expires_at, rate, sealed.ciphertext, sandboxes, templates)
    return cid


@pytest.fixture(scope="module")
async def env(pool: asyncpg.Pool, pg_dsn: str, nats_url: str, test_root: Path) -> AsyncIterator[Env]:
    s = random.randint(1, 250)
    work = test_root / f"gateway-{s}"
    work.mkdir(parents=True)
    data_dir, node_id = work / "data", "gwtest"
    up_addr, denied_addr, node_addr = f"10.251.{s}.2", f"10.251.{s}.3", f"10.251.{s}.1"
    private_addr = f"10.251.{s}.4"  # not allow-listed by the operator: a private network behind the node
    ca_file, leaf, leaf_key = _upstream_pki(work, [*NAMES, "denied.test"], [up_addr, denied_addr])
    hosts = work / "hosts"
    hosts.write_text(f"{up_addr} {' '.join(NAMES)}\n{denied_addr} denied.test\n{private_addr} private.test\n")
    upstream_log = work / "upstream-auth.log"
    upstream_log.touch()
    node_ns, ns_up, up_if = f"pbgw-n{s}", f"pbgw-u{s}", f"pbgu{s}"
    table = "pbgw_test"
    cleanup: list[list[str]] = []
    procs: list[subprocess.Popen[bytes]] = []
    codes: list[int | None] = []
    key = new_key()
    # Signing keys are global; those of another run are sealed under another credential key.
    await pool.execute("DELETE FROM oidc_keys")

    def node(*argv: str) -> None:
        _sh("ip", "-n", node_ns, *argv)

    try:
        # The "node" is a namespace of its own: the test's nftables table, the taps and the gateway live
        # there, away from whatever other stacks on this host do with their own pbt* devices.
        _sh("ip", "netns", "add", node_ns)
        cleanup.append(["ip", "netns", "del", node_ns])
        node("link", "set", "lo", "up")
        # upstream namespace
        _sh("ip", "netns", "add", ns_up)
        cleanup.append(["ip", "netns", "del", ns_up])
        node("link", "add", up_if, "type", "veth", "peer", "name", "eth0", "netns", ns_up)
        node("addr", "add", f"{node_addr}/29", "dev", up_if)
        node("link", "set", up_if, "up")
        for cmd in (["addr", "add", f"{up_addr}/29", "dev", "eth0"], ["addr", "add", f"{denied_addr}/29", "dev", "eth0"],
                    ["addr", "add", f"{private_addr}/29", "dev", "eth0"],
                    ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"],
                    ["route", "add", "default", "via", node_addr]):
            _sh("ip", "-n", ns_up, *cmd)
        # sandboxes
        boxes = []
        for i, tag in enumerate("ab"):
            ns, tap = f"pbgw-c{s}{tag}", f"pbtg{s}{tag}"
            host_addr, guest_addr = f"10.250.{s}.{4 * i + 1}", f"10.250.{s}.{4 * i + 2}"
            _sh("ip", "netns", "add", ns)
            cleanup.append(["ip", "netns", "del", ns])
            node("link", "add", tap, "type", "veth", "peer", "name", "eth0", "netns", ns)
            node("addr", "add", f"{host_addr}/30", "dev", tap)
            node("link", "set", tap, "up")
            for cmd in (["addr", "add", f"{guest_addr}/30", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"], ["route", "add", "default", "via", host_addr]):
                _sh("ip", "-n", ns, *cmd)
            tenant, sandbox = new_id("tnt"), new_id("sbx")
            await _sandbox_rows(pool, tenant, sandbox)
            ca_key, ca_cert = new_sandbox_ca(sandbox, 1)
            ca_path = work / f"ca-{tag}.pem"
            ca_path.write_bytes(ca_key + ca_cert)
            os.chmod(ca_path, 0o600)
            (work / f"ca-{tag}.crt").write_bytes(ca_cert)
            b = NetBinding(sandbox_id=sandbox, generation=1, tap=tap, host_addr=host_addr, guest_addr=guest_addr,
                           ca_path=str(ca_path), ca_cert_pem=ca_cert.decode())
            path = binding_path(data_dir, node_id, guest_addr)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.model_dump_json())
            boxes.append(Box(ns, tap, host_addr, guest_addr, tenant, sandbox, work / f"ca-{tag}.crt"))
        a, b = boxes
        creds = {
            "api_a": await _credential(pool, key, a.tenant, SECRET_A, ["api.test"]),
            "api_b": await _credential(pool, key, b.tenant, SECRET_B, ["*.test"]),
            "scoped": await _credential(pool, key, a.tenant, SECRET_SCOPED, ["scoped.test"], path_prefix="/v2/"),
            "expired": await _credential(pool, key, a.tenant, "sekret-expired", ["expired.test"],
                                         expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)),
            "limited": await _credential(pool, key, a.tenant, "sekret-limited", ["limited.test"], rate=2),
            # scope: A's template -> in scope; another sandbox only -> not A's
            "tpl": await _credential(pool, key, a.tenant, "sekret-tpl", ["tpl.test"], templates=["gw-test"]),
            "elsewhere": await _credential(pool, key, a.tenant, "sekret-elsewhere", ["elsewhere.test"],
                                           sandboxes=[b.sandbox]),
        }
        # the node's redirect, as the node agent installs it: TCP from taps -> proxy, port 53 -> DNS
        health, proxy_port, dns_port, health_out = free_ports(4)
        taps = ", ".join(f'"{x.tap}"' for x in boxes)
        rules = "\n".join([
            f"table ip {table} {{", "  chain pre {", "    type nat hook prerouting priority dstnat; policy accept;",
            f"    iifname {{ {taps} }} udp dport 53 redirect to :{dns_port}",
            f"    iifname {{ {taps} }} tcp dport 53 redirect to :{dns_port}",
            f"    iifname {{ {taps} }} meta l4proto tcp redirect to :{proxy_port}", "  }", "}", ""])
        subprocess.run(["ip", "netns", "exec", node_ns, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=30)
        # PostgreSQL and NATS listen on this namespace's loopback: relay them into the node namespace, and
        # the gateway's health port out of it.
        pg, nats = urlsplit(pg_dsn), urlsplit(nats_url)
        relay = subprocess.Popen([sys.executable, PEERS, "relay", f"{node_ns}:{pg.port}=-:{pg.port}",
                                  f"{node_ns}:{nats.port}=-:{nats.port}", f"-:{health_out}={node_ns}:{health}"],
                                 stdout=subprocess.PIPE)
        procs.append(relay)
        assert relay.stdout is not None and (await asyncio.to_thread(relay.stdout.readline)).strip() == b"ready"
        # The upstream's CA is trusted by "the host" only: the gateway must verify against the host's bundle.
        host_bundle = work / "host-ca-bundle.crt"
        host_bundle.write_bytes(Path(certifi.where()).read_bytes() + ca_file.read_bytes())
        env_vars = {**os.environ, "SSL_CERT_FILE": str(host_bundle), "PODBAY_PG_DSN": pg_dsn,
                    "PODBAY_NATS_URL": nats_url, "PODBAY_DATA_DIR": str(data_dir), "PODBAY_NODE_ID": node_id,
                    "PODBAY_GATEWAY_PORT": str(health), "PODBAY_GATEWAY_PROXY_PORT": str(proxy_port),
                    "PODBAY_GATEWAY_DNS_PORT": str(dns_port), "PODBAY_SANDBOX_CIDR": f"10.250.{s}.0/24",
                    "PODBAY_GATEWAY_HOSTS_FILE": str(hosts), "PODBAY_CREDENTIAL_KEY": key,
                    "PODBAY_OIDC_ISSUER": ISSUER,
                    # the operator opens the upstream's two addresses (private ones) and nothing else
                    "PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS": f"{up_addr}/32, {denied_addr}/32"}
        log = open(work / "gateway.log", "ab")  # noqa: SIM115 - closed with the process
        gw = subprocess.Popen(["ip", "netns", "exec", node_ns, str(gateway_executable())], env=env_vars,
                              stdout=log, stderr=subprocess.STDOUT)
        procs.append(gw)
        up = subprocess.Popen(["ip", "netns", "exec", ns_up, sys.executable, PEERS, "upstream", str(leaf),
                               str(leaf_key), str(upstream_log)], stdout=subprocess.PIPE)
        procs.append(up)
        assert up.stdout is not None and (await asyncio.to_thread(up.stdout.readline)).strip() == b"ready"
        health_url = f"http://127.0.0.1:{health_out}"
        for _ in range(600):
            assert gw.poll() is None, (work / "gateway.log").read_text()[-3000:]
            try:
                if httpx.get(f"{health_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("gateway not healthy: " + (work / "gateway.log").read_text()[-3000:])
        yield Env(a, b, up_addr, denied_addr, node_addr, ca_file, upstream_log, health_url, creds, private_addr, key)
    finally:
        codes = [stop_process(p, grace_s=10) for p in reversed(procs)]
        for cmd in reversed(cleanup):
            _sh(*cmd, check=False)
        if os.environ.get("PODBAY_KEEP_TEST_DATA") == "1":
            print(f"gateway test data kept in {work}")
    # graceful shutdown: SIGTERM ends the gateway with exit code 0 (procs: relay, gateway, upstream)
    assert len(codes) == 3 and codes[1] == 0, (codes, (work / "gateway.log").read_text()[-3000:])
    assert "gateway stopped" in (work / "gateway.log").read_text()


async def _audit(pool: asyncpg.Pool, sandbox: str, action: str, *, decision: str, target: str | None = None,
                 after: int = 0, want: int = 1) -> list[asyncpg.Record]:
    """The audit rows matching, waiting (denials are written in the background) until ``want`` exist."""
    for _ in range(100):
        rows = await pool.fetch(
            "SELECT * FROM audit_log WHERE sandbox_id = $1 AND action = $2 AND decision = $3 AND id > $4"
            " AND ($5::text IS NULL OR target = $5) ORDER BY id", sandbox, action, decision, after, target)
        if len(rows) >= want:
            return list(rows)
        await asyncio.sleep(0.1)
    return list(rows)


async def _last_audit_id(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT coalesce(max(id), 0) FROM audit_log"))


async def test_allowed_name_resolves_and_passes_through(env: Env) -> None:
    a = env.a
    res = await asyncio.to_thread(a.dns, "www.test")
    assert res == {"rcode": "NOERROR", "addrs": [env.up_addr]}
    assert (await asyncio.to_thread(a.dns, "www.test", "AAAA")) == {"rcode": "NOERROR", "addrs": []}
    # No credential of A's tenant for www.test (B's "*.test" is another tenant's): TLS passes untouched, so
    # the client sees the upstream's own certificate.
    out = await asyncio.to_thread(a.https, env.up_addr, "www.test", env.upstream_ca, "/hello")
    assert out["status"] == 200, out
    assert out["issuer_cn"] == "upstream test CA"
    assert json.loads(out["body"])["path"] == "/hello"
    # Plain HTTP by Host + port.
    out = await asyncio.to_thread(a.run, {"op": "http", "addr": env.up_addr, "port": 80, "host": "www.test",
                                          "path": "/plain"})
    assert out["status"] == 200 and json.loads(out["body"])["path"] == "/plain"


async def test_denied_name_nxdomain_and_direct_connections_refused(env: Env, pool: asyncpg.Pool) -> None:
    a, since = env.a, await _last_audit_id(pool)
    assert (await asyncio.to_thread(a.dns, "denied.test"))["rcode"] == "NXDOMAIN"
    assert (await asyncio.to_thread(a.dns, "elsewhere.example"))["rcode"] == "NXDOMAIN"
    rows = await _audit(pool, a.sandbox, "egress.deny", decision="deny", after=since, want=2)
    assert {r["target"] for r in rows} >= {"denied.test", "elsewhere.example"}
    assert all(r["tenant_id"] == a.tenant and r["actor"] == "gateway:gwtest" for r in rows)
    # Straight to the address: TLS with the denied name, TLS with an allowed name to the wrong address,
    # and raw bytes are all closed at once; plain HTTP gets a 403 that says why.
    tls = await asyncio.to_thread(a.https, env.denied_addr, "denied.test", env.upstream_ca)
    assert "error" in tls, tls
    wrong = await asyncio.to_thread(a.https, env.denied_addr, "www.test", env.upstream_ca)
    assert "error" in wrong, wrong
    raw = await asyncio.to_thread(a.run, {"op": "raw", "addr": env.denied_addr, "port": 443})
    assert raw.get("closed") or "error" in raw, raw
    # a port no rule could open is closed before the guest sends anything (a client waiting for a server
    # greeting does not hang)
    silent = await asyncio.to_thread(a.run, {"op": "raw", "addr": env.denied_addr, "port": 22, "send": False,
                                             "timeout": 20})
    assert silent.get("closed") or "error" in silent, silent
    http = await asyncio.to_thread(a.run, {"op": "http", "addr": env.denied_addr, "port": 80,
                                           "host": "denied.test", "path": "/x"})
    assert http["status"] == 403 and http["headers"]["x-podbay-denied"] == "egress_denied"
    body = json.loads(http["body"])
    assert body["error"]["code"] == "egress_denied" and "denied.test" in body["error"]["message"]
    rows = await _audit(pool, a.sandbox, "egress.deny", decision="deny", after=since, want=7)
    assert {"denied.test:443", "denied.test:80", f"{env.denied_addr}:443", f"{env.denied_addr}:22"} <= {
        r["target"] for r in rows}
    # each denial is also an event on podbay.evt.egress.<sandbox>.denied (through the outbox)
    n = await pool.fetchval("SELECT count(*) FROM outbox WHERE subject = $1", f"podbay.evt.egress.{a.sandbox}.denied")
    assert n >= 6


async def test_credential_injected_and_redacted(env: Env, pool: asyncpg.Pool) -> None:
    a, since = env.a, await _last_audit_id(pool)
    out = await asyncio.to_thread(a.https, env.up_addr, "api.test", a.ca_cert, "/v1/me?x=1")
    assert out["status"] == 200, out
    assert out["issuer_cn"].startswith(f"podbay sandbox {a.sandbox}")
    echoed = json.loads(out["body"])["headers"]
    assert echoed["Authorization"] == "Bearer [podbay:redacted]"
    assert out["headers"]["x-echo-authorization"] == "Bearer [podbay:redacted]"
    assert SECRET_A not in json.dumps(out)
    # ... while the destination did receive the value
    assert f"/v1/me?x=1 Bearer {SECRET_A}" in env.upstream_log.read_text()
    rows = await _audit(pool, a.sandbox, "credential.use", decision="allow", target=env.creds["api_a"], after=since)
    assert rows and rows[0]["detail"]["host"] == "api.test" and rows[0]["detail"]["method"] == "GET"
    assert rows[0]["detail"]["path"] == "/v1/me?x=1"


async def test_credential_scope_by_template_and_sandbox(env: Env) -> None:
    a = env.a
    out = await asyncio.to_thread(a.https, env.up_addr, "tpl.test", a.ca_cert, "/t")
    assert out["status"] == 200 and json.loads(out["body"])["headers"]["Authorization"] == "Bearer [podbay:redacted]"
    # scoped to another sandbox: not A's, so A's TLS passes through untouched (the upstream's own certificate)
    out = await asyncio.to_thread(a.https, env.up_addr, "elsewhere.test", env.upstream_ca, "/e")
    assert out["status"] == 200 and out["issuer_cn"] == "upstream test CA"
    assert "Authorization" not in json.loads(out["body"])["headers"]
    assert "sekret-elsewhere" not in env.upstream_log.read_text()


async def test_path_prefix_is_respected(env: Env) -> None:
    a = env.a
    out = await asyncio.to_thread(a.https, env.up_addr, "scoped.test", a.ca_cert, "/v1/items")
    assert out["status"] == 200 and "Authorization" not in json.loads(out["body"])["headers"]
    out = await asyncio.to_thread(a.https, env.up_addr, "scoped.test", a.ca_cert, "/v2/items")
    assert out["status"] == 200
    assert json.loads(out["body"])["headers"]["Authorization"] == "Bearer [podbay:redacted]"
    log = env.upstream_log.read_text()
    assert f"/v2/items Bearer {SECRET_SCOPED}" in log and "/v1/items" not in log


async def test_expired_credential_refused_with_audit(env: Env, pool: asyncpg.Pool) -> None:
    a, since = env.a, await _last_audit_id(pool)
    out = await asyncio.to_thread(a.https, env.up_addr, "expired.test", a.ca_cert, "/x")
    assert out["status"] == 403, out
    assert json.loads(out["body"])["error"]["code"] == "credential_expired"
    assert out["headers"]["x-podbay-denied"] == "credential_expired"
    rows = await _audit(pool, a.sandbox, "credential.use", decision="deny", target=env.creds["expired"], after=since)
    assert rows and rows[0]["detail"]["reason"] == "credential_expired"


async def test_rate_limit_refused_with_audit(env: Env, pool: asyncpg.Pool) -> None:
    a, since = env.a, await _last_audit_id(pool)
    statuses = []
    for _ in range(3):
        out = await asyncio.to_thread(a.https, env.up_addr, "limited.test", a.ca_cert, "/r")
        statuses.append(out["status"])
    assert statuses == [200, 200, 429], statuses
    assert json.loads(out["body"])["error"]["code"] == "credential_rate_limited"
    denied = await _audit(pool, a.sandbox, "credential.use", decision="deny", target=env.creds["limited"], after=since)
    allowed = await _audit(pool, a.sandbox, "credential.use", decision="allow", target=env.creds["limited"],
                           after=since, want=2)
    assert len(denied) == 1 and len(allowed) == 2


async def test_policy_change_applies_to_the_next_connection(env: Env, pool: asyncpg.Pool) -> None:
    a = env.a
    assert (await asyncio.to_thread(a.https, env.up_addr, "www.test", env.upstream_ca))["status"] == 200
    await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox,
                       {"allow": [{"domain": "api.test"}]})
    try:
        assert "error" in await asyncio.to_thread(a.https, env.up_addr, "www.test", env.upstream_ca)
        assert (await asyncio.to_thread(a.dns, "www.test"))["rcode"] == "NXDOMAIN"
        # no policy on the sandbox: the template's applies (none here: deny all)
        await pool.execute("UPDATE sandboxes SET egress_policy = NULL WHERE id = $1", a.sandbox)
        assert (await asyncio.to_thread(a.dns, "api.test"))["rcode"] == "NXDOMAIN"
    finally:
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, BASE_POLICY)
    assert (await asyncio.to_thread(a.https, env.up_addr, "www.test", env.upstream_ca))["status"] == 200


async def test_header_transforms_set_on_plain_and_intercepted_https(env: Env, pool: asyncpg.Pool) -> None:
    a = env.a
    policy = {**BASE_POLICY, "transforms": [{"domain": "www.test", "headers": {"X-Team": "blue"}},
                                            {"domain": "*.test", "headers": {"X-Via": "podbay", "x-team": "red"}},
                                            {"domain": "www.test", "headers": {"X-Team": "green"}}]}
    await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, policy)
    try:
        # HTTPS to a name with a transform is intercepted with the sandbox's CA, and the headers arrive.
        out = await asyncio.to_thread(a.https, env.up_addr, "www.test", a.ca_cert, "/t")
        assert out["status"] == 200, out
        assert out["issuer_cn"].startswith(f"podbay sandbox {a.sandbox}")
        echoed = json.loads(out["body"])["headers"]
        assert echoed["X-Team"] == "green" and echoed["X-Via"] == "podbay", echoed
        out = await asyncio.to_thread(a.run, {"op": "http", "addr": env.up_addr, "port": 80, "host": "www.test",
                                              "path": "/plain"})
        echoed = json.loads(out["body"])["headers"]
        assert out["status"] == 200 and echoed["X-Team"] == "green" and echoed["X-Via"] == "podbay", out
    finally:
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, BASE_POLICY)
    # Without the transform, the same connection passes untouched again (the upstream's own certificate).
    out = await asyncio.to_thread(a.https, env.up_addr, "www.test", env.upstream_ca, "/t")
    assert out["status"] == 200 and out["issuer_cn"] == "upstream test CA"
    assert "X-Team" not in json.loads(out["body"])["headers"]


IDENTITY_HEADERS = {"Authorization": "Bearer ${e2b.identity.tokens.aws}", "X-Api-Key": "k=${e2b.secrets.OpenAI}",
                    "X-Team": "blue"}
IDENTITY_RULES = {**BASE_POLICY, "transforms": [{"domain": "www.test", "headers": IDENTITY_HEADERS}]}
SECRET_OPENAI = "sekret-openai-5d1e0c"


async def _oidc_documents(pool: asyncpg.Pool, key: str) -> tuple[dict, dict]:
    """The discovery document and JWKS as the API's routes (services/api/routes/oidc.py) serve them, over HTTP, with
    the issuer and store key the gateway has."""
    from types import SimpleNamespace

    from fastapi import FastAPI

    from podbay.config import Settings
    from podbay_api.routes import oidc as oidc_routes
    from podbay_api.core.deps import ctx_dep

    app = FastAPI()
    app.include_router(oidc_routes.router)
    settings = Settings(oidc_issuer=ISSUER, credential_key=key)
    app.dependency_overrides[ctx_dep] = lambda: SimpleNamespace(pool=pool, settings=settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=ISSUER) as c:
        doc = (await c.get("/.well-known/openid-configuration")).json()
        assert doc["jwks_uri"] == f"{ISSUER}/.well-known/jwks.json"
        return doc, (await c.get(urlsplit(doc["jwks_uri"]).path)).json()


async def test_rule_placeholders_resolved_at_the_gateway_only_for_the_sandbox_that_owns_them(
        env: Env, pool: asyncpg.Pool) -> None:
    """E2B's network.rules with a workload identity token and a secret: the upstream receives a JWT that verifies
    against the issuer's JWKS (aud, sub, exp right) and the secret's value; the guest sees neither. Another
    tenant's sandbox with the same rules gets no token and not this tenant's secret; a placeholder the guest
    writes itself, or sends to a host without a rule, goes out as literal text; plain HTTP is refused."""
    import jwt

    a, b = env.a, env.b
    secret_id = new_id("sec")
    sealed = await PgCredentialStore(env.key).seal(secret_id, a.tenant, SECRET_OPENAI)
    # As the Secrets API makes one (services/api/e2b/secrets.py): lower-case name, an empty sandbox scope.
    await pool.execute(
        "INSERT INTO credentials (id, tenant_id, name, hosts, header, format, backend, ciphertext, scope_sandboxes)"
        " VALUES ($1,$2,'openai','{}','Authorization','{value}','pg',$3,'{}')", secret_id, a.tenant,
        sealed.ciphertext)
    await pool.execute("INSERT INTO e2b_secrets (credential_id, tenant_id) VALUES ($1, $2)", secret_id, a.tenant)
    tokens = {"aws": {"audience": "sts.test.example", "tokenType": "JWT-SVID"}}
    for box in (a, b):
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", box.sandbox, IDENTITY_RULES)
    await pool.execute("INSERT INTO e2b_sandboxes (sandbox_id, iam_tokens) VALUES ($1, $2)", a.sandbox, tokens)
    before = env.upstream_log.read_text()
    try:
        out = await asyncio.to_thread(a.https, env.up_addr, "www.test", a.ca_cert, "/identity")
        assert out["status"] == 200, out
        echoed = json.loads(out["body"])["headers"]
        # What came back to the guest carries neither value (the echo of both is redacted).
        assert echoed["Authorization"] == "Bearer [podbay:redacted]" and echoed["X-Team"] == "blue", echoed
        assert echoed["X-Api-Key"] == "k=[podbay:redacted]", echoed
        assert SECRET_OPENAI not in out["body"] and "eyJ" not in out["body"] + json.dumps(out["headers"])
        sent = [line for line in env.upstream_log.read_text()[len(before):].splitlines()
                if line.startswith("/identity ")]
        assert len(sent) == 1
        token = sent[0].split(" ", 2)[2]
        doc, keys = await _oidc_documents(pool, env.key)
        kid = jwt.get_unverified_header(token)["kid"]
        jwk = next(k for k in keys["keys"] if k["kid"] == kid)
        claims = jwt.decode(token, jwt.PyJWK(jwk), algorithms=["RS256"], audience="sts.test.example",
                            issuer=doc["issuer"])
        assert claims["sub"] == f"spiffe://issuer.podbay.test/tenant/{a.tenant}/sandbox/{a.sandbox}"
        assert claims["exp"] - claims["iat"] == 300 and claims["sandbox_id"] == a.sandbox
        # Minted per request: the next request carries another token.
        await asyncio.to_thread(a.https, env.up_addr, "www.test", a.ca_cert, "/identity")
        again = [line for line in env.upstream_log.read_text()[len(before):].splitlines()
                 if line.startswith("/identity ")]
        assert len(again) == 2 and again[1] != again[0]

        # Tenant B's sandbox with A's rules: refused; with the token header alone, B registered no token; with
        # the secret header alone, A's secret is not B's. Nothing reaches the upstream.
        out = await asyncio.to_thread(b.https, env.up_addr, "www.test", b.ca_cert, "/identity-b")
        assert out["status"] == 403, out
        for header, code in (("Authorization", "identity_token_not_registered"), ("X-Api-Key", "secret_not_found")):
            only = {**BASE_POLICY, "transforms": [
                {"domain": "www.test", "headers": {header: IDENTITY_HEADERS[header]}}]}
            await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", b.sandbox, only)
            out = await asyncio.to_thread(b.https, env.up_addr, "www.test", b.ca_cert, "/identity-b")
            assert out["status"] == 403 and out["headers"].get("x-podbay-denied") == code, out
        assert "/identity-b" not in env.upstream_log.read_text()

        # A podbay credential of A's (hosts api.test only) is not an E2B secret: a rule cannot send it elsewhere.
        stray = {**BASE_POLICY, "transforms": [
            {"domain": "www.test", "headers": {"X-Leak": "${e2b.secrets." + env.creds["api_a"] + "}"}}]}
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, stray)
        out = await asyncio.to_thread(a.https, env.up_addr, "www.test", a.ca_cert, "/leak")
        assert out["status"] == 403 and out["headers"].get("x-podbay-denied") == "secret_not_found", out
        assert "/leak" not in env.upstream_log.read_text() and SECRET_A not in out["body"]
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, IDENTITY_RULES)

        # A placeholder the guest writes: literal on a host without a rule, and on a host with one.
        literal = "Bearer ${e2b.identity.tokens.aws}"
        out = await asyncio.to_thread(a.run, {"op": "https", "addr": env.up_addr, "port": 443, "sni": "www.test",
                                              "cafile": str(a.ca_cert), "path": "/own",
                                              "headers": {"X-Own": "${e2b.secrets.openai}"}})
        assert json.loads(out["body"])["headers"]["X-Own"] == "${e2b.secrets.openai}", out
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, BASE_POLICY)
        out = await asyncio.to_thread(a.run, {"op": "https", "addr": env.up_addr, "port": 443, "sni": "www.test",
                                              "cafile": str(env.upstream_ca), "path": "/norule",
                                              "headers": {"Authorization": literal}})
        assert out["status"] == 200 and out["issuer_cn"] == "upstream test CA", out  # not even intercepted
        assert f"/norule {literal}" in env.upstream_log.read_text()

        # Plain HTTP never carries a secret or a token: refused.
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, IDENTITY_RULES)
        out = await asyncio.to_thread(a.run, {"op": "http", "addr": env.up_addr, "port": 80, "host": "www.test",
                                              "path": "/plain-identity"})
        assert out["status"] == 403 and out["headers"].get("x-podbay-denied") == "transform_requires_https", out
        assert "/plain-identity" not in env.upstream_log.read_text()
    finally:
        for box in (a, b):
            await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", box.sandbox, BASE_POLICY)
            await pool.execute("DELETE FROM e2b_sandboxes WHERE sandbox_id = $1", box.sandbox)
        await pool.execute("DELETE FROM e2b_secrets WHERE credential_id = $1", secret_id)
        await pool.execute("UPDATE credentials SET deleted_at = now() WHERE id = $1", secret_id)


async def test_tls_to_an_ip_literal(env: Env, pool: asyncpg.Pool) -> None:
    """``https://<address>``: no SNI; decided by address (the operator-opened upstream) and passed through, so
    the guest verifies the destination's own certificate against the address (its IP SAN). (A guest's curl to
    https://1.1.1.1 that fails with exit 60 on a host whose own network re-signs TLS fails the same way on the
    host: that proxy's certificate for an address carries no IP SAN.)"""
    a = env.a
    policy = {"allow": [{"cidr": f"{env.up_addr}/32", "ports": [443]}]}
    await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, policy)
    try:
        out = await asyncio.to_thread(a.https, env.up_addr, env.up_addr, env.upstream_ca, "/by-address")
        assert out.get("status") == 200 and out["issuer_cn"] == "upstream test CA", out
    finally:
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, BASE_POLICY)


async def test_metadata_and_node_addresses_refused_whatever_the_policy(env: Env, pool: asyncpg.Pool) -> None:
    a = env.a
    await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox,
                       {"allow": [{"cidr": "0.0.0.0/0"}, {"domain": "*.test"}]})
    try:
        # the policy does open other addresses (raw TCP by CIDR)
        ok = await asyncio.to_thread(a.run, {"op": "http", "addr": env.up_addr, "port": 80, "host": "x.invalid"})
        assert ok["status"] == 200
        for addr, port in (("169.254.169.254", 80), (env.node_addr, 80), (a.host_addr, 80), ("127.0.0.1", 80)):
            out = await asyncio.to_thread(a.run, {"op": "http", "addr": addr, "port": port, "host": "www.test"})
            assert out.get("status", 0) == 0, (addr, out)  # closed without an answer (or never connected)
    finally:
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, BASE_POLICY)


async def test_allow_everything_does_not_reach_a_private_network_the_operator_did_not_open(
        env: Env, pool: asyncpg.Pool) -> None:
    a = env.a
    after = await _last_audit_id(pool)
    await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox,
                       {"allow": [{"cidr": "0.0.0.0/0"}, {"domain": "*.test"}]})
    try:
        # The operator-allowed neighbour on the same wire answers, so the upstream does listen on every address.
        ok = await asyncio.to_thread(a.run, {"op": "http", "addr": env.up_addr, "port": 80, "host": "x.invalid"})
        assert ok["status"] == 200, ok
        # The private address: raw TCP, plain HTTP by an allowed name, TLS by an allowed SNI: no answer at all.
        for op in ({"op": "raw", "addr": env.private_addr, "port": 80, "send": True},
                   {"op": "http", "addr": env.private_addr, "port": 80, "host": "private.test"},
                   {"op": "https", "addr": env.private_addr, "port": 443, "sni": "private.test",
                    "cafile": str(env.upstream_ca), "path": "/"}):
            out = await asyncio.to_thread(a.run, op)
            assert out.get("status", 0) == 0 and not out.get("data"), (op, out)
        # DNS does not lead there either: an allowed name that resolves into the range is NXDOMAIN.
        assert (await asyncio.to_thread(a.dns, "private.test")) == {"rcode": "NXDOMAIN", "addrs": []}
        rows = await _audit(pool, a.sandbox, "egress.deny", decision="deny", after=after, want=2)
        reasons = {r["detail"]["reason"] for r in rows}
        assert "private" in reasons, [dict(r) for r in rows]
    finally:
        await pool.execute("UPDATE sandboxes SET egress_policy = $2 WHERE id = $1", a.sandbox, BASE_POLICY)


async def test_each_sandbox_has_its_own_ca(env: Env) -> None:
    a, b = env.a, env.b
    # B's credential (another tenant) is injected for B, with B's CA ...
    out = await asyncio.to_thread(b.https, env.up_addr, "api.test", b.ca_cert, "/b")
    assert out["status"] == 200 and out["issuer_cn"].startswith(f"podbay sandbox {b.sandbox}")
    assert f"/b Bearer {SECRET_B}" in env.upstream_log.read_text()
    # ... and a client that trusts the other sandbox's CA fails verification, both ways.
    for box, other in ((a, b), (b, a)):
        out = await asyncio.to_thread(box.https, env.up_addr, "api.test", other.ca_cert, "/x")
        assert "error" in out and "CERTIFICATE_VERIFY_FAILED" in out["error"], out


def test_metrics_count_decisions(env: Env) -> None:
    text = httpx.get(f"{env.health_url}/metrics", timeout=5).text
    assert 'podbay_gateway_decisions_total{protocol="dns",reason="allowed"}' in text
    assert 'podbay_gateway_credential_uses_total{outcome="allowed"}' in text
    assert "podbay_gateway_dns_answers_total" in text
    # test_rule_placeholders_...: two tokens and two secrets resolved, and B's two refusals
    for kind, outcome in (("token", "resolved"), ("secret", "resolved"), ("token", "identity_token_not_registered"),
                          ("secret", "secret_not_found")):
        assert f'podbay_gateway_rule_placeholders_total{{kind="{kind}",outcome="{outcome}"}}' in text, (kind, outcome)
