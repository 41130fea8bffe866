"""Name resolution for the gateway: ``settings.gateway_hosts_file`` (hosts(5) format) first, then the host's
resolver. IPv4 only: the sandbox network is IPv4 and AAAA queries are answered empty."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from pathlib import Path

__all__ = ["parse_hosts", "Resolver"]


def parse_hosts(text: str) -> dict[str, list[str]]:
    """``name -> [IPv4 addresses]`` from hosts(5) text (comments after ``#``; one address then names per
    line). Names are lower-cased; IPv6 lines are skipped; an address repeated for a name is kept once."""
    table: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        try:
            addr = ipaddress.ip_address(fields[0])
        except ValueError:
            continue
        if addr.version != 4:
            continue
        for name in fields[1:]:
            addrs = table.setdefault(name.lower().rstrip("."), [])
            if str(addr) not in addrs:
                addrs.append(str(addr))
    return table


class Resolver:
    """``await resolve(name)`` -> IPv4 addresses (empty when the name does not resolve)."""

    def __init__(self, hosts_file: Path | None) -> None:
        self._hosts_file = hosts_file
        self._cache: tuple[float, dict[str, list[str]]] = (-1.0, {})

    def _hosts(self) -> dict[str, list[str]]:
        if self._hosts_file is None:
            return {}
        try:
            mtime = self._hosts_file.stat().st_mtime
        except OSError:
            return {}
        if mtime != self._cache[0]:  # re-read when the file changes
            self._cache = (mtime, parse_hosts(self._hosts_file.read_text(errors="replace")))
        return self._cache[1]

    async def resolve(self, name: str) -> list[str]:
        """The name's IPv4 addresses: the hosts file's entry if it has one, else the host resolver's."""
        name = name.lower().rstrip(".")
        hit = self._hosts().get(name)
        if hit:
            return list(hit)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None, family=socket.AF_INET,
                                                                 type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return []
        return list(dict.fromkeys(str(i[4][0]) for i in infos))
