"""The guest's network and trust store, set by ``after_restore.net`` (docs/channel.md).

The node gives each sandbox one NIC on its own tap with a /30: the guest gets ``address``, the default
route via ``gateway`` (the tap's host side, where the node redirects everything to its gateway), and
``/etc/resolv.conf`` naming the DNS server. Addresses and routes are set with ioctls on an ``AF_INET``
socket (SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFFLAGS, SIOCDELRT/SIOCADDRT) rather than by spawning ``ip``:
starting a process costs ~30-50 ms under TCG, on the create path.

The sandbox CA goes to ``/usr/local/share/ca-certificates/podbay-sandbox.crt`` and is appended to the
template's own bundle to form ``/etc/ssl/certs/ca-certificates.crt`` (what OpenSSL, Python, curl and
most runtimes read), without running the slow ``update-ca-certificates``. The node's extra CAs (its
``GUEST_CA_FILE``: the CA of a network that inspects TLS, which the guest meets because the gateway passes
TLS through) go to ``podbay-extra.crt`` beside it and into the bundle between the two. The template's
bundle is kept once as ``ca-certificates.crt.podbay-orig``, so a second call (a fork child, a rollback)
replaces the sandbox CA and the extra ones instead of appending more.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct

from .atomic import write_atomic

__all__ = ["configure_net", "install_ca", "nic_name", "SANDBOX_CA_PATH", "EXTRA_CA_PATH", "BUNDLE_PATH",
           "PRISTINE_BUNDLE_PATH"]

SANDBOX_CA_PATH = "/usr/local/share/ca-certificates/podbay-sandbox.crt"
EXTRA_CA_PATH = "/usr/local/share/ca-certificates/podbay-extra.crt"
BUNDLE_PATH = "/etc/ssl/certs/ca-certificates.crt"
PRISTINE_BUNDLE_PATH = BUNDLE_PATH + ".podbay-orig"
RESOLV_CONF = "/etc/resolv.conf"

# <linux/sockios.h>
SIOCADDRT = 0x890B
SIOCDELRT = 0x890C
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFADDR = 0x8916
SIOCSIFNETMASK = 0x891C
IFF_UP = 0x1
RTF_UP = 0x1
RTF_GATEWAY = 0x2


def nic_name(sys_class_net: str = "/sys/class/net") -> str:
    """The guest's NIC: the first interface (by name) backed by a device, i.e. not ``lo`` or a virtual one.
    Raises ``OSError(ENODEV)`` when there is none."""
    for name in sorted(os.listdir(sys_class_net)):
        if name != "lo" and os.path.exists(os.path.join(sys_class_net, name, "device")):
            return name
    raise OSError(errno.ENODEV, "the guest has no network interface")


def _sockaddr_in(addr: str) -> bytes:
    """``struct sockaddr_in`` (16 bytes) for an IPv4 address, port 0."""
    return struct.pack("=HH4s8x", socket.AF_INET, 0, socket.inet_aton(addr))


def _ifreq(name: str, payload: bytes) -> bytes:
    """``struct ifreq``: 16-byte name and a 24-byte union (40 bytes on x86_64)."""
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


def _rtentry(gateway: str) -> bytes:
    """``struct rtentry`` (x86_64, 120 bytes) for the default route via ``gateway``."""
    zero = _sockaddr_in("0.0.0.0")
    return struct.pack("=8x16s16s16sH6x8x8xh6x8x8x8xH6x", zero, _sockaddr_in(gateway), zero,
                       RTF_UP | RTF_GATEWAY, 0, 0)


def _netmask(prefix_len: int) -> str:
    return socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - prefix_len)) & 0xFFFFFFFF))


def configure_net(address: str, prefix_len: int, gateway: str, dns: list[str]) -> str:
    """Put ``address``/``prefix_len`` on the NIC, bring it up, make ``gateway`` the only default route, and
    write ``/etc/resolv.conf``. Idempotent; replaces an earlier address (a fork child starts with its
    parent's). Returns the NIC's name. Raises ``OSError``."""
    name = nic_name()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        fd = s.fileno()
        fcntl.ioctl(fd, SIOCSIFADDR, _ifreq(name, _sockaddr_in(address)))
        fcntl.ioctl(fd, SIOCSIFNETMASK, _ifreq(name, _sockaddr_in(_netmask(prefix_len))))
        flags = struct.unpack_from("=h", fcntl.ioctl(fd, SIOCGIFFLAGS, _ifreq(name, b"")), 16)[0]
        fcntl.ioctl(fd, SIOCSIFFLAGS, _ifreq(name, struct.pack("=h", flags | IFF_UP)))
        # An earlier default route (the parent's gateway, in a fork child) must go, or it would be kept.
        while True:
            try:
                fcntl.ioctl(fd, SIOCDELRT, _rtentry("0.0.0.0"))
            except OSError as exc:
                if exc.errno in (errno.ESRCH, errno.ENOENT):
                    break
                raise
        try:
            fcntl.ioctl(fd, SIOCADDRT, _rtentry(gateway))
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
    finally:
        s.close()
    write_atomic(RESOLV_CONF, "".join(f"nameserver {d}\n" for d in dns).encode(), 0o644)
    return name


def install_ca(cert_pem: str | None, extra_pem: str | None = None) -> None:
    """Trust ``cert_pem`` (the sandbox CA) and ``extra_pem`` (the node's extra CAs) system-wide, each
    replacing what an earlier call installed (None: none); see the module docstring. Raises ``OSError``."""
    os.makedirs(os.path.dirname(SANDBOX_CA_PATH), exist_ok=True)
    added = b""
    for path, text in ((EXTRA_CA_PATH, extra_pem), (SANDBOX_CA_PATH, cert_pem)):
        if text:
            pem = text.strip().encode() + b"\n"
            write_atomic(path, pem, 0o644)
            added += pem
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if not os.path.exists(PRISTINE_BUNDLE_PATH):
        try:
            with open(BUNDLE_PATH, "rb") as fh:
                original = fh.read()
        except FileNotFoundError:
            original = b""
        write_atomic(PRISTINE_BUNDLE_PATH, original, 0o644)
    with open(PRISTINE_BUNDLE_PATH, "rb") as fh:
        original = fh.read()
    if original and not original.endswith(b"\n"):
        original += b"\n"
    os.makedirs(os.path.dirname(BUNDLE_PATH), exist_ok=True)
    write_atomic(BUNDLE_PATH, original + added, 0o644)

