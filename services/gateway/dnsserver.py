"""The gateway's DNS server (UDP and TCP on ``settings.gateway_dns_port``; the node redirects port 53 from
sandbox taps here). Wire format by dnspython.

Per query: identify the sandbox by the source address (no binding or no sandbox row -> REFUSED); then

* ``A`` for a name the policy allows: resolve (hosts file, then the host resolver), answer with TTL
  :data:`ANSWER_TTL_S`, and remember the addresses for this guest (raw TCP to them is decided by the name);
  a name that does not resolve -> NXDOMAIN.
* a name no domain rule covers, when the policy has CIDR allow rules: resolve, and answer ``A`` with only
  the addresses those rules open (other types: empty); NXDOMAIN, audited, when there are none.
* ``AAAA`` (and other types) for an allowed name: an empty NOERROR answer (the sandbox network is IPv4).
* any type for a name not allowed: NXDOMAIN, logged, audited (at most once a minute per sandbox and name)
  and announced on ``podbay.evt.egress.<sandbox>.denied``.

Answers hold only addresses the sandbox could connect to (:meth:`Gateway.reachable`: never a private,
CGNAT, link-local, loopback or reserved address unless the operator allow-listed its range, nor the stack's
own addresses), at most :data:`MAX_ANSWER_ADDRS` of them; a name left with none is NXDOMAIN, counted and
audited as a denial with the kind of the first address (e.g. ``private``). So a public name pointed at an
internal address (DNS rebinding) leads nowhere, and the node's resolver does not tell a guest the layout of
the network behind it.

Per sandbox (by source address, before anything else is read) queries pass a token bucket of
``settings.gateway_dns_rate_per_s`` per second and ``settings.gateway_dns_burst`` at once; beyond it the
query is answered REFUSED and counted in ``podbay_gateway_dns_rate_limited_total`` (no labels: no sandbox
id ever becomes a label).
"""

from __future__ import annotations

import asyncio
import logging
import struct

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from .engine import Gateway
from .metrics import DNS_ANSWERS, DNS_RATE_LIMITED
from .policy import cidr_allows

__all__ = ["ANSWER_TTL_S", "MAX_ANSWER_ADDRS", "MAX_QUERY_BYTES", "DnsServer", "answer"]

log = logging.getLogger("podbay.gateway.dns")

#: TTL of our answers, seconds: short, so a policy change reaches a guest's cache quickly.
ANSWER_TTL_S = 30
#: Most ``A`` records in one answer (the rest are left out): a small answer fits one UDP datagram.
MAX_ANSWER_ADDRS = 8
#: Largest query read (a TCP length prefix above it ends the connection): one question needs far less.
MAX_QUERY_BYTES = 512


async def answer(gw: Gateway, src_ip: str, wire: bytes) -> bytes | None:
    """The reply to one query datagram from ``src_ip`` (``None`` for garbage that is not worth a FORMERR)."""
    try:
        query = dns.message.from_wire(wire)
    except dns.exception.DNSException:
        DNS_ANSWERS.labels("formerr").inc()
        return None
    reply = dns.message.make_response(query)
    reply.flags |= dns.flags.RA
    if len(query.question) != 1:
        reply.set_rcode(dns.rcode.FORMERR)
        DNS_ANSWERS.labels("formerr").inc()
        return reply.to_wire()
    q = query.question[0]
    name = q.name.to_text(omit_final_dot=True).lower()
    if not gw.dns_buckets.take(src_ip.removeprefix("::ffff:")):
        # Before the binding and the database are read: a flood costs a dict lookup per query.
        reply.set_rcode(dns.rcode.REFUSED)
        DNS_RATE_LIMITED.inc()
        DNS_ANSWERS.labels("refused").inc()
        return reply.to_wire()
    try:
        peer = await gw.identify(src_ip)
    except Exception as exc:  # noqa: BLE001 - the database is away: refuse, never guess
        log.warning("dns query from %s refused: %s", src_ip, exc)
        peer = None
    if peer is None or peer.refusal is not None:
        if peer is not None and peer.refusal is not None:
            gw.denied(peer, "dns", name, peer.refusal)
        reply.set_rcode(dns.rcode.REFUSED)
        DNS_ANSWERS.labels("refused").inc()
        return reply.to_wire()
    decision = gw.decide_dns(peer, name)
    policy = peer.ctx.policy if peer.ctx else None
    if (not decision.allowed and decision.reason == "no_allow_rule" and policy is not None
            and any(r.cidr is not None for r in policy.allow)):
        opened = [a for a in gw.reachable(await gw.resolver.resolve(name)) if cidr_allows(policy, a)]
        if opened:
            gw.allowed("dns", decision.allow(f"{name} leads into an allowed address range"))
            if q.rdtype == dns.rdatatype.A and q.rdclass == dns.rdataclass.IN:
                return _answer_a(gw, reply, q, peer.guest, name, opened)
            DNS_ANSWERS.labels("empty").inc()
            return reply.to_wire()
    if not decision.allowed:
        gw.denied(peer, "dns", name, decision, detail={"qtype": dns.rdatatype.to_text(q.rdtype)})
        reply.set_rcode(dns.rcode.NXDOMAIN)
        DNS_ANSWERS.labels("nxdomain").inc()
        return reply.to_wire()
    gw.allowed("dns", decision)
    if q.rdtype == dns.rdatatype.A and q.rdclass == dns.rdataclass.IN:
        resolved = await gw.resolver.resolve(name)
        addrs = gw.reachable(resolved)
        if not addrs:
            if resolved:  # it leads only where no sandbox may go: a denial, like any other
                refusal = gw.refuse_address(resolved[0])
                if refusal is not None:
                    gw.denied(peer, "dns", name, refusal, detail={"qtype": "A", "address": resolved[0]})
            reply.set_rcode(dns.rcode.NXDOMAIN)
            DNS_ANSWERS.labels("nxdomain").inc()
            return reply.to_wire()
        return _answer_a(gw, reply, q, peer.guest, name, addrs)
    DNS_ANSWERS.labels("empty").inc()
    return reply.to_wire()


def _answer_a(gw: Gateway, reply: dns.message.Message, q: dns.rrset.RRset, guest: str, name: str,
              addrs: list[str]) -> bytes:
    addrs = addrs[:MAX_ANSWER_ADDRS]
    reply.answer.append(dns.rrset.from_text_list(q.name, ANSWER_TTL_S, "IN", "A", addrs))
    gw.memory.remember(guest, name, addrs, ANSWER_TTL_S)
    DNS_ANSWERS.labels("answer").inc()
    return reply.to_wire()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint is always given a DatagramTransport; asyncio types the base

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.gw.spawn(self._reply(data, addr))

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        out = await answer(self.gw, addr[0], data)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)


class DnsServer:
    """UDP and TCP listeners on ``host``:``port``; :meth:`start`, then :meth:`close`."""

    def __init__(self, gw: Gateway, host: str, port: int) -> None:
        self.gw, self.host, self.port = gw, host, port
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self.gw), local_addr=(self.host, self.port))
        self._tcp = await asyncio.start_server(self._tcp_client, self.host, self.port)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            while True:  # RFC 7766: two-byte length prefix, several queries per connection
                size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 30))[0]
                if size > MAX_QUERY_BYTES:
                    DNS_ANSWERS.labels("formerr").inc()
                    break
                data = await asyncio.wait_for(reader.readexactly(size), 30)
                out = await answer(self.gw, peer[0], data)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
