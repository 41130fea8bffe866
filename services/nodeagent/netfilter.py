"""The node's nftables ruleset (docs/DESIGN.md §6): a sandbox reaches nothing but this node's gateway.

One table per stack, ``table inet podbay_<tag>`` (:func:`podbay.stacknet.nft_table`), installed at
node-agent start before any VM runs (fail closed), and replaced atomically as a whole (``nft -f``: create,
delete, define in one transaction), so a restart with other ports never leaves a mix and no other table on
the host (another stack's included) is touched. For traffic entering one of this stack's sandbox taps
(``iifname "pb<tag>t*"``, :func:`podbay.stacknet.tap_prefix`):

* ``raw_prerouting`` drops a packet whose source address does not route back through the tap it came in
  on (reverse-path check), so a guest cannot pose as another sandbox: the gateway tells sandboxes apart by
  source address.
* ``nat_prerouting`` redirects UDP and TCP port 53 to the gateway's DNS port and every other TCP
  connection to the gateway's transparent proxy port (on the tap's host address).
* ``input`` accepts from a tap only connections that were redirected to those two ports; everything else
  is rejected (TCP reset, ICMP administratively prohibited), so a denied connection fails at once in the
  guest instead of hanging.
* ``forward`` rejects everything from a tap and drops everything towards one: no sandbox reaches another
  sandbox or any other host directly, whatever the host's ``ip_forward``.
* ``output`` refuses every new TCP connection from the host into a tap unless its socket carries
  :data:`PORTS_MARK`, the mark of the node agent's port proxy (services/nodeagent/ports.py), and
  ``from_sandbox`` accepts from a tap the replies of connections the host opened (``ct direction reply``):
  the port proxy, which the API's edge drives only after authorising a request for that sandbox and port,
  is the only way into a guest.

Errors: :class:`NetfilterError` (``nft`` missing or refusing the ruleset; not retryable).
"""

from __future__ import annotations

import shutil
import subprocess

from podbay.errors import PodbayError

__all__ = ["NetfilterError", "render_ruleset", "install_ruleset", "PORTS_MARK"]

#: Socket mark of the node agent's connections to guest ports ("pb", 1); no other new TCP enters a tap.
PORTS_MARK = 0x70620001


class NetfilterError(PodbayError):
    """The ruleset could not be installed; the node must not run guests without it."""

    code = "netfilter_failed"


def render_ruleset(proxy_port: int, dns_port: int, *, table: str, tap_prefix: str) -> str:
    """The ``nft -f`` script that (re)defines ``table inet <table>`` for taps named ``<tap_prefix>*`` and the
    gateway's ``proxy_port`` and ``dns_port`` (TCP/UDP ports on the host). Deterministic text, so tests can
    compare it."""
    for port in (proxy_port, dns_port):
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is out of range")
    taps = f'"{tap_prefix}*"'
    return f"""\
table inet {table}
delete table inet {table}
table inet {table} {{
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


def install_ruleset(proxy_port: int, dns_port: int, *, table: str, tap_prefix: str) -> str:
    """Install (or replace) ``table inet <table>`` in one transaction; returns the script applied.
    Blocking (runs ``nft``); raises :class:`NetfilterError`. Removal is
    :func:`podbay.stacknet.remove_nft_table` (``podbay down --purge``, test teardown)."""
    script = render_ruleset(proxy_port, dns_port, table=table, tap_prefix=tap_prefix)
    _nft(script)
    return script
