"""The node's sandbox network as pure logic: address plan, tap names, leases, bindings and the ruleset text."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from podbay.config import Settings
from podbay.contracts.egress import NetBinding, binding_path
from podbay.stacknet import SANDBOX_POOL, builder_tap, nft_table, sandbox_cidr, stack_tag, tap_prefix
from podbay_nodeagent.net.netfilter import PORTS_MARK, render_ruleset
from podbay_nodeagent.net.network import (
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


def test_tap_names_carry_the_stacks_prefix_and_fit_ifnamsiz(tmp_path: Path) -> None:
    prefix = tap_prefix(tmp_path)
    assert prefix == f"pb{stack_tag(tmp_path)}t" and len(stack_tag(tmp_path)) == 5
    assert tap_name(prefix, 0) == f"{prefix}0" and tap_name(prefix, 17) == f"{prefix}17"
    biggest = lease_capacity("10.0.0.0/8") - 1
    assert len(tap_name(prefix, biggest)) < IFNAMSIZ
    assert len(builder_tap(tmp_path, 2**31)) < IFNAMSIZ and builder_tap(tmp_path, 7).startswith(prefix)
    with pytest.raises(ValueError):
        tap_name(prefix, 10**13)


def test_two_stacks_never_share_a_tap_prefix_table_or_sandbox_network(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert tap_prefix(a) != tap_prefix(b) and nft_table(a) != nft_table(b)
    # Neither prefix is a prefix of the other's taps (nftables matches "<prefix>*").
    assert not tap_prefix(a).startswith(tap_prefix(b)) and not tap_prefix(b).startswith(tap_prefix(a))
    ca, cb = sandbox_cidr(Settings(data_dir=a)), sandbox_cidr(Settings(data_dir=b))
    pool = ipaddress.ip_network(SANDBOX_POOL)
    for cidr in (ca, cb):
        assert ipaddress.ip_network(cidr).subnet_of(pool)  # type: ignore[arg-type]
    # The choice is kept: the same data directory always gets the same network, whatever the host shows later.
    assert sandbox_cidr(Settings(data_dir=a)) == ca
    assert json.loads((a / "network.json").read_text())["sandbox_cidr"] == ca
    # A configured network wins and is not recorded.
    assert sandbox_cidr(Settings(data_dir=tmp_path / "c", sandbox_cidr="10.99.0.0/24")) == "10.99.0.0/24"
    assert not (tmp_path / "c" / "network.json").exists()


def test_the_chosen_sandbox_network_avoids_blocks_in_use_on_the_host(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import podbay.stacknet as stacknet

    first = stacknet._choose(stack_tag(tmp_path), [])
    taken = [ipaddress.ip_network(first), ipaddress.ip_network("10.0.0.0/9")]  # and everything below the pool
    monkeypatch.setattr(stacknet, "_host_networks", lambda: taken)
    chosen = ipaddress.ip_network(sandbox_cidr(Settings(data_dir=tmp_path)))
    assert not any(chosen.overlaps(t) for t in taken)
    monkeypatch.setattr(stacknet, "_host_networks", lambda: [ipaddress.ip_network(SANDBOX_POOL)])
    with pytest.raises(stacknet.StackNetError):
        sandbox_cidr(Settings(data_dir=tmp_path / "full"))


def test_the_chosen_sandbox_network_avoids_another_registered_stack_s_block(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Two tags can hash to the same start block (8d67a and bd6ba did), and a stack with no sandbox running
    # shows no tap: the other stack's record is what says its block is taken.
    import podbay.stacknet as stacknet

    monkeypatch.setattr(stacknet, "_host_networks", lambda: [])
    mine, other = tmp_path / "mine", tmp_path / "other"
    first = stacknet._choose(stack_tag(mine), [])
    other.mkdir()
    (other / "network.json").write_text(json.dumps({"tag": stack_tag(other), "sandbox_cidr": first}))
    registry = tmp_path / "stacks"
    registry.mkdir()
    (registry / stack_tag(other)).write_text(str(other))
    (registry / "ffff0").write_text(str(tmp_path / "gone"))  # a record without a data directory is skipped
    chosen = sandbox_cidr(Settings(data_dir=mine), registry=registry)
    assert chosen != first
    assert not ipaddress.ip_network(chosen).overlaps(ipaddress.ip_network(first))


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
    assert (b1.tap, b1.host_addr, b1.guest_addr, b1.prefix_len) == (f"{tap_prefix(tmp_path)}0", "10.88.0.1",
                                                                     "10.88.0.2", 30)
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
    text = render_ruleset(8094, 8053, table="podbay_1a2b3", tap_prefix="pb1a2b3t")
    lines = [line.strip() for line in text.splitlines()]
    # Replaces only its own table, atomically (create-if-missing, delete, define).
    table = "podbay_1a2b3"
    assert lines[:3] == [f"table inet {table}", f"delete table inet {table}", f"table inet {table} {{"]
    taps = 'iifname "pb1a2b3t*"'
    assert f"{taps} fib saddr . iif oif missing drop" in lines  # no spoofing another sandbox's address
    dns = lines.index(f"{taps} meta l4proto {{ tcp, udp }} th dport 53 redirect to :8053")
    tcp = lines.index(f"{taps} meta l4proto tcp redirect to :8094")
    assert dns < tcp  # DNS over TCP goes to the DNS server, not the proxy
    chain = lines[lines.index("chain from_sandbox {") + 1: lines.index("chain from_sandbox {") + 6]
    # Replies of connections the host opened (the port proxy's, below) come back; nothing else starts here.
    assert chain == ["ct direction reply accept", "meta l4proto tcp th dport 8094 ct status dnat accept",
                     "meta l4proto { tcp, udp } th dport 8053 ct status dnat accept",
                     "meta l4proto tcp reject with tcp reset", "reject with icmpx admin-prohibited"]
    assert f"{taps} jump from_sandbox" in lines
    assert f"{taps} reject with icmpx admin-prohibited" in lines and 'oifname "pb1a2b3t*" drop' in lines
    # The host opens TCP connections into a tap only from the port proxy's marked sockets.
    assert (f'oifname "pb1a2b3t*" meta l4proto tcp ct state new meta mark != {PORTS_MARK:#x} reject with tcp reset'
            in lines)
    assert render_ruleset(8094, 8053, table=table, tap_prefix="pb1a2b3t") == text
    with pytest.raises(ValueError):
        render_ruleset(0, 53, table=table, tap_prefix="pb1a2b3t")


def test_a_tap_is_intact_only_while_the_same_device_exists(tmp_path: Path) -> None:
    net = _net(tmp_path)
    assert net.tap_intact("lo")  # first seen: taken as it is
    assert net.tap_intact("lo")  # the same ifindex again
    net._tap_index["lo"] = 10**6  # as if the device had been deleted and made again under the same name
    assert not net.tap_intact("lo")
    assert not net.tap_intact("pbnone0")  # gone


_IN_NODE_NAMESPACE = """
import subprocess, sys
from pathlib import Path
from podbay.config import Settings
from podbay_nodeagent.net.network import SandboxNetwork
subprocess.run(["ip", "tuntap", "add", "pbnsdev0", "mode", "tap"], check=True)
net = SandboxNetwork(Settings(data_dir=Path(sys.argv[1]), node_id="node-a"))
print(net.tap_intact("pbnsdev0"), net.tap_intact("pbnsnone0"))
"""


@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="needs root and unshare(1)")
def test_a_tap_in_the_node_agents_own_network_namespace_is_seen(tmp_path: Path) -> None:
    # A multi-node stack enters each node agent into its namespace with nsenter --net only: /sys/class/net is
    # still the host's there, so the device must be looked up in the namespace itself. The device lives and
    # dies with the throwaway namespace.
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", _IN_NODE_NAMESPACE, str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_every_tap_of_a_lease_has_the_same_locally_administered_mac() -> None:
    from podbay_nodeagent.net.network import tap_mac

    assert tap_mac("10.130.2.1") == "02:70:62:82:02:01" == tap_mac("10.130.2.1")
    assert tap_mac("10.130.2.5") != tap_mac("10.130.2.1")
    first = int(tap_mac("10.130.2.1").split(":")[0], 16)
    assert first & 0b10 and not first & 0b1  # locally administered, unicast


def test_taps_are_checked_from_one_listing_of_the_devices(tmp_path: Path) -> None:
    net = _net(tmp_path)
    assert net.taps_intact(["lo", "pbnone0"]) == {"lo": True, "pbnone0": False}
    net._tap_index["lo"] = 10**6  # as if the device had been deleted and made again under the same name
    assert net.taps_intact(["lo"]) == {"lo": False}
    assert net.taps_intact([]) == {}


_LISTED_IN_NODE_NAMESPACE = """
import subprocess, sys
from pathlib import Path
from podbay.config import Settings
from podbay_nodeagent.net.network import SandboxNetwork
subprocess.run(["ip", "tuntap", "add", "pbnsdev0", "mode", "tap"], check=True)
net = SandboxNetwork(Settings(data_dir=Path(sys.argv[1]), node_id="node-a"))
print(net.taps_intact(["pbnsdev0", "pbnsnone0"]))
subprocess.run(["ip", "link", "del", "pbnsdev0"], check=True)
print(net.taps_intact(["pbnsdev0"]))
subprocess.run(["ip", "tuntap", "add", "pbnsdev0", "mode", "tap"], check=True)
print(net.taps_intact(["pbnsdev0"]))
"""


@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="needs root and unshare(1)")
def test_the_listing_sees_a_tap_deleted_or_made_again_in_the_node_agents_namespace(tmp_path: Path) -> None:
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", _LISTED_IN_NODE_NAMESPACE, str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["{'pbnsdev0': True, 'pbnsnone0': False}", "{'pbnsdev0': False}",
                                       "{'pbnsdev0': False}"]  # made again: another device under its name
