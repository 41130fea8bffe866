"""The sandbox network with real microVMs (docs/DESIGN.md §6; docs/ARCHITECTURE.md "Sandbox network"): each guest
has its own /30 on its own tap, reaches nothing but the node's gateway ports (nothing listens there in this
stack: the module stops the stack's gateway and restarts it afterwards, so every connection is refused at
once and a stand-in can take the gateway's ports), and trusts a CA of its own that changes with every fork
and rollback.
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
import stat
import subprocess
from pathlib import Path
from typing import Any

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import asyncpg
import httpx
import pytest
from e2e_http import api_client as _client, sh as _sh

from podbay.contracts.egress import NetBinding, bindings_dir
from podbay.egress_ranges import STACK_BRIDGE_POOL, IPNetwork, parse_cidrs, range_kind
from podbay.stacknet import SANDBOX_POOL, nft_table, tap_prefix

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", autouse=True)
def _no_gateway(stack: Any) -> Iterator[None]:
    """These tests check the network layer alone (tests/e2e/test_egress_e2e.py checks it with the gateway)."""
    stack.services["gateway"].stop()
    try:
        yield
    finally:
        stack.restart("gateway")

#: Run in the guest as ``python3 -c PROBE '<json targets>'``; prints what it saw as one JSON object.
PROBE = r"""
import fcntl, json, os, socket, struct, sys, time
targets = json.loads(sys.argv[1])
out = {"tcp": {}, "ping": {}, "dns": {}}

def tcp(host, port):
    s = socket.socket()
    s.settimeout(20)
    try:
        s.connect((host, port))
        return "connected:" + s.recv(64).decode(errors="replace").strip()
    except ConnectionRefusedError:
        return "refused"
    except ConnectionResetError:
        return "reset"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "unreachable" if e.errno in (113, 101, 13) else "errno:%d" % e.errno
    finally:
        s.close()

def checksum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff

def ping(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(3)
    pkt = struct.pack("!BBHHH", 8, 0, 0, 0x4242, 1) + b"podbay-ping"
    pkt = pkt[:2] + struct.pack("!H", checksum(pkt + b"\0" * (len(pkt) % 2))) + pkt[4:]
    try:
        s.sendto(pkt, (host, 0))
    except OSError as e:
        return "send failed:%d" % e.errno
    end = time.monotonic() + 3
    while time.monotonic() < end:
        try:
            data, addr = s.recvfrom(2048)
        except socket.timeout:
            break
        t, c = data[20], data[21]
        if t == 0 and addr[0] == host:
            return "echo reply"
        if t == 3:
            return "unreachable:%d" % c
    return "no reply"

def dns(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(20)
    try:
        s.connect((host, 53))
        s.send(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01")
        return "answered:" + s.recv(512).decode(errors="replace").strip()
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timeout"
    finally:
        s.close()

for host, port in targets.get("tcp", []):
    out["tcp"]["%s:%d" % (host, port)] = tcp(host, port)
for host in targets.get("ping", []):
    out["ping"][host] = ping(host)
for host in targets.get("dns", []):
    out["dns"][host] = dns(host)
nic = sorted(n for n in os.listdir("/sys/class/net") if n != "lo" and os.path.exists("/sys/class/net/%s/device" % n))[0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
out["nic"] = nic
out["addr"] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", nic.encode()))[20:24])
out["mask"] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891b, struct.pack("256s", nic.encode()))[20:24])
out["default_routes"] = []
for line in open("/proc/net/route").read().splitlines()[1:]:
    f = line.split()
    if f[1] == "00000000" and f[7] == "00000000":
        out["default_routes"].append([f[0], socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))])
out["resolv"] = open("/etc/resolv.conf").read()
print(json.dumps(out))
"""

PEM_RE = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def _probe(c: httpx.Client, sid: str, targets: dict[str, Any] | None = None) -> dict[str, Any]:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", PROBE, json.dumps(targets or {})]})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return dict(json.loads(r.json()["stdout"]))


def _binding(stack: Any, sandbox: dict[str, Any]) -> NetBinding:
    """The node's binding file for ``sandbox`` (exactly one)."""
    found = []
    for f in bindings_dir(Path(stack.data_dir), sandbox["node_id"]).glob("*.json"):
        b = NetBinding.model_validate_json(f.read_text())
        if b.sandbox_id == sandbox["id"]:
            assert f.name == f"{b.guest_addr}.json"
            found.append(b)
    assert len(found) == 1, f"bindings of {sandbox['id']}: {found}"
    return found[0]


def _guest_certs(c: httpx.Client, sid: str) -> tuple[list[str], str]:
    """(certificates of the guest's trust bundle, in order; the installed sandbox CA file)."""
    bundle = _sh(c, sid, "cat /etc/ssl/certs/ca-certificates.crt")
    mine = _sh(c, sid, "cat /usr/local/share/ca-certificates/podbay-sandbox.crt")
    return PEM_RE.findall(bundle), mine


def _host_addresses() -> list[str]:
    """This host's own IPv4 addresses, other than loopback and sandbox taps (of any stack)."""
    out = json.loads(subprocess.run(["ip", "-4", "-j", "addr", "show"], capture_output=True, text=True,
                                    check=True).stdout)
    return [a["local"] for link in out if not link["ifname"].startswith("pb")
            for a in link.get("addr_info", []) if not a["local"].startswith("127.")]


def _redirected(host: str, operator_allow: list[IPNetwork]) -> bool:
    """Whether the node's ruleset sends a guest's TCP to ``host`` to the gateway: not the sandbox network nor
    the node bridges (never), not in an always-denied range unless the operator allow-listed it."""
    ip = ipaddress.ip_address(host)
    if any(ip in ipaddress.ip_network(n) for n in (SANDBOX_POOL, STACK_BRIDGE_POOL)):
        return False
    return range_kind(ip, operator_allow) is None


def _tap_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


@contextlib.contextmanager
def _listening(port: int, banner: bytes, *, udp: bool = False) -> Iterator[None]:
    """A server on 0.0.0.0:``port`` (TCP, or UDP with ``udp``) that answers everyone with ``banner``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    if not udp:
        sock.listen(64)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                if udp:
                    _data, peer = sock.recvfrom(2048)
                    sock.sendto(banner, peer)
                else:
                    conn, _ = sock.accept()
                    with conn:
                        conn.sendall(banner)
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)
        sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _assert_fails_fast(results: dict[str, str]) -> None:
    """Every attempt was turned down by the host (refused, reset or unreachable), none connected or hung."""
    for target, outcome in results.items():
        assert outcome in ("refused", "reset", "unreachable"), f"{target}: {outcome}"


def test_each_guest_has_its_own_address_route_and_nothing_but_the_gateway(stack: Any) -> None:
    prefix = tap_prefix(stack.data_dir)
    ruleset = subprocess.run(["nft", "list", "table", "inet", nft_table(stack.data_dir)], capture_output=True,
                             text=True)
    assert ruleset.returncode == 0, ruleset.stderr
    assert f'iifname "{prefix}*"' in ruleset.stdout
    with _client(stack) as c:
        a = c.post("/v1/sandboxes", json={"template": "base"}).json()
        b = c.post("/v1/sandboxes", json={"template": "base"}).json()
        try:
            assert a["state"] == b["state"] == "running", (a, b)
            ba, bb = _binding(stack, a), _binding(stack, b)
            # One /30 each, a tap each, on this node's address plan.
            assert ba.guest_addr != bb.guest_addr and ba.tap != bb.tap
            assert ba.tap.startswith(prefix) and len(ba.tap) <= 15 and _tap_exists(ba.tap)
            ca_file = Path(ba.ca_path)
            assert stat.S_IMODE(ca_file.stat().st_mode) == 0o600
            assert ca_file.read_text().index("PRIVATE KEY") < ca_file.read_text().index("BEGIN CERTIFICATE")
            assert ca_file.read_text().rstrip().endswith(ba.ca_cert_pem.strip())

            node_port, api_port = int(stack.ports.node), int(stack.ports.api)
            # A host service listening on every address: without the ruleset a guest would reach it.
            service = _free_port()
            hosts = [ba.host_addr, bb.host_addr, *_host_addresses()]
            targets: dict[str, Any] = {
                "tcp": [[ba.host_addr, node_port], [ba.host_addr, api_port], [ba.host_addr, 22],
                        ["169.254.169.254", 80], [bb.guest_addr, 22], *[[h, service] for h in hosts],
                        *[[h, p] for h in _host_addresses() for p in (node_port, api_port)]],
                "ping": [bb.guest_addr, ba.host_addr, "169.254.169.254"],
                "dns": [ba.host_addr, "192.0.2.53"],
            }
            with _listening(service, b"host-service\n"):
                seen = _probe(c, a["id"], targets)
            assert seen["addr"] == ba.guest_addr and seen["mask"] == "255.255.255.252"
            assert seen["default_routes"] == [[seen["nic"], ba.host_addr]]
            assert seen["resolv"] == f"nameserver {ba.host_addr}\n"
            _assert_fails_fast(seen["tcp"])
            # DNS goes to the gateway's DNS port wherever the guest sends it; with no gateway, it is refused.
            assert set(seen["dns"].values()) == {"refused"}, seen["dns"]
            for host, outcome in seen["ping"].items():
                assert outcome != "echo reply", f"ping {host}: {outcome}"
            # The other sandbox cannot reach this one either.
            back = _probe(c, b["id"], {"tcp": [[ba.guest_addr, 22]], "ping": [ba.guest_addr]})
            assert back["addr"] == bb.guest_addr
            _assert_fails_fast(back["tcp"])
            assert back["ping"][ba.guest_addr] != "echo reply"

            # Every DNS query, wherever the guest sends it, and every TCP connection to an address a sandbox may
            # reach at all (203.0.113.1: the test stack's operator allow-list opens TEST_PEER_NETS) lands
            # on the gateway's ports (a stand-in answers here). A connection to an always-denied address (private
            # ranges, metadata, the stack's own addresses) is not even redirected: the ruleset resets it, so the
            # host service is never reached either way (docs/egress.md, "Always denied").
            # The gateway's ports (StackPorts.free(): free ones, the stack's gateway is stopped in this module).
            proxy, dns = int(stack.ports.gateway_proxy), int(stack.ports.gateway_dns)
            with _listening(service, b"host-service\n"), _listening(proxy, b"gateway\n"), \
                    _listening(dns, b"gateway-dns", udp=True):
                via = _probe(c, a["id"], {"tcp": [[h, service] for h in hosts] + [
                    ["169.254.169.254", 80], [bb.guest_addr, 22], ["203.0.113.1", 443], [ba.host_addr, node_port]],
                    "dns": [ba.host_addr, "192.0.2.53"]})
            assert via["tcp"]["203.0.113.1:443"] == "connected:gateway", via["tcp"]
            allow = parse_cidrs(stack.base_env.get("PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS", ""))
            for target, outcome in via["tcp"].items():
                host = target.rsplit(":", 1)[0]
                if _redirected(host, allow):
                    assert outcome == "connected:gateway", (target, outcome)
                else:
                    assert outcome in ("refused", "reset", "unreachable"), (target, outcome)
            assert set(via["dns"].values()) == {"answered:gateway-dns"}, via["dns"]
        finally:
            for s in (a, b):
                c.delete(f"/v1/sandboxes/{s['id']}")
        # Leaving the node releases the binding, the CA material and the tap.
        assert not [f for f in bindings_dir(Path(stack.data_dir), a["node_id"]).glob("*.json")
                    if NetBinding.model_validate_json(f.read_text()).sandbox_id in (a["id"], b["id"])]
        assert not ca_file.exists() and not _tap_exists(ba.tap)


def test_the_sandbox_ca_is_trusted_and_new_for_every_sandbox_fork_and_rollback(stack: Any) -> None:
    with _client(stack) as c:
        a = c.post("/v1/sandboxes", json={"template": "base"}).json()
        b = c.post("/v1/sandboxes", json={"template": "base"}).json()
        child_ids: list[str] = []
        try:
            ba, bb = _binding(stack, a), _binding(stack, b)
            certs_a, mine_a = _guest_certs(c, a["id"])
            certs_b, _ = _guest_certs(c, b["id"])
            # The template's bundle plus exactly this sandbox's CA, last.
            assert certs_a[-1].strip() == mine_a.strip() == ba.ca_cert_pem.strip()
            assert certs_b[-1].strip() == bb.ca_cert_pem.strip()
            assert ba.ca_cert_pem != bb.ca_cert_pem
            original = certs_a[:-1]
            assert len(original) > 10 and certs_b[:-1] == original
            # Python in the guest trusts it through the default context.
            out = _sh(c, a["id"], "python3 -c 'import ssl; print(len(ssl.create_default_context()"
                                  ".get_ca_certs()))'")
            assert int(out) == len(certs_a)

            r = c.post(f"/v1/sandboxes/{a['id']}/fork", json={"count": 1})
            assert r.status_code == 200, r.text
            child_ids = [ch["sandbox_id"] for ch in r.json()["children"]]
            child = c.get(f"/v1/sandboxes/{child_ids[0]}").json()
            assert child["state"] == "running", child
            bc = _binding(stack, child)
            assert bc.ca_cert_pem != ba.ca_cert_pem and bc.guest_addr != ba.guest_addr and bc.generation == 1
            certs_c, _ = _guest_certs(c, child["id"])
            assert certs_c[:-1] == original and certs_c[-1].strip() == bc.ca_cert_pem.strip()
            # The child began with its parent's address and route; it has its own now, and only its own.
            seen = _probe(c, child["id"])
            assert seen["addr"] == bc.guest_addr and seen["default_routes"] == [[seen["nic"], bc.host_addr]]
            assert seen["resolv"] == f"nameserver {bc.host_addr}\n"

            snap = c.post(f"/v1/sandboxes/{a['id']}/snapshots", json={"kind": "full"})
            assert snap.status_code == 201, snap.text
            r = c.post(f"/v1/sandboxes/{a['id']}/restore", json={"snapshot_id": snap.json()["id"]})
            assert r.status_code == 200, r.text
            assert r.json()["generation"] == a["generation"] + 1
            ba2 = _binding(stack, a)
            assert ba2.generation == a["generation"] + 1 and ba2.ca_cert_pem != ba.ca_cert_pem
            assert not Path(ba.ca_path).exists() and Path(ba2.ca_path).exists()
            certs_a2, _ = _guest_certs(c, a["id"])
            assert certs_a2[:-1] == original and certs_a2[-1].strip() == ba2.ca_cert_pem.strip()
            assert _probe(c, a["id"])["addr"] == ba2.guest_addr
        finally:
            for sid in [a["id"], b["id"], *child_ids]:
                c.delete(f"/v1/sandboxes/{sid}")


def test_a_guest_that_slept_or_outlived_the_agent_keeps_its_network(stack: Any) -> None:
    with _client(stack) as c:
        a = c.post("/v1/sandboxes", json={"template": "base"}).json()
        try:
            ba = _binding(stack, a)
            # Pause long enough for the node to release its RAM (PODBAY_PAUSED_RELEASE_S=6 in tests): QEMU
            # exits and takes its tap; the resume gets the same address on a new tap.
            assert c.post(f"/v1/sandboxes/{a['id']}/pause").status_code == 200
            hib = Path(stack.data_dir) / "nodes" / a["node_id"] / "store" / "sandboxes" / a["id"] / "hib"
            _wait(lambda: (hib / "state").exists() and not _tap_exists(ba.tap), "the paused sandbox to release its RAM")
            assert c.post(f"/v1/sandboxes/{a['id']}/resume").status_code == 200
            assert _binding(stack, a) == ba and _tap_exists(ba.tap)
            seen = _probe(c, a["id"], {"tcp": [[ba.host_addr, 22]]})
            assert seen["addr"] == ba.guest_addr and seen["default_routes"] == [[seen["nic"], ba.host_addr]]
            _assert_fails_fast(seen["tcp"])

            # A node-agent restart re-attaches: same lease, same binding, the tap still there.
            stack.restart("nodeagent")
            _wait(lambda: c.post(f"/v1/sandboxes/{a['id']}/exec", json={"shell": "true"}).status_code == 200,
                  "the node agent to re-attach")
            assert _binding(stack, a) == ba and _tap_exists(ba.tap)
            assert _probe(c, a["id"])["addr"] == ba.guest_addr
        finally:
            c.delete(f"/v1/sandboxes/{a['id']}")


def _ready_slots(stack: Any) -> list[str]:
    async def q() -> list[str]:
        conn = await asyncpg.connect(stack.pg_dsn)
        try:
            rows = await conn.fetch("SELECT id FROM warm_slots WHERE template='base' AND state='ready'")
            return [r["id"] for r in rows]
        finally:
            await conn.close()

    return asyncio.run(q())


def _wait(cond: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)



def test_a_warm_slot_is_configured_for_the_sandbox_it_becomes(stack: Any) -> None:
    with _client(stack) as c:
        made: dict[str, Any] = {}
        try:
            assert c.put("/v1/pools/base", json={"size": 1}).status_code == 200
            _wait(lambda: any(p["template"] == "base" and p["ready"] == 1 for p in c.get("/v1/pools").json()["pools"]),
                  "a ready warm slot", timeout_s=240)
            ready = _ready_slots(stack)
            made = c.post("/v1/sandboxes", json={"template": "base"}).json()
            assert made["state"] == "running", made
            assert made["id"] in ready  # it was the slot (a slot's id is its sandbox's)
            b = _binding(stack, made)
            assert b.generation == 1 and _tap_exists(b.tap)
            seen = _probe(c, made["id"], {"tcp": [[b.host_addr, int(stack.ports.api)]]})
            assert seen["addr"] == b.guest_addr and seen["default_routes"] == [[seen["nic"], b.host_addr]]
            _assert_fails_fast(seen["tcp"])
            certs, _ = _guest_certs(c, made["id"])
            assert certs[-1].strip() == b.ca_cert_pem.strip()
        finally:
            c.put("/v1/pools/base", json={"size": 0})
            if made:
                c.delete(f"/v1/sandboxes/{made['id']}")
