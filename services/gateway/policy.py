"""Egress decisions (pure logic; no network, no database, no mitmproxy).

The semantics are those of :mod:`podbay.contracts.egress`: default deny; allowed when an ``allow`` rule
matches and no ``deny`` rule does; a rule names a domain (exact or ``*.`` wildcard) or a CIDR, plus optional
ports. Before any rule is read, :func:`always_denied` refuses the sandbox network, the node bridges and the
node's own addresses, then every range of :mod:`podbay.egress_ranges` (private, CGNAT, link-local with the
metadata address 169.254.169.254, loopback, multicast, reserved; IPv6 equivalents) unless the operator's
allow-list opens it: a tenant's ``0.0.0.0/0`` means the public internet.

A name-based decision (TLS SNI, HTTP Host, DNS) is only as good as the address it leads to: a guest could
send ``Host: allowed.example`` to any address. :func:`decide` therefore allows a name only when the
destination address is one the name resolved to (``name_addrs``: what this gateway's DNS answered to this
sandbox, or a fresh resolution); otherwise the decision is a denial with reason ``address_mismatch``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from podbay.contracts.egress import EgressPolicy, EgressRule, name_matches
from podbay.egress_ranges import DENIED_RANGES, STACK_BRIDGE_POOL, IPAddress, IPNetwork, range_kind, unwrap

__all__ = [
    "Decision",
    "ALWAYS_DENIED_NETS",
    "always_denied",
    "name_matches",
    "normalise_name",
    "decide",
    "decide_name",
    "cidr_allows",
    "transform_headers",
]

#: Networks no sandbox may reach, whatever its policy: :data:`podbay.egress_ranges.DENIED_RANGES` (the
#: operator's allow-list may open them), plus the node's own addresses, the sandbox network and
#: :data:`podbay.egress_ranges.STACK_BRIDGE_POOL`, which nothing opens.
ALWAYS_DENIED_NETS: tuple[tuple[IPNetwork, str], ...] = DENIED_RANGES
_STACK_BRIDGES = ipaddress.ip_network(STACK_BRIDGE_POOL)


@dataclass(frozen=True)
class Decision:
    """The outcome for one destination.

    ``reason`` is a small closed set (a metric label): ``allowed``, ``no_policy``, ``no_allow_rule``,
    ``deny_rule``, ``address_mismatch``, ``no_name``, or one of the always-denied kinds (``private``,
    ``shared``, ``loopback``, ``link_local``, ``multicast``, ``unspecified``, ``broadcast``, ``reserved``,
    ``node_address``, ``sandbox_network``, ``stack_network``).
    ``message`` explains it to a person (it is sent to the guest in a 403 body and logged).
    """

    allowed: bool
    reason: str
    message: str

    @classmethod
    def allow(cls, message: str) -> Decision:
        return cls(True, "allowed", message)

    @classmethod
    def deny(cls, reason: str, message: str) -> Decision:
        return cls(False, reason, message)


def normalise_name(name: str | None) -> str | None:
    """Lower-case, no final dot, no port; ``None`` for an empty name or a bare IP address (not a name)."""
    if not name:
        return None
    name = name.strip().lower().rstrip(".")
    if name.startswith("[") or name.count(":") > 1:  # a bracketed or bare IPv6 literal
        return None
    name = name.split(":", 1)[0].rstrip(".")
    if not name:
        return None
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        return name


def transform_headers(policy: EgressPolicy | None, name: str | None) -> dict[str, str]:
    """The headers the policy's ``transforms`` set on a request to ``name`` (every matching transform, in
    order; a later one's value for a header wins; names compared case-insensitively). With ``transform_match``
    ``most_specific`` (E2B's rules: "exact rules take precedence, followed by the longest matching wildcard
    suffix, and matching rule sets are not merged") only the transforms of that one domain apply. Empty
    without a name."""
    norm = normalise_name(name)
    if policy is None or norm is None:
        return {}
    matching = [t for t in policy.transforms if name_matches(t.domain, norm)]
    if matching and policy.transform_match == "most_specific":
        best = max((t.domain for t in matching), key=lambda d: (d == norm, len(d)))
        matching = [t for t in matching if t.domain == best]
    out: dict[str, tuple[str, str]] = {}
    for t in matching:
        out.update({k.lower(): (k, v) for k, v in t.headers.items()})
    return dict(out.values())


def always_denied(addr: str | IPAddress, *, own_addrs: Iterable[str] = (), sandbox_cidr: str | None = None,
                  operator_allow: Sequence[IPNetwork] = ()) -> Decision | None:
    """The denial for an address no tenant's policy may open, else ``None``.

    In order: the sandbox network (``sandbox_network``), the node bridges (``stack_network``), an address of
    this node (``node_address``): never opened; then the ranges of :data:`podbay.egress_ranges.DENIED_RANGES`
    (reason = the range's kind: ``private``, ``shared``, ``loopback``, ``link_local``, ``reserved``, ...),
    unless the address lies in one of ``operator_allow`` (``settings.egress_operator_allow_cidrs``).
    IPv4-mapped and NAT64 IPv6 addresses are judged as the IPv4 address they carry. An address that does not
    parse is denied (``unspecified``)."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0]) if isinstance(addr, str) else addr
    except ValueError:
        return Decision.deny("unspecified", f"{addr!r} is not an IP address")
    ip = unwrap(ip)
    if sandbox_cidr:
        net = ipaddress.ip_network(sandbox_cidr, strict=False)
        if ip.version == net.version and ip in net:
            return Decision.deny("sandbox_network", f"{ip} is in the sandbox network {net}")
    if ip.version == 4 and ip in _STACK_BRIDGES:
        return Decision.deny("stack_network", f"{ip} is in the stack's node network {_STACK_BRIDGES}")
    for own in own_addrs:
        try:
            if ip == unwrap(ipaddress.ip_address(own.split("%", 1)[0])):
                return Decision.deny("node_address", f"{ip} is an address of this node")
        except ValueError:
            continue
    kind = range_kind(ip, operator_allow)
    if kind is not None:
        return Decision.deny(kind, f"{ip} is a {kind.replace('_', '-')} address, never reachable from a sandbox "
                                   "(an operator may allow a range: PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS)")
    return None


def _port_ok(rule: EgressRule, port: int | None) -> bool:
    return not rule.ports or (port is not None and port in rule.ports)


def _rule_matches(rule: EgressRule, name: str | None, ip: IPAddress | None, port: int | None) -> bool:
    if not _port_ok(rule, port):
        return False
    if rule.domain is not None:
        return name is not None and name_matches(rule.domain, name)
    if ip is None or rule.cidr is None:
        return False
    net = ipaddress.ip_network(rule.cidr, strict=False)
    return ip.version == net.version and ip in net


def decide(
    policy: EgressPolicy | None,
    *,
    name: str | None,
    addr: str,
    port: int,
    name_addrs: Iterable[str] | None = None,
    own_addrs: Iterable[str] = (),
    sandbox_cidr: str | None = None,
    operator_allow: Sequence[IPNetwork] = (),
) -> Decision:
    """Decide a connection to ``addr``:``port`` for which the guest named ``name`` (SNI, Host, or the name
    our DNS answered with this address; ``None`` for a bare address).

    Order: always-denied ranges; no policy -> deny; any matching ``deny`` rule -> deny (deny wins); a matching
    ``allow`` rule -> allow, except that a rule matched *by name* also needs ``addr`` among ``name_addrs``
    (when ``name_addrs`` is ``None`` the caller vouches for the address, e.g. it came from our own DNS
    memory). A matching CIDR rule needs no name.
    """
    hard = always_denied(addr, own_addrs=own_addrs, sandbox_cidr=sandbox_cidr, operator_allow=operator_allow)
    if hard is not None:
        return hard
    if policy is None:
        return Decision.deny("no_policy", "this sandbox has no egress policy (no egress at all)")
    ip = ipaddress.ip_address(addr)
    name = normalise_name(name)
    where = f"{name or addr}:{port}"
    for rule in policy.deny:
        if _rule_matches(rule, name, ip, port):
            return Decision.deny("deny_rule", f"{where} matches deny rule {_show(rule)}")
    by_cidr = next((r for r in policy.allow if r.cidr is not None and _rule_matches(r, name, ip, port)), None)
    if by_cidr is not None:
        return Decision.allow(f"{where} matches allow rule {_show(by_cidr)}")
    by_name = next((r for r in policy.allow if r.domain is not None and _rule_matches(r, name, ip, port)), None)
    if by_name is None:
        return Decision.deny("no_allow_rule", f"no allow rule matches {where}")
    if name_addrs is not None and str(ip) not in {str(ipaddress.ip_address(a)) for a in name_addrs}:
        return Decision.deny("address_mismatch", f"{addr} is not an address of {name}")
    return Decision.allow(f"{where} matches allow rule {_show(by_name)}")


def decide_name(policy: EgressPolicy | None, name: str) -> Decision:
    """May the guest's DNS learn ``name``? Allowed when some ``allow`` domain rule matches it (on any port)
    and no ``deny`` domain rule without ports matches it (a deny rule limited to some ports leaves the name
    reachable on the others)."""
    norm = normalise_name(name)
    if norm is None:
        return Decision.deny("no_name", f"{name!r} is not a host name")
    if policy is None:
        return Decision.deny("no_policy", "this sandbox has no egress policy (no egress at all)")
    for rule in policy.deny:
        if rule.domain is not None and not rule.ports and name_matches(rule.domain, norm):
            return Decision.deny("deny_rule", f"{norm} matches deny rule {_show(rule)}")
    for rule in policy.allow:
        if rule.domain is not None and name_matches(rule.domain, norm):
            return Decision.allow(f"{norm} matches allow rule {_show(rule)}")
    return Decision.deny("no_allow_rule", f"no allow rule names {norm}")


def cidr_allows(policy: EgressPolicy | None, addr: str) -> bool:
    """Whether ``addr`` lies in some ``allow`` CIDR rule and in no ``deny`` CIDR rule without ports (on some
    port it may then be reached). Used by DNS for names no domain rule covers: a policy that opens an address
    range should still let the guest resolve names that lead into it."""
    if policy is None:
        return False
    ip = ipaddress.ip_address(addr)

    def inside(rule: EgressRule) -> bool:
        if rule.cidr is None:
            return False
        net = ipaddress.ip_network(rule.cidr, strict=False)
        return ip.version == net.version and ip in net

    if any(inside(r) and not r.ports for r in policy.deny):
        return False
    return any(inside(r) for r in policy.allow)


def _show(rule: EgressRule) -> str:
    target = rule.domain or rule.cidr
    return f"{target}" + (f" ports {','.join(map(str, rule.ports))}" if rule.ports else "")
