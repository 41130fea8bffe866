"""Gateway egress decisions (services/gateway/policy.py): wildcards, CIDRs, ports, deny wins, the ranges no
policy opens, and the name/address consistency check."""

from __future__ import annotations

import pytest

from podbay.contracts.egress import EgressPolicy
from podbay.egress_ranges import parse_cidrs
from podbay_gateway.policy import (
    always_denied,
    cidr_allows,
    decide,
    decide_name,
    name_matches,
    normalise_name,
    transform_headers,
)


def _policy(allow: list[dict] | None = None, deny: list[dict] | None = None) -> EgressPolicy:
    return EgressPolicy.model_validate({"allow": allow or [], "deny": deny or []})


@pytest.mark.parametrize(
    ("pattern", "name", "hit"),
    [
        ("api.github.com", "api.github.com", True),
        ("api.github.com", "API.GitHub.com.", True),
        ("api.github.com", "x.api.github.com", False),
        ("*.github.com", "api.github.com", True),
        ("*.github.com", "a.b.github.com", True),
        ("*.github.com", "github.com", False),
        ("*.github.com", "evilgithub.com", False),
        ("*.github.com", "github.com.evil.net", False),
    ],
)
def test_name_matches(pattern: str, name: str, hit: bool) -> None:
    assert name_matches(pattern, name) is hit


def test_normalise_name_drops_port_dot_and_ip_literals() -> None:
    assert normalise_name("Example.COM.:8443") == "example.com"
    assert normalise_name("192.0.2.1") is None
    assert normalise_name("[2001:db8::1]:443") is None
    assert normalise_name("") is None


@pytest.mark.parametrize(
    ("addr", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.9.9.9", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "link_local"),
        ("169.254.1.1", "link_local"),
        ("fe80::1", "link_local"),
        ("224.0.0.251", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("255.255.255.255", "broadcast"),
        ("::ffff:169.254.169.254", "link_local"),
        ("10.88.3.2", "sandbox_network"),
        ("192.0.2.10", "node_address"),
        ("not-an-ip", "unspecified"),
    ],
)
def test_always_denied_ranges(addr: str, reason: str) -> None:
    d = always_denied(addr, own_addrs=["192.0.2.10"], sandbox_cidr="10.88.0.0/16")
    assert d is not None and not d.allowed and d.reason == reason


def test_public_address_is_not_always_denied() -> None:
    assert always_denied("93.184.216.34", own_addrs=["192.0.2.10"], sandbox_cidr="10.88.0.0/16") is None


def test_always_denied_wins_over_an_allow_everything_policy() -> None:
    policy = _policy(allow=[{"cidr": "0.0.0.0/0"}, {"domain": "*.internal"}])
    for addr in ("169.254.169.254", "127.0.0.1", "10.88.0.1", "192.0.2.10"):
        d = decide(policy, name="meta.internal", addr=addr, port=80, own_addrs=["192.0.2.10"],
                   sandbox_cidr="10.88.0.0/16")
        assert not d.allowed, addr
    assert decide(policy, name=None, addr="93.184.216.7", port=80, sandbox_cidr="10.88.0.0/16").allowed


def test_no_policy_denies_everything() -> None:
    d = decide(None, name="example.com", addr="93.184.216.7", port=443)
    assert not d.allowed and d.reason == "no_policy"
    assert not decide_name(None, "example.com").allowed
    empty = _policy()
    assert decide(empty, name="example.com", addr="93.184.216.7", port=443).reason == "no_allow_rule"


def test_domain_rule_with_ports() -> None:
    policy = _policy(allow=[{"domain": "*.example.com", "ports": [443]}])
    ok = decide(policy, name="api.example.com", addr="93.184.216.7", port=443, name_addrs=["93.184.216.7"])
    assert ok.allowed and ok.reason == "allowed"
    assert decide(policy, name="api.example.com", addr="93.184.216.7", port=80,
                  name_addrs=["93.184.216.7"]).reason == "no_allow_rule"
    assert decide(policy, name="example.com", addr="93.184.216.7", port=443,
                  name_addrs=["93.184.216.7"]).reason == "no_allow_rule"


def test_name_needs_its_own_address() -> None:
    policy = _policy(allow=[{"domain": "api.example.com"}])
    d = decide(policy, name="api.example.com", addr="93.184.218.9", port=443, name_addrs=["93.184.216.7"])
    assert not d.allowed and d.reason == "address_mismatch"
    # name_addrs None: the caller vouches (the address came from our own DNS answer for that name)
    assert decide(policy, name="api.example.com", addr="93.184.218.9", port=443, name_addrs=None).allowed


def test_cidr_rules_and_ports() -> None:
    policy = _policy(allow=[{"cidr": "93.184.216.0/24", "ports": [5432]}])
    assert decide(policy, name=None, addr="93.184.216.7", port=5432).allowed
    assert not decide(policy, name=None, addr="93.184.216.7", port=22).allowed
    assert not decide(policy, name=None, addr="93.184.217.7", port=5432).allowed


def test_deny_wins_over_allow() -> None:
    policy = _policy(allow=[{"domain": "*.example.com"}, {"cidr": "93.184.216.0/24"}],
                     deny=[{"domain": "secret.example.com"}, {"cidr": "93.184.216.66/32", "ports": [443]}])
    assert decide(policy, name="secret.example.com", addr="93.184.216.7", port=443,
                  name_addrs=["93.184.216.7"]).reason == "deny_rule"
    assert decide(policy, name=None, addr="93.184.216.66", port=443).reason == "deny_rule"
    assert decide(policy, name=None, addr="93.184.216.66", port=80).allowed
    assert decide(policy, name="www.example.com", addr="93.184.216.7", port=443,
                  name_addrs=["93.184.216.7"]).allowed


def test_dns_names() -> None:
    policy = _policy(allow=[{"domain": "*.example.com", "ports": [443]}, {"domain": "api.other.org"}],
                     deny=[{"domain": "bad.example.com"}, {"domain": "ports.example.com", "ports": [22]}])
    assert decide_name(policy, "a.example.com").allowed
    assert decide_name(policy, "api.other.org.").allowed
    assert decide_name(policy, "bad.example.com").reason == "deny_rule"
    # a deny rule limited to some ports leaves the name resolvable (other ports may be allowed)
    assert decide_name(policy, "ports.example.com").allowed
    assert decide_name(policy, "other.org").reason == "no_allow_rule"
    assert decide_name(policy, "192.0.2.1").reason == "no_name"


def test_cidr_allows_any_port_unless_denied_on_every_port() -> None:
    policy = _policy(allow=[{"cidr": "93.184.216.0/24", "ports": [443]}],
                     deny=[{"cidr": "93.184.216.66/32"}, {"cidr": "93.184.216.77/32", "ports": [443]}])
    assert cidr_allows(policy, "93.184.216.7")
    assert not cidr_allows(policy, "93.184.216.66")
    assert cidr_allows(policy, "93.184.216.77")  # denied on 443 only: the name may still be learned
    assert not cidr_allows(policy, "93.184.218.1")
    assert not cidr_allows(None, "93.184.216.7")


def test_transform_headers_merge_in_order_case_insensitively() -> None:
    policy = EgressPolicy.model_validate({"transforms": [
        {"domain": "api.example.com", "headers": {"X-Team": "blue", "X-One": "1"}},
        {"domain": "*.example.com", "headers": {"x-team": "red"}},
        {"domain": "other.example.org", "headers": {"X-Other": "o"}}]})
    assert transform_headers(policy, "API.example.com.:443") == {"x-team": "red", "X-One": "1"}
    assert transform_headers(policy, "www.example.com") == {"x-team": "red"}
    assert transform_headers(policy, "example.com") == {}  # a wildcard is strictly below its suffix
    assert transform_headers(policy, "192.0.2.1") == {} and transform_headers(policy, None) == {}
    assert transform_headers(None, "api.example.com") == {}


@pytest.mark.parametrize(("addr", "reason"), [
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("100.64.0.1", "shared"),
    ("169.254.169.254", "link_local"), ("127.0.0.1", "loopback"), ("192.0.2.1", "reserved"),
    ("::ffff:10.1.2.3", "private"), ("64:ff9b::192.168.1.1", "private"), ("fd00::1", "private"),
    ("10.77.3.1", "stack_network"),
])
def test_allow_everything_means_the_public_internet(addr: str, reason: str) -> None:
    policy = _policy(allow=[{"cidr": "0.0.0.0/0"}, {"cidr": "::/0"}, {"domain": "*.example.com"}])
    d = decide(policy, name=None, addr=addr, port=443, sandbox_cidr="10.88.0.0/16")
    assert not d.allowed and d.reason == reason, d
    # by name too: a name that resolves into a private range leads nowhere
    d = decide(policy, name="internal.example.com", addr=addr, port=443, name_addrs=[addr],
               sandbox_cidr="10.88.0.0/16")
    assert not d.allowed and d.reason == reason, d
    assert decide(policy, name=None, addr="93.184.216.34", port=443, sandbox_cidr="10.88.0.0/16").allowed


def test_operator_allow_list_opens_a_range_but_never_the_stack_s_own_addresses() -> None:
    allow = parse_cidrs("10.0.0.0/8, 192.168.7.0/24")
    everything = _policy(allow=[{"cidr": "0.0.0.0/0"}])

    def reason(addr: str, policy: EgressPolicy | None = None) -> str:
        return decide(policy or everything, name=None, addr=addr, port=80, own_addrs=["10.5.0.1"], sandbox_cidr="10.88.0.0/16",
                      operator_allow=allow).reason

    assert reason("10.9.9.9") == "allowed" and reason("192.168.7.7") == "allowed"
    assert reason("192.168.8.7") == "private" and reason("172.16.0.1") == "private"
    for addr, why in (("10.88.0.5", "sandbox_network"), ("10.77.0.1", "stack_network"),
                      ("10.5.0.1", "node_address"), ("::ffff:10.5.0.1", "node_address")):
        assert reason(addr) == why, addr
    # the operator's allow-list opens a range; the tenant's policy still has to allow the address
    assert reason("10.9.9.9", _policy(allow=[{"domain": "*.example.com"}])) == "no_allow_rule"
