"""Guest vs host and the networks behind it: a sandbox whose egress policy allows everything (``0.0.0.0/0``)
reaches no private or reserved range and none of the stack's own addresses (docs/egress.md, "Always denied";
libs/podbay/egress_ranges.py, services/gateway/policy.py, services/nodeagent/net/netfilter.py).

A real microVM of the session stack, its gateway running, probes with short timeouts, all at once (the whole
probe is bounded to about 10 s): one address in each private range (10/8, 172.16/12, 192.168/16, CGNAT
100.64/10, the metadata address 169.254.169.254), and the stack's own addresses (the tap's host side, which is
the guest's gateway; this host's other addresses) on the ports of the node agent's data plane, the API,
PostgreSQL, NATS, the gateway's proxy and a host service listening on every address for this test. Nothing
connects, over TCP or UDP. Only addresses on this host or that nothing owns are used: the TCP probes to
unowned private addresses are counted by the node's ruleset (the named counter ``egress_refused`` of the
stack's table) as stopped before the proxy, so no packet of theirs leaves the host.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from podbay.contracts.egress import NetBinding, bindings_dir
from podbay.egress_ranges import parse_cidrs, range_kind
from podbay.stacknet import nft_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

#: One address in each private range no sandbox may reach; nothing on this host owns them.
PRIVATE = ["10.0.0.1", "172.16.0.1", "192.168.0.1", "100.64.0.1", "169.254.169.254"]

#: Runs in the guest as ``python3 -c PROBE '<json>'``: TCP connects and UDP exchanges, each in a thread with
#: a 3 s timeout; prints ``{"tcp": {"host:port": outcome}, "udp": {...}}``.
PROBE = r"""
import json, socket, sys, threading
targets = json.loads(sys.argv[1])
out = {"tcp": {}, "udp": {}}

def tcp(host, port):
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        try:
            data = s.recv(64)
        except socket.timeout:
            data = b""
        return "connected:" + data.decode(errors="replace").strip()
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

def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.sendto(b"probe", (host, port))
        return "answered:" + s.recvfrom(512)[0].decode(errors="replace")
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "errno:%d" % e.errno
    finally:
        s.close()

def run(kind, host, port):
    out[kind]["%s:%d" % (host, port)] = (tcp if kind == "tcp" else udp)(host, port)

threads = [threading.Thread(target=run, args=(k, h, p)) for k in ("tcp", "udp") for h, p in targets.get(k, [])]
for t in threads:
    t.start()
for t in threads:
    t.join(10)
print(json.dumps(out))
"""


def _client(stack: Any) -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=120)


def _binding(stack: Any, sandbox: dict[str, Any]) -> NetBinding:
    for f in bindings_dir(Path(stack.data_dir), sandbox["node_id"]).glob("*.json"):
        b = NetBinding.model_validate_json(f.read_text())
        if b.sandbox_id == sandbox["id"]:
            return b
    raise AssertionError(f"no binding for {sandbox['id']}")


def _host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback and sandbox taps (of any stack)."""
    out = json.loads(subprocess.run(["ip", "-4", "-j", "addr", "show"], capture_output=True, text=True,
                                    check=True).stdout)
    return [a["local"] for link in out if not link["ifname"].startswith("pb")
            for a in link.get("addr_info", []) if not a["local"].startswith("127.")]


def _refused_count(stack: Any) -> int:
    out = subprocess.run(["nft", "-j", "list", "counter", "inet", nft_table(Path(stack.data_dir)), "egress_refused"],
                         capture_output=True, text=True, check=True).stdout
    return int(next(o["counter"]["packets"] for o in json.loads(out)["nftables"] if "counter" in o))


@contextlib.contextmanager
def _host_service(banner: bytes) -> Iterator[int]:
    """TCP and UDP on 0.0.0.0:<port> answering everyone with ``banner`` (what a guest must never see)."""
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", 0))
    port = tcp.getsockname()[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    tcp.listen(16)
    tcp.settimeout(0.2)
    udp.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = tcp.accept()
                with conn:
                    conn.sendall(banner)
            with contextlib.suppress(OSError):
                _, peer = udp.recvfrom(512)
                udp.sendto(banner, peer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield port
    finally:
        stop.set()
        t.join(5)
        tcp.close()
        udp.close()


def test_allow_everything_reaches_no_private_range_and_none_of_the_stack_s_addresses(stack: Any) -> None:
    with _client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base", "network": {"allow": [{"cidr": "0.0.0.0/0"}]}})
        assert r.status_code == 201, r.text
        sb = r.json()
        try:
            assert sb["state"] == "running", sb
            b = _binding(stack, sb)
            p = stack.ports
            with _host_service(b"host-service") as service:
                own_ports = [int(p.node), int(p.api), int(p.pg), int(p.nats), int(p.gateway_proxy), service]
                own = [[h, port] for h in [b.host_addr, *_host_addresses()] for port in own_ports]
                private = [[h, port] for h in PRIVATE for port in (80, 443)]
                targets = {"tcp": private + own,
                           "udp": [[b.host_addr, service], *[[h, service] for h in _host_addresses()],
                                   ["10.0.0.1", 9], ["169.254.169.254", 80]]}
                before = _refused_count(stack)
                started = time.monotonic()
                r = c.post(f"/v1/sandboxes/{sb['id']}/exec",
                           json={"argv": ["python3", "-c", PROBE, json.dumps(targets)], "timeout_s": 60})
                took = time.monotonic() - started
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            seen = json.loads(r.json()["stdout"])
            assert len(seen["tcp"]) == len(targets["tcp"]) and len(seen["udp"]) == len(targets["udp"]), seen
            for target, outcome in seen["tcp"].items():
                assert outcome in ("refused", "reset", "unreachable", "timeout"), (target, outcome)
            for target, outcome in seen["udp"].items():
                assert not outcome.startswith("answered"), (target, outcome)
            # The stack's own addresses fail fast (the ruleset's reset), not by a timeout. A public address of
            # this host (none here, usually) goes to the gateway, which closes it (node_address) unanswered.
            allow = parse_cidrs(stack.base_env.get("PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS", ""))
            stopped = [t for t in targets["tcp"] if range_kind(t[0], allow) is not None]
            for h, port in own:
                fast = ("refused", "reset", "unreachable") if [h, port] in stopped else ("reset", "connected:")
                assert seen["tcp"][f"{h}:{port}"] in fast, (h, port, seen["tcp"])
            # Every TCP probe into an always-denied range was stopped by the node's ruleset before the proxy
            # (counted), so none went out.
            assert len(stopped) >= len(private) + len(own_ports)
            assert _refused_count(stack) - before >= len(stopped), (before, _refused_count(stack))
            assert took < 30, took
        finally:
            c.delete(f"/v1/sandboxes/{sb['id']}")
