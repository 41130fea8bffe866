"""Address ranges no sandbox may reach, whatever its egress policy (docs/egress.md, "Always denied").

One table, :data:`DENIED_RANGES`, read by the gateway (``services/gateway/policy.py``: every connection and
every DNS answer, on the address actually used) and rendered into the node's nftables ruleset
(``services/nodeagent/net/netfilter.py``: a guest's packets to these ranges are never redirected to the proxy,
so they meet the ruleset's reject even if the gateway were to fail open). A tenant's ``0.0.0.0/0`` (or
``::/0``) therefore means the public internet.

The table starts from the IANA special-purpose registries (what :mod:`ipaddress`'s ``is_global`` leaves
out), written out here so that both enforcement points deny the same set on every Python version, plus
multicast (which ``ipaddress`` counts as global) and, for IPv6, everything outside global unicast
``2000::/3``. Embedded IPv4 forms are judged as the IPv4 address they carry: IPv4-mapped ``::ffff:a.b.c.d``
and NAT64 ``64:ff9b::a.b.c.d`` (so ``64:ff9b::10.0.0.1`` is private, ``64:ff9b::8.8.8.8`` is not).

Operator override: ``PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS`` (``settings.egress_operator_allow_cidrs``, a
comma-separated list of CIDRs, node agent and gateway) lifts the range denial for addresses inside those
networks; tenants' policies never can. The stack's own addresses (this node's addresses, the sandbox
network, the node bridge pool :data:`STACK_BRIDGE_POOL`) are denied by the gateway before the override is
read: no setting opens them.

Kinds (a closed set; they are the gateway's denial reasons and metric labels): ``unspecified``,
``loopback``, ``private`` (RFC 1918, IPv6 unique-local and site-local), ``shared`` (CGNAT 100.64.0.0/10),
``link_local`` (169.254.0.0/16 with the metadata address 169.254.169.254, fe80::/10), ``multicast``,
``broadcast``, ``reserved`` (documentation, benchmarking, protocol assignments, 240.0.0.0/4, IPv6 outside
global unicast).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

__all__ = ["DENIED_RANGES", "RANGE_KINDS", "STACK_BRIDGE_POOL", "TEST_PEER_NETS", "IPAddress", "IPNetwork", "unwrap",
           "range_kind", "parse_cidrs", "nft_elements"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The node bridges of multi-node stacks (``podbay.devstack.netns``): node agents, and the API, PostgreSQL
#: and NATS on the bridge's host address. Never reachable from a sandbox.
STACK_BRIDGE_POOL = "10.77.0.0/16"

#: Two IPv4 documentation ranges (RFC 5737 TEST-NET-2 and TEST-NET-3): never routed on the internet, so test
#: peers (network namespaces of the test harness) take their addresses from them and the test stacks
#: allow-list them as an operator would (``PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS``); every other always-denied
#: range stays shut there. TEST-NET-1 (192.0.2.0/24) is left out: some hosts number their own network from it.
TEST_PEER_NETS = "198.51.100.0/24, 203.0.113.0/24"

#: ``(network, kind)``, most specific first where they nest (the first match names the kind).
DENIED_RANGES: tuple[tuple[IPNetwork, str], ...] = tuple((ipaddress.ip_network(n), k) for n, k in (
    # IPv4
    ("0.0.0.0/8", "unspecified"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "shared"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link_local"),  # the cloud metadata address 169.254.169.254 included
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "reserved"),  # IETF protocol assignments
    ("192.0.2.0/24", "reserved"),  # TEST-NET-1
    ("192.88.99.0/24", "reserved"),  # 6to4 relay anycast (deprecated)
    ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "reserved"),  # benchmarking
    ("198.51.100.0/24", "reserved"),  # TEST-NET-2
    ("203.0.113.0/24", "reserved"),  # TEST-NET-3
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("240.0.0.0/4", "reserved"),
    # IPv6 (mapped and NAT64 forms are unwrapped first; see unwrap())
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::ffff:0:0/96", "reserved"),  # only reached by nftables, which cannot unwrap
    ("64:ff9b:1::/48", "reserved"),  # local-use NAT64
    ("100::/64", "reserved"),  # discard-only
    ("2001::/23", "reserved"),  # IETF protocol assignments (Teredo, ORCHID, benchmarking)
    ("2001:db8::/32", "reserved"),  # documentation
    ("2002::/16", "reserved"),  # 6to4 (deprecated; carries arbitrary IPv4)
    ("3fff::/20", "reserved"),  # documentation
    ("fc00::/7", "private"),  # unique local
    ("fe80::/10", "link_local"),
    ("fec0::/10", "private"),  # site local (deprecated)
    ("ff00::/8", "multicast"),
    # IPv6 outside global unicast 2000::/3 (what remains of it after the entries above)
    ("::/3", "reserved"),
    ("4000::/2", "reserved"),
    ("8000::/1", "reserved"),
))

#: Every kind :func:`range_kind` may return.
RANGE_KINDS: frozenset[str] = frozenset(k for _, k in DENIED_RANGES)

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def unwrap(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv4-mapped (``::ffff:a.b.c.d``) or NAT64 (``64:ff9b::a.b.c.d``) IPv6 address
    carries; any other address unchanged."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def range_kind(addr: str | IPAddress, operator_allow: Sequence[IPNetwork] = ()) -> str | None:
    """The kind of always-denied range ``addr`` lies in, or ``None`` (a public address, or one inside an
    operator-allowed network). Embedded IPv4 forms are judged as their IPv4 address (:func:`unwrap`), the
    operator's networks too. An address that does not parse is ``"unspecified"``. Never raises."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0]) if isinstance(addr, str) else addr
    except ValueError:
        return "unspecified"
    ip = unwrap(ip)
    if any(ip.version == net.version and ip in net for net in operator_allow):
        return None
    for net, kind in DENIED_RANGES:
        if ip.version == net.version and ip in net:
            return kind
    return None


def parse_cidrs(text: str | Iterable[str]) -> list[IPNetwork]:
    """Networks from a comma- (or space-) separated list such as ``"10.20.0.0/16, 192.0.2.7"`` (a bare address
    is its /32 or /128; host bits are ignored). Raises ``ValueError`` naming the entry that does not parse."""
    items = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    out: list[IPNetwork] = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a CIDR: {exc}") from exc
    return out


def nft_elements(nets: Iterable[IPNetwork], version: int) -> str:
    """The ``elements = { ... }`` body for an nftables interval set of ``version`` (4 or 6), e.g.
    ``"10.0.0.0/8, 127.0.0.0/8"``; empty when there is none of that version."""
    return ", ".join(str(n) for n in nets if n.version == version)
