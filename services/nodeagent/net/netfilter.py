"""The node's nftables ruleset (docs/DESIGN.md §6): a sandbox reaches nothing but this node's gateway.

One table per stack, ``table inet podbay_<tag>`` (:func:`podbay.stacknet.nft_table`), installed at
node-agent start before any VM runs (fail closed), and replaced atomically as a whole (``nft -f``: create,
delete, define in one transaction), so a restart with other ports never leaves a mix and no other table on
the host (another stack's included) is touched. For traffic entering one of this stack's sandbox taps
(``iifname "pb<tag>t*"``, :func:`podbay.stacknet.tap_prefix`):

* ``raw_prerouting`` drops a packet whose source address does not route back through the tap it came in
  on (reverse-path check), so a guest cannot pose as another sandbox: the gateway tells sandboxes apart by
  source address.
* ``egress_guard`` (prerouting, after conntrack, before the redirect) rejects (TCP reset, ICMP
  administratively prohibited) and counts in the named counter ``egress_refused`` every packet a guest
  sends to an always-denied address (:mod:`podbay.egress_ranges`: private, CGNAT, link-local with the
  metadata address, loopback, multicast, reserved, IPv6 equivalents; and, whatever the operator says, the
  stack's node bridges and sandbox network), except DNS (port 53, which goes to the gateway's DNS wherever
  it is sent) and replies to connections the host opened. Defence in depth behind the gateway, which
  refuses the same addresses: a guest reaches no private address even if the gateway failed open, and such
  a connection fails at once. The operator's ``PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS`` pass on to the redirect
  (the gateway then decides them by policy).
* ``nat_prerouting`` redirects UDP and TCP port 53 to the gateway's DNS port and every other TCP
  connection to the gateway's transparent proxy port (on the tap's host address).
* ``input`` accepts from a tap only connections that were redirected to those two ports; everything else
  is rejected (TCP reset, ICMP administratively prohibited), so a denied connection fails at once in the
  guest instead of hanging.
* ``forward`` rejects everything from a tap and drops everything towards one: no sandbox reaches another
  sandbox or any other host directly, whatever the host's ``ip_forward``.
* ``output`` refuses every new TCP connection from the host into a tap unless its socket carries
  :data:`PORTS_MARK`, the mark of the node agent's port proxy (services/nodeagent/net/ports.py), and
  ``from_sandbox`` accepts from a tap the replies of connections the host opened (``ct direction reply``):
  the port proxy, which the API's edge drives only after authorising a request for that sandbox and port,
  is the only way into a guest.

Errors: :class:`NetfilterError` (``nft`` missing or refusing the ruleset; not retryable).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Sequence

from podbay.egress_ranges import DENIED_RANGES, STACK_BRIDGE_POOL, IPNetwork, nft_elements
from podbay.errors import PodbayError

__all__ = ["NetfilterError", "render_ruleset", "install_ruleset", "PORTS_MARK", "REFUSED_COUNTER"]

#: Socket mark of the node agent's connections to guest ports ("pb", 1); no other new TCP enters a tap.
PORTS_MARK = 0x70620001
#: Named counter of the table: guest connections to always-denied addresses stopped before the proxy.
REFUSED_COUNTER = "egress_refused"


class NetfilterError(PodbayError):
    """The ruleset could not be installed; the node must not run guests without it."""

    code = "netfilter_failed"


def _guard(taps: str, operator_allow: Sequence[IPNetwork], sandbox_cidr: str | None) -> str:
    """The ``egress_guard`` chain, its sets and counter (see the module docstring)."""
    never = [ipaddress.ip_network(STACK_BRIDGE_POOL)]
    if sandbox_cidr:
        never.append(ipaddress.ip_network(sandbox_cidr, strict=False))
    denied = [net for net, _ in DENIED_RANGES]
    sets, rules = [], []
    for version, ip in ((4, "ip"), (6, "ip6")):
        kind = "ipv4_addr" if version == 4 else "ipv6_addr"
        for order, name, nets in ((0, f"never_v{version}", never), (1, f"operator_v{version}", operator_allow),
                                  (2, f"denied_v{version}", denied)):
            elements = nft_elements(nets, version)
            if not elements:
                continue
            sets.append(f"    set {name} {{\n        type {kind}; flags interval; auto-merge;\n"
                        f"        elements = {{ {elements} }}\n    }}")
            verdict = "return" if order == 1 else "goto egress_refuse"
            rules.append((order, version, f"        {ip} daddr @{name} {verdict}"))
    return "\n".join([
        *sets,
        f"    counter {REFUSED_COUNTER} {{\n    }}",
        "    chain egress_guard {",
        # after conntrack, before the redirect (dstnat): the original destination is still in the packet
        "        type filter hook prerouting priority mangle; policy accept;",
        f"        iifname != {taps} return",
        # replies to connections the host opened (the port proxy's), and their ICMP errors
        "        ct direction reply return",
        "        ct state related return",
        # DNS goes to the gateway's DNS server wherever it is sent
        "        meta l4proto { tcp, udp } th dport 53 return",
        *[r for _, _, r in sorted(rules)],
        "    }",
        "    chain egress_refuse {",
        f'        counter name "{REFUSED_COUNTER}"',
        "        meta l4proto tcp reject with tcp reset",
        "        reject with icmpx admin-prohibited",
        "    }",
    ])


def render_ruleset(proxy_port: int, dns_port: int, *, table: str, tap_prefix: str,
                   operator_allow: Sequence[IPNetwork] = (), sandbox_cidr: str | None = None) -> str:
    """The ``nft -f`` script that (re)defines ``table inet <table>`` for taps named ``<tap_prefix>*`` and the
    gateway's ``proxy_port`` and ``dns_port`` (TCP/UDP ports on the host). ``operator_allow``: the
    always-denied networks the operator opened (``settings.egress_operator_allow_cidrs``);
    ``sandbox_cidr``: the stack's sandbox network (never redirected either). Deterministic text, so tests
    can compare it."""
    for port in (proxy_port, dns_port):
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is out of range")
    taps = f'"{tap_prefix}*"'
    return f"""\
table inet {table}
delete table inet {table}
table inet {table} {{
{_guard(taps, operator_allow, sandbox_cidr)}
    chain raw_prerouting {{
        type filter hook prerouting priority raw; policy accept;
        iifname {taps} fib saddr . iif oif missing drop
    }}
    chain nat_prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname {taps} meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_port}
        iifname {taps} meta l4proto tcp redirect to :{proxy_port}
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname {taps} jump from_sandbox
    }}
    chain from_sandbox {{
        ct direction reply accept
        meta l4proto tcp th dport {proxy_port} ct status dnat accept
        meta l4proto {{ tcp, udp }} th dport {dns_port} ct status dnat accept
        meta l4proto tcp reject with tcp reset
        reject with icmpx admin-prohibited
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname {taps} meta l4proto tcp reject with tcp reset
        iifname {taps} reject with icmpx admin-prohibited
        oifname {taps} drop
    }}
    chain output {{
        type filter hook output priority filter; policy accept;
        oifname {taps} meta l4proto tcp ct state new meta mark != {PORTS_MARK:#x} reject with tcp reset
    }}
}}
"""


def _nft(script: str) -> None:
    nft = shutil.which("nft")
    if nft is None:
        raise NetfilterError("nft not found: install Debian nftables (scripts/setup.sh does)")
    proc = subprocess.run([nft, "-f", "-"], input=script, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetfilterError(f"nft refused the ruleset: {proc.stderr.strip()[-800:]}")


def install_ruleset(proxy_port: int, dns_port: int, *, table: str, tap_prefix: str,
                    operator_allow: Sequence[IPNetwork] = (), sandbox_cidr: str | None = None) -> str:
    """Install (or replace) ``table inet <table>`` in one transaction; returns the script applied.
    Blocking (runs ``nft``); raises :class:`NetfilterError`. Removal is
    :func:`podbay.stacknet.remove_nft_table` (``podbay down --purge``, test teardown)."""
    script = render_ruleset(proxy_port, dns_port, table=table, tap_prefix=tap_prefix,
                            operator_allow=operator_allow, sandbox_cidr=sandbox_cidr)
    _nft(script)
    return script
