"""Network namespaces for a multi-node stack on one machine: one namespace per node, joined by a host bridge.

Each node agent owns per-namespace things (its stack's nftables table, tap names, its gateway's ports), so
two node agents of one stack on one host clash unless each runs in its own network namespace. Layout:

- a host bridge ``pbb-<tag>`` with address ``10.77.<k>.1/24`` (a private /24 outside the pool of sandbox
  networks, :data:`podbay.stacknet.SANDBOX_POOL`; ``<k>`` is chosen so that no host address is already inside it);
- per node ``i`` (0-based): a namespace ``pb-<tag>-<node id>`` with loopback up, a veth pair whose host end
  ``pbv-<tag>-<i>`` is a bridge port and whose namespace end is ``eth0`` with ``10.77.<k>.<i+2>/24``, and a
  default route through the bridge address;
- the uplink, so that a node reaches the outside as a real host would (its gateway resolves names with the
  host's resolver and proxies a sandbox's allowed egress): IPv4 forwarding on, and ``table inet
  podbay_<tag>_hosts`` in the host namespace, which masquerades the bridge's /24 towards every other
  interface and accepts forwarding from the bridge (and the replies back to it). Without it a build step's
  ``apt-get`` on a namespaced node found no DNS. Sandboxes gain nothing: each node's own table rejects
  everything a tap would forward (services/nodeagent/net/netfilter.py), whatever ``ip_forward`` says.

``<tag>`` is the stack's tag (:func:`podbay.stacknet.stack_tag`, from its data directory), so two stacks on
one host do not collide. The plan is
kept in ``DATA_DIR/netns.json`` so that ``podbay down --purge`` (:func:`purge_networks`) removes what a crashed
stack left behind. Processes enter a node's namespace with ``nsenter --net=/run/netns/<ns>``, which changes
the network namespace only: mounts (the node store's btrfs loop mount) stay visible to every process.

Everything here needs root (``ip`` from iproute2). Errors: :class:`NetnsError` (an ``ip`` command failed).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from podbay.errors import Unavailable
from podbay.stacknet import (
    STACKS_DIR,
    delete_nft_table,
    forget_stack,
    nft_table_of,
    orphaned_stacks,
    remove_nft_table,
    stack_tag,
)

__all__ = ["node_ids_for", "NetnsError", "NodeLink", "NodeNetwork", "plan_network", "purge_networks", "STATE_FILE",
           "sweep_orphans", "uplink_table"]

STATE_FILE = "netns.json"
_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
#: Second octet of the /24 networks tried for the bridge: 10.77.<k>.0/24.
_BASE = ipaddress.ip_network("10.77.0.0/16")


class NetnsError(Unavailable):
    """An ``ip`` command failed; ``details`` has ``argv`` and ``stderr``."""

    code = "netns_failed"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {done.stderr.strip()}",
                         details={"argv": argv, "stderr": done.stderr.strip()})
    return done


@dataclass
class NodeLink:
    """One node's namespace: ``netns`` name, host-side veth ``veth``, and its ``address`` on the bridge."""

    node_id: str
    netns: str
    veth: str
    address: str

    def nsenter(self) -> list[str]:
        """Argv prefix that runs a command inside this namespace (network only: mounts stay shared)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--"]


@dataclass
class NodeNetwork:
    """The bridge and the node namespaces of one stack (see the module docstring)."""

    tag: str
    bridge: str
    cidr: str  # e.g. "10.77.12.0/24"
    host_address: str  # the bridge's address, where the servers listen
    nodes: list[NodeLink] = field(default_factory=list)

    def node(self, node_id: str) -> NodeLink:
        """The link of ``node_id``; ``KeyError`` when the stack has no such node."""
        for link in self.nodes:
            if link.node_id == node_id:
                return link
        raise KeyError(node_id)

    def create(self) -> None:
        """Create the bridge, namespaces and veths (what already exists is reused). Raises :class:`NetnsError`."""
        if _ip("link", "show", self.bridge, check=False).returncode != 0:
            _ip("link", "add", self.bridge, "type", "bridge")
        prefix = ipaddress.ip_network(self.cidr).prefixlen
        _ip("addr", "replace", f"{self.host_address}/{prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        existing = set(_ip("netns", "list").stdout.split())
        for link in self.nodes:
            if link.netns not in existing:
                _ip("netns", "add", link.netns)
            if _ip("link", "show", link.veth, check=False).returncode != 0:
                _ip("link", "add", link.veth, "type", "veth", "peer", "name", "eth0", "netns", link.netns)
            _ip("link", "set", link.veth, "master", self.bridge)
            _ip("link", "set", link.veth, "up")
            _ip("-n", link.netns, "link", "set", "lo", "up")
            _ip("-n", link.netns, "addr", "replace", f"{link.address}/{prefix}", "dev", "eth0")
            _ip("-n", link.netns, "link", "set", "eth0", "up")
            _ip("-n", link.netns, "route", "replace", "default", "via", self.host_address)
        self._uplink()

    def _uplink(self) -> None:
        """Forwarding and masquerading from the bridge to the host's other interfaces (module docstring).
        The table is replaced as a whole in one ``nft -f`` transaction. Raises :class:`NetnsError`."""
        try:
            if _IP_FORWARD.read_text().strip() != "1":
                _IP_FORWARD.write_text("1\n")
        except OSError as e:
            raise NetnsError(f"cannot turn on IPv4 forwarding for the node namespaces: {e}",
                             details={"path": str(_IP_FORWARD), "stderr": str(e)}) from e
        table = uplink_table(self.tag)
        ruleset = (
            f"table inet {table} {{}}\n"
            f"delete table inet {table}\n"
            f"table inet {table} {{\n"
            f"  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n"
            # Only what leaves the machine: the host's own packets to the bridge address (source in the /24,
            # out on lo) must keep their source, or PostgreSQL sees them come from the uplink's address.
            f"    ip saddr {self.cidr} ip daddr != {self.cidr} oifname != {{ \"{self.bridge}\", \"lo\" }}"
            f" masquerade; }}\n"
            f"  chain forward {{ type filter hook forward priority filter; policy accept;\n"
            f"    iifname \"{self.bridge}\" accept;\n"
            f"    oifname \"{self.bridge}\" ct state established,related accept; }}\n"
            f"}}\n")
        done = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode != 0:
            raise NetnsError(f"nft refused the node namespaces' uplink table: {done.stderr.strip()}",
                             details={"argv": ["nft", "-f", "-"], "stderr": done.stderr.strip()})

    def destroy(self) -> None:
        """Remove the namespaces, veths, bridge and uplink table; idempotent, never raises for what is already
        gone. IPv4 forwarding stays on (another stack may rely on it; the module docstring says why it is
        harmless)."""
        for link in self.nodes:
            _ip("link", "del", link.veth, check=False)  # deletes the peer inside the namespace too
            _ip("netns", "del", link.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
        delete_nft_table(uplink_table(self.tag))

    def cut(self, node_id: str) -> None:
        """Take ``node_id``'s host-side veth down: the node can reach nothing and nothing reaches it."""
        _ip("link", "set", self.node(node_id).veth, "down")

    def restore(self, node_id: str) -> None:
        """Bring ``node_id``'s link back up (undoes :meth:`cut`), with its default route as :meth:`create` set
        it (the kernel may have dropped it while the link was down)."""
        link = self.node(node_id)
        _ip("link", "set", link.veth, "up")
        _ip("-n", link.netns, "route", "replace", "default", "via", self.host_address, check=False)

    def save(self, data_dir: Path) -> None:
        """Write the plan to ``DATA_DIR/netns.json`` (for :func:`purge_networks`)."""
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / STATE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, data_dir: Path) -> NodeNetwork | None:
        """The plan saved in ``data_dir``, or None."""
        try:
            raw = json.loads((data_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return cls(**{**raw, "nodes": [NodeLink(**n) for n in raw.get("nodes", [])]})


def uplink_table(tag: str) -> str:
    """The host namespace's nftables table (``inet``) that gives the node namespaces of stack ``tag`` their
    way out (module docstring)."""
    return f"{nft_table_of(tag)}_hosts"


def node_ids_for(count: int) -> list[str]:
    """Node ids of a ``count``-node dev stack: ``node-a``, ``node-b``, ... (``node-1``... beyond 26)."""
    if count <= 26:
        return [f"node-{chr(ord('a') + i)}" for i in range(count)]
    return [f"node-{i + 1}" for i in range(count)]


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:  # `-4`: every address is IPv4
            nets.append(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
    return nets


def plan_network(data_dir: Path, node_ids: list[str], *, bridge_name: str | None = None) -> NodeNetwork:
    """A plan (nothing created yet) for ``node_ids`` of the stack in ``data_dir``; a saved plan with the same
    nodes is reused, so a restarted stack keeps its addresses. The /24 is the first of ``10.77.<k>.0/24``,
    starting at a ``k`` derived from the tag, that overlaps no address on the host (other than our own bridge).
    At most 253 nodes."""
    saved = NodeNetwork.load(data_dir)
    if saved is not None and [n.node_id for n in saved.nodes] == node_ids:
        return saved
    if len(node_ids) > 253:
        raise ValueError("at most 253 nodes")
    tag = stack_tag(data_dir)
    bridge = bridge_name or f"pbb-{tag}"
    used = _used_networks()
    start = int(tag, 16) % 256
    for step in range(256):
        k = (start + step) % 256
        net = ipaddress.ip_network(f"10.77.{k}.0/24")
        if not any(net.overlaps(u) for u in used):
            break
    else:
        raise NetnsError("no free /24 in 10.77.0.0/16 for the node bridge", details={})
    hosts = list(net.hosts())
    links = [NodeLink(node_id=nid, netns=f"pb-{tag}-{nid}"[:60], veth=f"pbv-{tag}-{i}", address=str(hosts[i + 1]))
             for i, nid in enumerate(node_ids)]
    return NodeNetwork(tag=tag, bridge=bridge, cidr=str(net), host_address=str(hosts[0]), nodes=links)


def purge_networks(data_dir: Path) -> bool:
    """Remove what the stack of ``data_dir`` made on the host's network: its nftables table in the host
    namespace (a single-node stack's; taps go with their QEMUs) and the namespaces, veths and bridge recorded in
    ``data_dir`` (and the record). Another stack's are never touched. True if there was any."""
    table = remove_nft_table(data_dir)
    forget_stack(stack_tag(data_dir))
    saved = NodeNetwork.load(data_dir)
    if saved is None:
        return table
    saved.destroy()
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    return True


def sweep_orphans(*, registry: Path = STACKS_DIR) -> list[str]:
    """Remove the host network state of stacks whose data directory was deleted without a purge (a killed
    test's or benchmark's stack): for each such tag (:func:`podbay.stacknet.orphaned_stacks`), its nftables
    table in this namespace, its node namespaces ``pb-<tag>-*`` (the tables inside go with them), veths
    ``pbv-<tag>-*`` and bridge ``pbb-<tag>``, then its record. Another stack's state is never touched: names
    carry the tag. Returns the tags swept. Needs root; idempotent."""
    swept = []
    for tag in orphaned_stacks(registry=registry):
        delete_nft_table(nft_table_of(tag))
        delete_nft_table(uplink_table(tag))
        for ns in _ip("netns", "list", check=False).stdout.split():
            if ns.startswith(f"pb-{tag}-"):
                _ip("netns", "del", ns, check=False)
        links = _ip("-o", "link", "show", check=False).stdout
        for line in links.splitlines():
            name = line.split(":", 2)[1].strip().split("@", 1)[0] if line.count(":") >= 2 else ""
            if name.startswith(f"pbv-{tag}-") or name == f"pbb-{tag}":
                _ip("link", "del", name, check=False)
        forget_stack(tag, registry=registry)
        swept.append(tag)
    return swept
