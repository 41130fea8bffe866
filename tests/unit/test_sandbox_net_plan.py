"""The node's sandbox network as pure logic: address plan, tap names, leases, bindings and the ruleset text."""

from __future__ import annotations

import ipaddress
import json
import stat
from pathlib import Path

import pytest

from podbay.config import Settings
from podbay.contracts.egress import TAP_PREFIX, NetBinding, binding_path
from podbay_nodeagent.netfilter import TABLE, render_ruleset
from podbay_nodeagent.network import (
    IFNAMSIZ,
    NetworkError,
    SandboxNetwork,
    lease_addresses,
    lease_capacity,
    lowest_free,
    tap_name,
)


def test_each_lease_is_a_slash_30_with_the_host_on_1_and_the_guest_on_2() -> None:
    assert lease_addresses("10.88.0.0/16", 0) == ("10.88.0.1", "10.88.0.2")
    assert lease_addresses("10.88.0.0/16", 1) == ("10.88.0.5", "10.88.0.6")
    assert lease_addresses("10.88.0.0/16", 16383) == ("10.88.255.253", "10.88.255.254")
    assert lease_capacity("10.88.0.0/16") == 16384 and lease_capacity("192.0.2.0/30") == 1
    with pytest.raises(ValueError):
        lease_addresses("10.88.0.0/16", 16384)
    with pytest.raises(ValueError):
        lease_capacity("fd00::/64")  # the guests' network is IPv4 only
    with pytest.raises(ValueError):
        lease_capacity("10.0.0.0/31")
    # No two leases share an address.
    seen: set[str] = set()
    for i in range(64):
        host, guest = lease_addresses("10.88.0.0/24", i)
        assert ipaddress.ip_address(host) in ipaddress.ip_network(f"{guest}/30", strict=False)
        assert not {host, guest} & seen
        seen |= {host, guest}


def test_tap_names_carry_the_prefix_and_fit_ifnamsiz() -> None:
    assert tap_name(0) == f"{TAP_PREFIX}0" and tap_name(17) == "pbt17"
    biggest = lease_capacity("10.0.0.0/8") - 1
    assert len(tap_name(biggest)) < IFNAMSIZ
    with pytest.raises(ValueError):
        tap_name(10**13)


def test_lowest_free_index_and_exhaustion() -> None:
    assert lowest_free(set(), 4) == 0
    assert lowest_free({0, 1, 3}, 4) == 2
    with pytest.raises(NetworkError):
        lowest_free({0, 1, 2, 3}, 4)


def _net(tmp_path: Path, cidr: str = "10.88.0.0/16") -> SandboxNetwork:
    net = SandboxNetwork(Settings(data_dir=tmp_path, node_id="node-7", sandbox_cidr=cidr))
    net._delete_tap = lambda name: None  # type: ignore[method-assign]  # no taps in unit tests
    for d in (net.dir, net.ca_dir, net.bindings):
        d.mkdir(parents=True, exist_ok=True)
    return net


def test_leases_persist_and_released_addresses_are_reused(tmp_path: Path) -> None:
    net = _net(tmp_path)
    a, b, c = net.lease("sbx_a"), net.lease("sbx_b"), net.lease("sbx_c")
    assert [x.index for x in (a, b, c)] == [0, 1, 2]
    assert net.lease("sbx_b") == b  # asking again changes nothing
    net.release("sbx_b")
    # A restarted agent reads the same leases back.
    assert json.loads((tmp_path / "nodes/node-7/net/leases.json").read_text()) == {"sbx_a": 0, "sbx_c": 2}
    again = _net(tmp_path)
    again.load_leases()
    assert again.leased() == {"sbx_a": a, "sbx_c": c}
    assert again.lease("sbx_d").index == 1  # the lowest free one
    full = _net(tmp_path / "small", "192.0.2.0/30")
    full.lease("sbx_x")
    with pytest.raises(NetworkError):
        full.lease("sbx_y")


def test_a_binding_is_kept_within_a_generation_and_replaced_for_a_new_one(tmp_path: Path) -> None:
    net = _net(tmp_path)
    b1 = net.bind("sbx_a", 1)
    path = binding_path(tmp_path, "node-7", b1.guest_addr)
    assert NetBinding.model_validate_json(path.read_text()) == b1
    assert (b1.tap, b1.host_addr, b1.guest_addr, b1.prefix_len) == ("pbt0", "10.88.0.1", "10.88.0.2", 30)
    ca = Path(b1.ca_path)
    assert stat.S_IMODE(ca.stat().st_mode) == 0o600 and stat.S_IMODE(path.stat().st_mode) == 0o600
    text = ca.read_text()
    assert text.startswith("-----BEGIN PRIVATE KEY-----") and text.endswith(b1.ca_cert_pem)
    assert net.bind("sbx_a", 1) == b1  # a wake or re-attach at the same generation keeps it
    b2 = net.bind("sbx_a", 2)  # a rollback: new CA, same address, old material gone
    assert b2.ca_cert_pem != b1.ca_cert_pem and b2.guest_addr == b1.guest_addr and b2.generation == 2
    assert not ca.exists() and Path(b2.ca_path).exists()
    child = net.bind("sbx_child", 1)  # a fork child never shares its parent's CA or address
    assert child.ca_cert_pem != b2.ca_cert_pem and child.guest_addr != b2.guest_addr
    g = SandboxNetwork.guest_net(child)
    assert (g.address, g.gateway, g.dns, g.prefix_len) == (child.guest_addr, child.host_addr, [child.host_addr], 30)
    assert g.ca_cert_pem == child.ca_cert_pem


def test_release_and_prune_remove_bindings_and_ca_files(tmp_path: Path) -> None:
    net = _net(tmp_path)
    a, b, c = net.bind("sbx_a", 1), net.bind("sbx_b", 3), net.bind("sbx_c", 1)
    net.release("sbx_a")
    assert not binding_path(tmp_path, "node-7", a.guest_addr).exists() and not Path(a.ca_path).exists()
    assert net.binding("sbx_a") is None and net.binding("sbx_b") == b
    net.release("sbx_a")  # idempotent
    stray = net.bindings / "10.88.9.9.json"
    stray.write_text("{}")
    assert net.prune({"sbx_b"}) == ["sbx_c"]
    assert not stray.exists() and not Path(c.ca_path).exists()
    assert sorted(p.name for p in net.bindings.iterdir()) == [f"{b.guest_addr}.json"]
    assert [p.name for p in net.ca_dir.iterdir()] == [Path(b.ca_path).name]


def test_the_ruleset_sends_taps_to_the_gateway_and_rejects_the_rest() -> None:
    text = render_ruleset(8094, 8053)
    lines = [line.strip() for line in text.splitlines()]
    # Replaces only its own table, atomically (create-if-missing, delete, define).
    assert lines[:3] == [f"table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    taps = f'iifname "{TAP_PREFIX}*"'
    assert f"{taps} fib saddr . iif oif missing drop" in lines  # no spoofing another sandbox's address
    dns = lines.index(f"{taps} meta l4proto {{ tcp, udp }} th dport 53 redirect to :8053")
    tcp = lines.index(f"{taps} meta l4proto tcp redirect to :8094")
    assert dns < tcp  # DNS over TCP goes to the DNS server, not the proxy
    chain = lines[lines.index("chain from_sandbox {") + 1: lines.index("chain from_sandbox {") + 5]
    assert chain == ["meta l4proto tcp th dport 8094 ct status dnat accept",
                     "meta l4proto { tcp, udp } th dport 8053 ct status dnat accept",
                     "meta l4proto tcp reject with tcp reset", "reject with icmpx admin-prohibited"]
    assert f"{taps} jump from_sandbox" in lines
    assert f"{taps} reject with icmpx admin-prohibited" in lines and f'oifname "{TAP_PREFIX}*" drop' in lines
    assert render_ruleset(8094, 8053) == text
    with pytest.raises(ValueError):
        render_ruleset(0, 53)
