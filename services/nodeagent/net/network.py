"""The node's sandbox network (docs/DESIGN.md §6): one tap and one /30 per sandbox, its binding for the gateway.

Address plan: the stack's sandbox network (:func:`podbay.stacknet.sandbox_cidr`: ``PODBAY_SANDBOX_CIDR``, or
a /16 chosen once per data directory) is cut into /30s; sandbox lease ``i`` gets ``base + 4i``: host side
``.1`` (the tap's address: router, DNS server and gateway for the guest), guest ``.2``. The tap is
``pb<tag>t<i>`` (:func:`podbay.stacknet.tap_prefix`: the stack's tag, so two stacks on one host never
share a tap name; at most 15 characters for any IPv4 CIDR, within IFNAMSIZ). Leases live in ``DATA_DIR/nodes/<node>/net/leases.json`` (written
atomically), so a restarted node agent re-attaches its VMs on the same addresses; a lease is released when
the sandbox leaves the node (delete, suspend, failure) and the lowest free index is given out next.

Tap: the node agent (root) creates it by opening ``/dev/net/tun`` (TUNSETIFF, ``IFF_TAP|IFF_NO_PI``,
without ``IFF_VNET_HDR`` so that QEMU's NIC state never depends on the backend: see vmm.build_qemu_argv), gives the host side its address with IPv6 disabled (pyroute2), and hands the descriptor
to QEMU, which needs no privilege for it. The tap is not persistent: it lives exactly as long as some
process holds the descriptor (QEMU), so a QEMU that exits takes its tap with it, and a new QEMU for the
same sandbox (hibernation wake, rollback) gets a new tap of the same name and address.

Rate: each tap gets ``PODBAY_SANDBOX_NET_RATE_MBIT`` (1 Gbit/s; 0 = none) in each direction with tc
(:func:`tc_rate_batches`): a tbf as its root qdisc bounds what the host sends the guest, and a policer on its
ingress (u32 match-all, ``action police ... drop``) what the guest sends. Both live on the tap, so they go with
it when its QEMU exits and stay with a running QEMU across node-agent restarts: nothing to clean up or
reconcile. A kernel without tbf or the police action (or a host without ``tc``) gets that part skipped,
logged once.

Binding: for every VM the node runs for a sandbox at a generation, a fresh CA
(:func:`podbay.sandbox_ca.new_sandbox_ca`) is written to ``net/ca/<sandbox>-g<generation>.pem`` (key PEM
then cert PEM, mode 0600) and a :class:`~podbay.contracts.egress.NetBinding` to
``binding_path(data_dir, node, guest_addr)``, before the guest runs. A VM of the same generation (RAM
release and wake, a node-agent restart) keeps its binding; a fork child or a rollback (a new generation)
gets new material, never its parent's.

Errors: :class:`NetworkError` (the address space is exhausted, or a tap could not be made; retryable).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import json
import logging
import os
import socket
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed

from podbay.config import Settings
from podbay.contracts.channel import GuestNet
from podbay.contracts.egress import NetBinding, binding_path, bindings_dir
from podbay.egress_ranges import parse_cidrs
from podbay.errors import Unavailable
from podbay.naming import safe_component
from podbay.sandbox_ca import new_sandbox_ca
from podbay.stacknet import nft_table, sandbox_cidr, tap_prefix

from .netfilter import install_ruleset

__all__ = ["NetworkError", "Lease", "SandboxNetwork", "lease_addresses", "tap_name", "tap_mac", "lease_capacity",
           "lowest_free", "create_tap", "IFNAMSIZ", "tc_rate_batches"]

log = logging.getLogger("podbay.nodeagent.network")

#: Longest interface name plus its NUL (<linux/if.h>).
IFNAMSIZ = 16
#: How long opening a tap waits for a just-killed holder of its name to exit (seconds).
TAP_BUSY_WAIT_S = 2.0
# <linux/if_tun.h>
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


class NetworkError(Unavailable):
    """No address or tap for a sandbox on this node."""

    code = "sandbox_network_failed"
    retryable = True


@dataclass(frozen=True)
class Lease:
    """A sandbox's place in the node's address plan."""

    sandbox_id: str
    index: int
    tap: str
    host_addr: str
    guest_addr: str
    prefix_len: int = 30


def _network(cidr: str) -> ipaddress.IPv4Network:
    net = ipaddress.ip_network(cidr, strict=False)
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 30:
        raise ValueError(f"sandbox_cidr {cidr!r} must be an IPv4 network of /30 or larger")
    return net


def lease_capacity(cidr: str) -> int:
    """How many /30s (sandboxes) ``cidr`` holds."""
    return _network(cidr).num_addresses // 4


def lease_addresses(cidr: str, index: int) -> tuple[str, str]:
    """``(host_addr, guest_addr)`` of lease ``index`` in ``cidr``: ``.1`` and ``.2`` of its /30."""
    net = _network(cidr)
    if not 0 <= index < net.num_addresses // 4:
        raise ValueError(f"lease {index} is outside {cidr}")
    base = int(net.network_address) + 4 * index
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def tap_name(prefix: str, index: int) -> str:
    """The tap of lease ``index``: ``<prefix><index>`` (``prefix`` from :func:`podbay.stacknet.tap_prefix`);
    raises ``ValueError`` if it would not fit IFNAMSIZ."""
    name = f"{prefix}{index}"
    if index < 0 or len(name) >= IFNAMSIZ:
        raise ValueError(f"tap name {name!r} does not fit IFNAMSIZ")
    return name


def tap_mac(host_addr: str) -> str:
    """The host side's MAC of the tap whose address is ``host_addr``: locally administered, unicast
    (``02:70:62`` and the address's last three bytes), so it is the same for every tap of one lease."""
    b = ipaddress.IPv4Address(host_addr).packed
    return f"02:70:62:{b[1]:02x}:{b[2]:02x}:{b[3]:02x}"


def lowest_free(used: set[int], capacity: int) -> int:
    """The lowest index in ``[0, capacity)`` not in ``used``; raises :class:`NetworkError` when full."""
    for i in range(capacity):
        if i not in used:
            return i
    raise NetworkError(f"all {capacity} sandbox addresses of this node are in use")


def create_tap(name: str) -> int:
    """Create tap ``name`` (not persistent: it lives while a process holds the descriptor) with IPv6 off;
    returns the descriptor (close-on-exec). Raises ``OSError`` (EBUSY: a live process holds that name)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
        # No IPv6 at all (no link-local address, no router solicitations): the ruleset and the gateway
        # speak IPv4, and nothing may bypass them.
        with contextlib.suppress(FileNotFoundError):
            Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6").write_text("1")
    except BaseException:
        os.close(fd)
        raise
    return fd


def tc_rate_batches(tap: str, rate_mbit: int) -> tuple[str, str]:
    """``tc -batch`` input limiting ``tap`` to ``rate_mbit`` Mbit/s: ``(towards the guest, from the guest)``. The
    burst is 10 ms of the rate (at least 32 KiB), enough for the timer granularity of any HZ."""
    burst = max(rate_mbit * 1_000_000 // 8 // 100, 32 * 1024)
    to_guest = f"qdisc replace dev {tap} root tbf rate {rate_mbit}mbit burst {burst} latency 50ms\n"
    from_guest = (f"qdisc replace dev {tap} ingress\n"
                  f"filter add dev {tap} parent ffff: pref 1 protocol all u32 match u32 0 0 "
                  f"action police rate {rate_mbit}mbit burst {burst} conform-exceed drop\n")
    return to_guest, from_guest


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class SandboxNetwork:
    """Leases, taps, CA material and bindings of one node. Methods are blocking (file I/O, netlink, key
    generation of ~1 ms): call them from a thread on the event loop's hot paths."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cidr = sandbox_cidr(settings)
        self.tap_prefix = tap_prefix(settings.data_dir)
        self.capacity = lease_capacity(self.cidr)
        self.dir = settings.data_dir / "nodes" / settings.node_id / "net"
        self.ca_dir = self.dir / "ca"
        self.bindings = bindings_dir(settings.data_dir, settings.node_id)
        self._leases_file = self.dir / "leases.json"
        self._lock = threading.Lock()
        self._leases: dict[str, int] = {}
        self._ipr: object | None = None
        # ifindex of each tap this agent made or first saw, so that a tap deleted and made again by someone
        # else under the same name is noticed too (tap_intact).
        self._tap_index: dict[str, int] = {}
        # Which parts of the rate limit this host's tc and kernel take (None: not tried yet).
        self._tc_ok: dict[str, bool | None] = {"to_guest": None, "from_guest": None}

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Install the nftables table (before any VM runs: fail closed) and load the persisted leases."""
        for d in (self.dir, self.ca_dir, self.bindings):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.ca_dir, 0o700)
        install_ruleset(self.settings.gateway_proxy_port, self.settings.gateway_dns_port,
                        table=nft_table(self.settings.data_dir), tap_prefix=self.tap_prefix,
                        operator_allow=parse_cidrs(self.settings.egress_operator_allow_cidrs),
                        sandbox_cidr=self.cidr)
        self.load_leases()

    def load_leases(self) -> None:
        """Read the persisted leases (none when the file is missing or unreadable)."""
        try:
            raw = json.loads(self._leases_file.read_text())
            self._leases = {str(k): int(v) for k, v in raw.items() if 0 <= int(v) < self.capacity}
        except FileNotFoundError:
            self._leases = {}
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("unreadable %s (%s): starting with no leases", self._leases_file, exc)
            self._leases = {}

    def _save(self) -> None:
        _write_atomic(self._leases_file, json.dumps(self._leases, sort_keys=True).encode())

    # ------------------------------------------------------------------ leases

    def _lease(self, sandbox_id: str, index: int) -> Lease:
        host, guest = lease_addresses(self.cidr, index)
        return Lease(sandbox_id, index, tap_name(self.tap_prefix, index), host, guest)

    def lease(self, sandbox_id: str) -> Lease:
        """The sandbox's lease, allocated (lowest free index) and persisted when it has none."""
        with self._lock:
            index = self._leases.get(sandbox_id)
            if index is None:
                index = lowest_free(set(self._leases.values()), self.capacity)
                self._leases[sandbox_id] = index
                self._save()
            return self._lease(sandbox_id, index)

    def leased(self) -> dict[str, Lease]:
        """Every current lease by sandbox id."""
        with self._lock:
            return {sid: self._lease(sid, i) for sid, i in self._leases.items()}

    # ------------------------------------------------------------------ taps

    def _iproute(self) -> object:
        if self._ipr is None:
            from pyroute2 import IPRoute

            self._ipr = IPRoute()
        return self._ipr

    def open_tap(self, lease: Lease) -> int:
        """Create ``lease.tap`` and return its descriptor (close-on-exec; the caller passes it to QEMU and
        closes its own copy). The host side gets ``host_addr/30``, IPv6 off, link up. Raises
        :class:`NetworkError` (e.g. the name is held by a QEMU that is still alive)."""
        try:
            # EBUSY: the name is still held by a QEMU (or its bubblewrap) of an earlier attempt that was just
            # killed; the kernel frees it once that process has exited.
            fd = Retrying(stop=stop_after_delay(TAP_BUSY_WAIT_S), wait=wait_fixed(0.05), reraise=True,
                          retry=retry_if_exception(lambda e: isinstance(e, OSError) and e.errno == errno.EBUSY),
                          )(create_tap, lease.tap)
        except OSError as exc:
            raise NetworkError(f"cannot create tap {lease.tap} for {lease.sandbox_id}: {exc}") from exc
        try:
            with self._lock:
                ipr = self._iproute()
                (idx,) = ipr.link_lookup(ifname=lease.tap)  # type: ignore[attr-defined]  # pyroute2's IPRoute is untyped and made lazily (_iproute returns object)
                try:
                    ipr.addr("add", index=idx, address=lease.host_addr, prefixlen=lease.prefix_len)  # type: ignore[attr-defined]  # pyroute2's IPRoute is untyped and made lazily (_iproute returns object)
                except Exception as exc:  # pyroute2's NetlinkError: EEXIST when the tap was kept
                    if getattr(exc, "code", None) != errno.EEXIST:
                        raise
                # The same MAC for every tap of a lease: a guest restored onto a new tap (a RAM-release wake,
                # a vanished tap's repair) keeps its ARP entry for the gateway, which would otherwise point
                # at the old tap's random MAC until it goes stale (tens of seconds without a network).
                ipr.link("set", index=idx, address=tap_mac(lease.host_addr), state="up")  # type: ignore[attr-defined]  # pyroute2's IPRoute is untyped and made lazily (_iproute returns object)
                self._tap_index[lease.tap] = idx
        except Exception as exc:
            os.close(fd)
            raise NetworkError(f"cannot set up tap {lease.tap} for {lease.sandbox_id}: {exc}") from exc
        self.limit_rate(lease.tap)
        return fd

    def limit_rate(self, tap: str) -> None:
        """Apply the sandbox rate (module docstring) to ``tap`` with one ``tc -batch``; a part this host does
        not support is logged once and skipped from then on. Never raises."""
        rate = self.settings.sandbox_net_rate_mbit
        if rate <= 0:
            return
        parts = dict(zip(("to_guest", "from_guest"), tc_rate_batches(tap, rate), strict=True))
        wanted = [k for k in parts if self._tc_ok[k] is not False]
        if not wanted:
            return
        try:
            done = subprocess.run(["tc", "-batch", "-"], input="".join(parts[k] for k in wanted),
                                  capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            for k in wanted:
                self._tc_ok[k] = False
            log.warning("tc unavailable (%s): sandboxes' network rate is not limited", exc)
            return
        if done.returncode == 0:
            for k in wanted:
                self._tc_ok[k] = True
            return
        # tc stops at the first failing command and names its line ("Command failed -:N"); the parts after
        # it are not applied to this tap (a transient failure costs one tap its limit, not a second exec).
        err = done.stderr.strip()
        failed_line = int(err.rsplit("-:", 1)[-1].split()[0]) if "Command failed -:" in err else 1
        first = 0
        for k in wanted:
            last = first + parts[k].count("\n")
            if failed_line > last:
                self._tc_ok[k] = True
                first = last
                continue
            if self._tc_ok[k] is None:  # never worked here: this host lacks it
                self._tc_ok[k] = False
                log.warning("the sandbox network rate %s is not limited on this host: tc says %r",
                            k.replace("_", " "), err.splitlines()[0] if err else done.returncode)
            else:
                log.warning("tc on %s failed: %s", tap, err[:300])
            return

    def tap_intact(self, tap: str) -> bool:
        """Whether ``tap`` still exists as the device its VM holds: False when it is gone (someone deleted it,
        e.g. ``ip link del``) or was made again under the same name (another ifindex). A tap first seen here
        (a VM re-attached after a restart) is taken as it is. Asks the kernel for the index in this process's
        network namespace (one ioctl; cheap enough every second for every VM): sysfs would not do, since a node
        agent entered into a node's namespace (``nsenter --net``, a multi-node stack) still sees the host's
        /sys/class/net, where its taps never appear."""
        try:
            index = socket.if_nametoindex(tap)
        except OSError:
            return False
        with self._lock:
            return self._tap_index.setdefault(tap, index) == index

    def taps_intact(self, taps: list[str]) -> dict[str, bool]:
        """:meth:`tap_intact` of each of ``taps`` from one listing of this namespace's devices
        (``if_nameindex``: one netlink dump), so that a check of every VM's tap costs the node one call, not
        one call (and one worker-thread hop) per VM."""
        try:
            index = {name: i for i, name in socket.if_nameindex()}
        except OSError:
            return {tap: self.tap_intact(tap) for tap in taps}
        with self._lock:
            return {tap: tap in index and self._tap_index.setdefault(tap, index[tap]) == index[tap] for tap in taps}

    def _delete_tap(self, name: str) -> None:
        with self._lock:
            self._tap_index.pop(name, None)
            ipr = self._iproute()
            for idx in ipr.link_lookup(ifname=name):  # type: ignore[attr-defined]  # pyroute2's IPRoute is untyped and made lazily (_iproute returns object)
                with contextlib.suppress(Exception):
                    ipr.link("del", index=idx)  # type: ignore[attr-defined]  # pyroute2's IPRoute is untyped and made lazily (_iproute returns object)

    # ------------------------------------------------------------------ bindings

    def ca_path(self, sandbox_id: str, generation: int) -> Path:
        return self.ca_dir / f"{safe_component(sandbox_id, 'sandbox id')}-g{int(generation)}.pem"

    def binding(self, sandbox_id: str) -> NetBinding | None:
        """The sandbox's current binding file, if it has a lease and a readable binding."""
        with self._lock:
            index = self._leases.get(sandbox_id)
        if index is None:
            return None
        _host, guest = lease_addresses(self.cidr, index)
        try:
            b = NetBinding.model_validate_json(binding_path(self.settings.data_dir, self.settings.node_id,
                                                            guest).read_text())
        except (OSError, ValueError):
            return None
        return b if b.sandbox_id == sandbox_id else None

    def bind(self, sandbox_id: str, generation: int) -> NetBinding:
        """The binding of ``sandbox_id`` at ``generation``: kept when one exists for that generation with its
        CA file, else a fresh CA and a new binding file (atomic). Earlier generations' CA files go."""
        lease = self.lease(sandbox_id)
        cur = self.binding(sandbox_id)
        if cur is not None and cur.generation == generation and Path(cur.ca_path).exists():
            return cur
        key_pem, cert_pem = new_sandbox_ca(sandbox_id, generation)
        ca = self.ca_path(sandbox_id, generation)
        _write_atomic(ca, key_pem + cert_pem, 0o600)
        b = NetBinding(sandbox_id=sandbox_id, generation=generation, tap=lease.tap, host_addr=lease.host_addr,
                       guest_addr=lease.guest_addr, prefix_len=lease.prefix_len, ca_path=str(ca),
                       ca_cert_pem=cert_pem.decode())
        _write_atomic(binding_path(self.settings.data_dir, self.settings.node_id, lease.guest_addr),
                      b.model_dump_json().encode(), 0o600)
        for old in self.ca_dir.glob(f"{sandbox_id}-g*.pem"):
            if old != ca:
                old.unlink(missing_ok=True)
        return b

    def prepare(self, sandbox_id: str, generation: int) -> tuple[NetBinding, int]:
        """Lease, binding and an open tap for a VM about to start: ``(binding, tap_fd)``."""
        binding = self.bind(sandbox_id, generation)
        return binding, self.open_tap(self.lease(sandbox_id))

    @staticmethod
    def guest_net(binding: NetBinding) -> GuestNet:
        """What ``after_restore.net`` tells the guest: its address, gateway and DNS (the tap's host side), and
        the CA certificate to trust."""
        return GuestNet(address=binding.guest_addr, prefix_len=binding.prefix_len, gateway=binding.host_addr,
                        dns=[binding.host_addr], ca_cert_pem=binding.ca_cert_pem)

    # ------------------------------------------------------------------ release

    def release(self, sandbox_id: str) -> None:
        """The sandbox left the node: remove its binding and CA files, its tap (if a dead QEMU left one) and
        its lease. Idempotent."""
        with self._lock:
            index = self._leases.get(sandbox_id)
        if index is not None:
            lease = self._lease(sandbox_id, index)
            path = binding_path(self.settings.data_dir, self.settings.node_id, lease.guest_addr)
            with contextlib.suppress(OSError, ValueError):
                if NetBinding.model_validate_json(path.read_text()).sandbox_id == sandbox_id:
                    path.unlink()
            self._delete_tap(lease.tap)
        for old in self.ca_dir.glob(f"{sandbox_id}-g*.pem"):
            old.unlink(missing_ok=True)
        if index is not None:
            with self._lock:
                if self._leases.get(sandbox_id) == index:
                    del self._leases[sandbox_id]
                    self._save()

    def prune(self, keep: set[str]) -> list[str]:
        """Release every lease not in ``keep``, and remove binding and CA files no kept lease owns (after a
        restart). Returns the sandbox ids released."""
        gone = sorted(set(self.leased()) - keep)
        for sid in gone:
            self.release(sid)
        kept = self.leased()
        addrs = {lease.guest_addr for lease in kept.values()}
        for f in self.bindings.glob("*.json"):
            if f.stem not in addrs:
                f.unlink(missing_ok=True)
        for f in self.ca_dir.glob("*.pem"):
            if f.name.rsplit("-g", 1)[0] not in kept:
                f.unlink(missing_ok=True)
        return gone

    def close(self) -> None:
        if self._ipr is not None:
            with contextlib.suppress(Exception):
                self._ipr.close()  # type: ignore[attr-defined]  # pyroute2's IPRoute is untyped and made lazily (_iproute returns object)
            self._ipr = None
