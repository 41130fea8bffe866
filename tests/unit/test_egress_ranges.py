"""The always-denied address ranges (libs/podbay/egress_ranges.py): every range, IPv4 and IPv6, the embedded
IPv4 forms (mapped, NAT64), the operator's allow-list, and agreement with :mod:`ipaddress`'s idea of global."""

from __future__ import annotations

import ipaddress

import pytest

from podbay.config import Settings
from podbay.egress_ranges import DENIED_RANGES, RANGE_KINDS, nft_elements, parse_cidrs, range_kind, unwrap


@pytest.mark.parametrize(
    ("addr", "kind"),
    [
        # RFC 1918, first, inner and last addresses
        ("10.0.0.0", "private"), ("10.1.2.3", "private"), ("10.255.255.255", "private"),
        ("172.16.0.1", "private"), ("172.20.5.5", "private"), ("172.31.255.254", "private"),
        ("192.168.0.1", "private"), ("192.168.255.255", "private"),
        # CGNAT
        ("100.64.0.1", "shared"), ("100.127.255.254", "shared"),
        # link-local, the cloud metadata address
        ("169.254.169.254", "link_local"), ("169.254.0.1", "link_local"),
        # loopback, unspecified, multicast, broadcast
        ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"), ("224.0.0.251", "multicast"), ("239.255.255.250", "multicast"),
        ("255.255.255.255", "broadcast"),
        # reserved: protocol assignments, documentation, benchmarking, 6to4 relay, class E
        ("192.0.0.9", "reserved"), ("192.0.2.1", "reserved"), ("198.51.100.7", "reserved"),
        ("203.0.113.9", "reserved"), ("198.18.0.1", "reserved"), ("198.19.255.1", "reserved"),
        ("192.88.99.1", "reserved"), ("240.0.0.1", "reserved"), ("254.1.1.1", "reserved"),
        # IPv6
        ("::", "unspecified"), ("::1", "loopback"), ("fc00::1", "private"), ("fd12:3456::1", "private"),
        ("fec0::1", "private"), ("fe80::1", "link_local"), ("febf::1", "link_local"), ("ff02::1", "multicast"),
        ("2001:db8::1", "reserved"), ("3fff::1", "reserved"), ("100::1", "reserved"), ("2001::1", "reserved"),
        ("2002:0a00:0001::1", "reserved"), ("64:ff9b:1::1", "reserved"), ("::2", "reserved"),
        ("4000::1", "reserved"), ("e000::1", "reserved"),
        # IPv4-mapped and NAT64 forms of the IPv4 ranges are judged as the IPv4 address they carry
        ("::ffff:10.0.0.1", "private"), ("::ffff:169.254.169.254", "link_local"), ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:100.64.0.1", "shared"), ("::ffff:192.168.1.1", "private"),
        ("64:ff9b::10.0.0.1", "private"), ("64:ff9b::169.254.169.254", "link_local"),
        ("64:ff9b::7f00:1", "loopback"), ("64:ff9b::172.16.0.1", "private"),
        # zone ids are not part of the address; garbage is denied
        ("fe80::1%eth0", "link_local"), ("not-an-address", "unspecified"),
    ],
)
def test_every_range_is_denied_with_its_kind(addr: str, kind: str) -> None:
    assert range_kind(addr) == kind


@pytest.mark.parametrize("addr", ["93.184.216.34", "8.8.8.8", "1.1.1.1", "172.15.255.255", "172.32.0.1",
                                  "100.63.255.255", "100.128.0.1", "11.0.0.1", "2606:4700::1111",
                                  "2a00:1450::1", "::ffff:8.8.8.8", "64:ff9b::8.8.8.8"])
def test_public_addresses_are_not_denied(addr: str) -> None:
    assert range_kind(addr) is None


def test_unwrap_mapped_and_nat64() -> None:
    assert unwrap(ipaddress.ip_address("::ffff:10.1.2.3")) == ipaddress.ip_address("10.1.2.3")
    assert unwrap(ipaddress.ip_address("64:ff9b::a01:203")) == ipaddress.ip_address("10.1.2.3")
    assert unwrap(ipaddress.ip_address("2001:db8::1")) == ipaddress.ip_address("2001:db8::1")


def test_operator_allow_list_opens_only_its_networks() -> None:
    allow = parse_cidrs("10.20.0.0/16, 192.0.2.7 fd00:1::/64")
    assert range_kind("10.20.3.4", allow) is None
    assert range_kind("::ffff:10.20.3.4", allow) is None  # the mapped form of an allowed address too
    assert range_kind("64:ff9b::10.20.3.4", allow) is None
    assert range_kind("192.0.2.7", allow) is None
    assert range_kind("fd00:1::5", allow) is None
    assert range_kind("10.21.0.1", allow) == "private"
    assert range_kind("192.0.2.8", allow) == "reserved"
    assert range_kind("fd00:2::5", allow) == "private"
    assert range_kind("169.254.169.254", allow) == "link_local"


def test_operator_allow_list_setting_is_validated() -> None:
    assert Settings(egress_operator_allow_cidrs="10.0.0.0/8,192.0.2.1").egress_operator_allow_cidrs
    with pytest.raises(ValueError, match="not a CIDR"):
        Settings(egress_operator_allow_cidrs="10.0.0.0/8,nonsense")
    assert parse_cidrs("") == []


def test_everything_ipaddress_calls_non_global_is_denied() -> None:
    """The table covers what ipaddress leaves out of ``is_global`` (plus multicast), sampled at the first,
    second and last address of each of ipaddress's own private networks and of every table entry."""
    samples: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    nets = [n for n, _ in DENIED_RANGES]
    nets += list(ipaddress.IPv4Address._constants._private_networks)  # type: ignore[attr-defined]
    nets += list(ipaddress.IPv6Address._constants._private_networks)  # type: ignore[attr-defined]
    for net in nets:
        samples += [net.network_address, net.broadcast_address]
        if net.num_addresses > 1:
            samples.append(net.network_address + 1)
    for ip in samples:
        if not ip.is_global or ip.is_multicast:
            assert range_kind(ip) is not None, ip


def test_kinds_are_a_closed_set_and_nft_elements_split_by_family() -> None:
    assert RANGE_KINDS == {"unspecified", "private", "shared", "loopback", "link_local", "reserved", "multicast",
                           "broadcast"}
    nets = parse_cidrs("10.0.0.0/8 fc00::/7 192.168.0.0/16")
    assert nft_elements(nets, 4) == "10.0.0.0/8, 192.168.0.0/16"
    assert nft_elements(nets, 6) == "fc00::/7"
    assert nft_elements(parse_cidrs(""), 4) == ""
