"""Who is talking: the node agent's binding files, and what this gateway's DNS told each sandbox.

* :func:`read_binding`: the :class:`~podbay.contracts.egress.NetBinding` of a guest address, read from disk on
  every new connection or query (the node agent writes it atomically, so there is nothing to invalidate).
* :class:`DnsMemory`: per guest address, which addresses were answered for which name, for
  ``answer TTL + grace`` seconds. A raw TCP connection to such an address is decided by that name; a TLS or
  HTTP connection by SNI/Host needs its address to be one of the name's.
* :func:`node_addresses`: this host's own addresses (never a destination).
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from podbay.contracts.egress import NetBinding, binding_path

__all__ = ["read_binding", "DnsMemory", "node_addresses"]


def read_binding(data_dir: Path, node_id: str, guest_addr: str) -> NetBinding | None:
    """The binding of ``guest_addr`` on this node, or ``None`` when there is none (or it does not parse:
    a torn or foreign file must fail closed)."""
    try:
        addr = ipaddress.ip_address(guest_addr.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    try:
        raw = binding_path(data_dir, node_id, str(addr)).read_bytes()
    except OSError:
        return None
    try:
        binding = NetBinding.model_validate_json(raw)
    except ValidationError:
        return None
    return binding if binding.guest_addr == str(addr) else None


class DnsMemory:
    """``guest address -> {answered address -> (name, expires monotonic s)}``, bounded per guest.

    ``clock`` is injectable for tests; entries live ``ttl_s + grace_s`` seconds after each answer.
    """

    def __init__(self, *, grace_s: float = 300.0, max_per_guest: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._max = max_per_guest
        self._clock = clock
        self._by_guest: dict[str, dict[str, tuple[str, float]]] = {}

    def remember(self, guest: str, name: str, addrs: list[str], ttl_s: float) -> None:
        """Record that ``name`` was answered to ``guest`` with ``addrs``."""
        now = self._clock()
        table = self._by_guest.setdefault(guest, {})
        for addr in addrs:
            table[addr] = (name, now + ttl_s + self._grace_s)
        if len(table) > self._max:  # drop the entries that expire first
            for addr, _ in sorted(table.items(), key=lambda kv: kv[1][1])[: len(table) - self._max]:
                del table[addr]

    def name_of(self, guest: str, addr: str) -> str | None:
        """The name last answered to ``guest`` with ``addr``, while it lives."""
        entry = self._by_guest.get(guest, {}).get(addr)
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]

    def addrs_of(self, guest: str, name: str) -> list[str]:
        """The live addresses answered to ``guest`` for ``name``."""
        now = self._clock()
        return [a for a, (n, exp) in self._by_guest.get(guest, {}).items() if n == name and exp >= now]

    def forget(self, guest: str) -> None:
        """Drop everything about ``guest`` (its binding is gone or changed generation)."""
        self._by_guest.pop(guest, None)


def node_addresses() -> set[str]:
    """Every address configured on this host's interfaces (via pyroute2), plus what the host name resolves to.
    Loopback and link-local ranges are refused anyway; this adds e.g. the host's LAN and tap addresses."""
    addrs: set[str] = set()
    try:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for msg in ipr.get_addr():
                value = msg.get_attr("IFA_ADDRESS") or msg.get_attr("IFA_LOCAL")
                if value:
                    addrs.add(str(value))
    except Exception:  # noqa: BLE001 - fall back to what the resolver knows
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            addrs.add(str(info[4][0]))
    except OSError:
        pass
    return addrs
