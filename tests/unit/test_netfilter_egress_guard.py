"""The node's nftables egress guard (services/nodeagent/netfilter.py): a guest's TCP to an always-denied
address is never redirected to the gateway's proxy (so the ruleset's reset meets it), counted; the operator's
allow-list is redirected as usual; the stack's node bridges and sandbox network are never opened."""

from __future__ import annotations

import ipaddress
import re

from podbay.egress_ranges import DENIED_RANGES, parse_cidrs
from podbay_nodeagent.netfilter import REFUSED_COUNTER, render_ruleset


def _set(text: str, name: str) -> set[str]:
    m = re.search(rf"set {name} {{.*?elements = {{ (.*?) }}", text, re.S)
    assert m is not None, name
    return {e.strip() for e in m.group(1).split(",")}


def test_denied_ranges_skip_the_redirect_and_are_counted() -> None:
    text = render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt", sandbox_cidr="10.130.0.0/16")
    lines = [line.strip() for line in text.splitlines()]
    taps = 'iifname "pbxt*"'
    dns = lines.index(f"{taps} meta l4proto {{ tcp, udp }} th dport 53 redirect to :8053")
    guard = lines.index(f"{taps} meta l4proto tcp jump egress_guard")
    tcp = lines.index(f"{taps} meta l4proto tcp redirect to :8094")
    assert dns < guard < tcp  # DNS still reaches the gateway's DNS wherever it is sent; the guard precedes the proxy
    assert _set(text, "denied_v4") == {str(n) for n, _ in DENIED_RANGES if n.version == 4}
    assert _set(text, "denied_v6") == {str(n) for n, _ in DENIED_RANGES if n.version == 6}
    assert _set(text, "never_v4") == {"10.77.0.0/16", "10.130.0.0/16"}
    for metadata in ("169.254.169.254", "10.0.0.1", "172.16.0.1", "192.168.0.1", "100.64.0.1", "127.0.0.1"):
        ip = ipaddress.ip_address(metadata)
        assert any(ip in ipaddress.ip_network(e) for e in _set(text, "denied_v4")), metadata
    chain = lines[lines.index("chain egress_guard {") + 1: lines.index("chain egress_guard {") + 4]
    assert chain == [f'ip daddr @never_v4 counter name "{REFUSED_COUNTER}" accept',
                     f'ip daddr @denied_v4 counter name "{REFUSED_COUNTER}" accept',
                     f'ip6 daddr @denied_v6 counter name "{REFUSED_COUNTER}" accept']
    assert f"counter {REFUSED_COUNTER} {{" in lines
    # un-redirected TCP from a tap meets a reset: forward (another host) and from_sandbox (this host)
    assert f"{taps} meta l4proto tcp reject with tcp reset" in lines
    assert "meta l4proto tcp reject with tcp reset" in lines


def test_operator_allow_list_is_redirected_but_never_before_the_stack_s_own_networks() -> None:
    text = render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt", sandbox_cidr="10.130.0.0/16",
                          operator_allow=parse_cidrs("192.0.2.0/24, 10.77.0.0/16, fd00::/8"))
    lines = [line.strip() for line in text.splitlines()]
    assert _set(text, "operator_v4") == {"192.0.2.0/24", "10.77.0.0/16"}
    assert _set(text, "operator_v6") == {"fd00::/8"}
    never = lines.index(f'ip daddr @never_v4 counter name "{REFUSED_COUNTER}" accept')
    assert never < lines.index("ip daddr @operator_v4 return") < lines.index(
        f'ip daddr @denied_v4 counter name "{REFUSED_COUNTER}" accept')
    assert lines.index("ip6 daddr @operator_v6 return") < lines.index(
        f'ip6 daddr @denied_v6 counter name "{REFUSED_COUNTER}" accept')
    # without an allow-list there is no (empty, hence invalid) operator set
    assert "operator_v4" not in render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt")
