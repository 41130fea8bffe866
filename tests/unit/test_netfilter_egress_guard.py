"""The node's nftables egress guard (services/nodeagent/net/netfilter.py): a guest's packets to an always-denied
address are rejected and counted before the redirect to the gateway; DNS and replies to the host's own
connections pass; the operator's allow-list passes on to the redirect; the stack's node bridges and sandbox
network are never opened."""

from __future__ import annotations

import ipaddress
import re

from podbay.egress_ranges import DENIED_RANGES, parse_cidrs
from podbay_nodeagent.net.netfilter import REFUSED_COUNTER, render_ruleset


def _set(text: str, name: str) -> set[str]:
    m = re.search(rf"set {name} {{.*?elements = {{ (.*?) }}", text, re.S)
    assert m is not None, name
    return {e.strip() for e in m.group(1).split(",")}


def test_denied_ranges_are_rejected_and_counted_before_the_redirect() -> None:
    text = render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt", sandbox_cidr="10.130.0.0/16")
    lines = [line.strip() for line in text.splitlines()]
    assert _set(text, "denied_v4") == {str(n) for n, _ in DENIED_RANGES if n.version == 4}
    assert _set(text, "denied_v6") == {str(n) for n, _ in DENIED_RANGES if n.version == 6}
    assert _set(text, "never_v4") == {"10.77.0.0/16", "10.130.0.0/16"}
    for addr in ("169.254.169.254", "10.0.0.1", "172.16.0.1", "192.168.0.1", "100.64.0.1", "127.0.0.1"):
        ip = ipaddress.ip_address(addr)
        assert any(ip in ipaddress.ip_network(e) for e in _set(text, "denied_v4")), addr
    start = lines.index("chain egress_guard {") + 1
    # a filter chain after conntrack (-200) and before the redirect (dstnat, -100)
    assert lines[start:start + 10] == [
        "type filter hook prerouting priority mangle; policy accept;",
        'iifname != "pbxt*" return',
        "ct direction reply return",  # the port proxy's connections into the guest answer back
        "ct state related return",
        "meta l4proto { tcp, udp } th dport 53 return",  # DNS reaches the gateway's DNS wherever it is sent
        "ip daddr @never_v4 goto egress_refuse",
        "ip daddr @denied_v4 goto egress_refuse",
        "ip6 daddr @denied_v6 goto egress_refuse",
        "}",
        "chain egress_refuse {",
    ]
    assert lines[start + 10:start + 13] == [f'counter name "{REFUSED_COUNTER}"',
                                            "meta l4proto tcp reject with tcp reset",  # fails at once
                                            "reject with icmpx admin-prohibited"]
    assert f"counter {REFUSED_COUNTER} {{" in lines


def test_operator_allow_list_is_redirected_but_never_before_the_stack_s_own_networks() -> None:
    text = render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt", sandbox_cidr="10.130.0.0/16",
                          operator_allow=parse_cidrs("192.0.2.0/24, 10.77.0.0/16, fd00::/8"))
    lines = [line.strip() for line in text.splitlines()]
    assert _set(text, "operator_v4") == {"192.0.2.0/24", "10.77.0.0/16"}
    assert _set(text, "operator_v6") == {"fd00::/8"}
    never = lines.index("ip daddr @never_v4 goto egress_refuse")
    assert never < lines.index("ip daddr @operator_v4 return") < lines.index("ip daddr @denied_v4 goto egress_refuse")
    assert lines.index("ip6 daddr @operator_v6 return") < lines.index("ip6 daddr @denied_v6 goto egress_refuse")
    # without an allow-list there is no (empty, hence invalid) operator set
    assert "operator_v4" not in render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt")
