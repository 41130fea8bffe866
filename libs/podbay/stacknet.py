"""Host network names and addresses of one stack, so that several stacks share a host safely.

A *stack* is everything that runs from one data directory (``PODBAY_DATA_DIR``): the dev stack of
``podbay up``, a test fixture's stack, a benchmark's. Whatever a stack creates in a network namespace it
shares with other stacks carries a name derived from that data directory, and its cleanup removes only
what is its own:

- the **tag**: the first 5 hex digits of the SHA-256 of the data directory's resolved path
  (:func:`stack_tag`); ``libs/podbay/devstack/netns.py`` names bridges, veths and namespaces with it too;
- **taps**: ``pb<tag>t<lease>`` (:func:`tap_prefix`; at most 13 characters for a /16, within IFNAMSIZ), and
  ``pb<tag>tb<n>`` for the template builder's boot;
- the **nftables table**: ``inet podbay_<tag>`` (:func:`nft_table`), matching only this stack's taps;
- the **sandbox network**: ``PODBAY_SANDBOX_CIDR`` when set, else a /16 of :data:`SANDBOX_POOL` chosen once
  per data directory (:func:`sandbox_cidr`) and kept in ``DATA_DIR/network.json``: the first block, starting
  from one derived from the tag, that overlaps no address on the host. Two stacks' guests therefore never
  share an address, a route or a gateway binding.

A stack killed before its cleanup, whose data directory is then deleted (a test's or a benchmark's temporary
directory), would leave its table and namespaces on the host for good: nothing could name them any more. So
each stack that makes host network state records its tag and data directory in :data:`STACKS_DIR`
(:func:`register_stack`), and the next stack to start removes what is recorded for data directories that no
longer exist (:func:`orphaned_stacks`, ``podbay.devstack.netns.sweep_orphans``).

Errors: :class:`StackNetError` (no free block in the pool; not retryable).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

from podbay.config import Settings
from podbay.errors import PodbayError

__all__ = ["SANDBOX_POOL", "STATE_FILE", "StackNetError", "stack_tag", "tap_prefix", "builder_tap", "nft_table",
           "sandbox_cidr", "gateway_denied_cidr", "remove_nft_table", "STACKS_DIR", "register_stack", "forget_stack",
           "orphaned_stacks", "delete_nft_table", "nft_table_of"]

#: Where automatically chosen sandbox networks come from: 64 blocks of /16, disjoint from the node bridges'
#: ``10.77.0.0/16`` (devstack/netns.py). The gateway refuses the whole pool, so no guest reaches another
#: stack's guests through it either.
SANDBOX_POOL = "10.128.0.0/10"
#: Prefix length of one stack's sandbox network: 16,384 /30 leases.
_BLOCK_PREFIX = 16
#: The record of this data directory's choice, beside its other state.
STATE_FILE = "network.json"


class StackNetError(PodbayError):
    """The stack's host network names or addresses cannot be settled (e.g. the pool is exhausted)."""

    code = "stack_network_failed"


def stack_tag(data_dir: Path) -> str:
    """5 hex digits naming the stack of ``data_dir`` on the host (SHA-256 of its resolved path)."""
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:5]


def tap_prefix(data_dir: Path) -> str:
    """Every sandbox tap of this stack starts with this: ``pb<tag>t`` (the nftables rules match
    ``iifname "pb<tag>t*"``, so another stack's taps are never matched)."""
    return f"pb{stack_tag(data_dir)}t"


def builder_tap(data_dir: Path, n: int) -> str:
    """The tap of a template build's boot, ``pb<tag>tb<n mod 10^6>`` (covered by the stack's ruleset)."""
    return f"{tap_prefix(data_dir)}b{n % 10**6}"


def nft_table(data_dir: Path) -> str:
    """This stack's nftables table (family ``inet``): ``podbay_<tag>``."""
    return nft_table_of(stack_tag(data_dir))


def nft_table_of(tag: str) -> str:
    """The nftables table of the stack tagged ``tag``."""
    return f"podbay_{tag}"


def _host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of every address in this network namespace (``ip -o -4 addr``)."""
    ip = shutil.which("ip")
    if ip is None:
        return []
    out = subprocess.run([ip, "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False,
                         timeout=10).stdout
    nets: list[ipaddress.IPv4Network] = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            # Other stacks' taps count too: their /30s show which blocks are taken.
            net = ipaddress.ip_interface(parts[parts.index("inet") + 1]).network
            if isinstance(net, ipaddress.IPv4Network):
                nets.append(net)
    return nets


def _choose(tag: str, used: list[ipaddress.IPv4Network]) -> str:
    pool = ipaddress.IPv4Network(SANDBOX_POOL)
    blocks = list(pool.subnets(new_prefix=_BLOCK_PREFIX))
    start = int(tag, 16) % len(blocks)
    for step in range(len(blocks)):
        block = blocks[(start + step) % len(blocks)]
        if not any(block.overlaps(u) for u in used):
            return str(block)
    raise StackNetError(f"no /{_BLOCK_PREFIX} of {SANDBOX_POOL} is free on this host: set PODBAY_SANDBOX_CIDR")


def _recorded_networks(own_tag: str, registry: Path) -> list[ipaddress.IPv4Network]:
    """The sandbox networks other stacks on this host recorded (their ``network.json``, found through the
    stack registry). A stack with no sandbox running has no tap, so host addresses alone miss its block, and
    two tags can hash to the same start block. Unreadable records are skipped."""
    nets: list[ipaddress.IPv4Network] = []
    try:
        entries = list(registry.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return nets
    for entry in entries:
        if entry.name.startswith(".") or entry.name == own_tag:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data_dir = Path(entry.read_text().strip())
            net = ipaddress.ip_network(str(json.loads((data_dir / STATE_FILE).read_text())["sandbox_cidr"]))
            if isinstance(net, ipaddress.IPv4Network):
                nets.append(net)
    return nets


def sandbox_cidr(settings: Settings, *, registry: Path | None = None) -> str:
    """The stack's sandbox network: ``settings.sandbox_cidr`` when set, else the block recorded in
    ``DATA_DIR/network.json``, chosen and recorded on first use (under a file lock, so the node agent and the
    gateway starting at once agree) among the blocks that neither a host address nor another registered
    stack's record (``registry``, default :data:`STACKS_DIR`) uses. Blocking (reads host addresses once).
    Raises :class:`StackNetError`."""
    if settings.sandbox_cidr:
        return settings.sandbox_cidr
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / STATE_FILE
    with open(data_dir / f".{STATE_FILE}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            cidr = str(json.loads(path.read_text())["sandbox_cidr"])
            ipaddress.ip_network(cidr)
            return cidr
        tag = stack_tag(data_dir)
        used = _host_networks() + _recorded_networks(tag, STACKS_DIR if registry is None else registry)
        cidr = _choose(tag, used)
        tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"tag": tag, "sandbox_cidr": cidr}))
        os.replace(tmp, path)
        return cidr


def gateway_denied_cidr(settings: Settings) -> str:
    """The sandbox addresses the gateway never connects to: the configured ``sandbox_cidr``, else the whole
    :data:`SANDBOX_POOL` (this stack's network and every other stack's that was chosen automatically)."""
    return settings.sandbox_cidr or SANDBOX_POOL


def remove_nft_table(data_dir: Path) -> bool:
    """Delete this stack's nftables table in the current network namespace; True if there was one.
    Never touches another stack's table. Blocking; a missing ``nft`` counts as nothing to remove."""
    return delete_nft_table(nft_table(data_dir))


def delete_nft_table(table: str) -> bool:
    """Delete ``table inet <table>`` in the current network namespace; True if there was one. Blocking; a
    missing ``nft`` counts as nothing to remove."""
    nft = shutil.which("nft")
    if nft is None:
        return False
    done = subprocess.run([nft, "delete", "table", "inet", table], capture_output=True, text=True, check=False,
                          timeout=30)
    return done.returncode == 0


#: The host's record of stacks that made host network state: one file per stack, named by its tag, holding
#: its data directory's resolved path. Under /run (a tmpfs), which is emptied at boot as are the tables and
#: namespaces it records.
STACKS_DIR = Path("/run/podbay/stacks")


def register_stack(data_dir: Path, *, registry: Path = STACKS_DIR) -> None:
    """Record that the stack of ``data_dir`` makes host network state (see the module docstring). Written
    atomically; a registry that cannot be written (not root) is skipped, since such a stack makes none."""
    path = str(data_dir.resolve())
    try:
        registry.mkdir(parents=True, exist_ok=True)
        tmp = registry / f".{stack_tag(data_dir)}.{os.getpid()}"
        tmp.write_text(path)
        tmp.replace(registry / stack_tag(data_dir))
    except PermissionError:
        pass


def forget_stack(tag: str, *, registry: Path = STACKS_DIR) -> None:
    """Remove ``tag``'s record (its stack's host state is gone)."""
    (registry / tag).unlink(missing_ok=True)


def orphaned_stacks(*, registry: Path = STACKS_DIR) -> dict[str, Path]:
    """Recorded stacks whose data directory no longer exists, as ``{tag: data_dir}``. Their host network
    state can belong to no running stack: a stack's processes all live in, and are found through, its data
    directory. An unreadable record is skipped, never guessed at."""
    out: dict[str, Path] = {}
    try:
        entries = list(registry.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            data_dir = Path(entry.read_text().strip())
        except OSError:
            continue
        if data_dir.is_absolute() and stack_tag(data_dir) == entry.name and not data_dir.exists():
            out[entry.name] = data_dir
    return out
