"""Readiness and machine operations: hello/ping, after_restore, freeze/thaw.

``after_restore`` runs after every restore or fork (no vmgenid on microvm, docs/DESIGN.md §3): a new hostname
(sethostname), a seed mixed into and credited to the kernel RNG (ioctl RNDADDENTROPY on /dev/urandom; a
plain write, which mixes without crediting, when the ioctl is refused) followed by a forced reseed of the CRNG
(ioctl RNDRESEEDCRNG: since Linux 5.18 added entropy only reaches /dev/urandom at the next scheduled reseed,
up to 60 s later, so without it forked children would read the same stream), the wall clock
(clock_settime(CLOCK_REALTIME)), env vars for later execs, and with ``net`` the guest's address, default
route, resolver and sandbox CA (``guestd/net.py``). ``freeze`` syncs then FIFREEZEs mount
points, arming a timer that thaws them if no ``thaw`` arrives in time.

The machine calls sit behind ``System`` so that tests on a host use ``FakeSystem``, which only records.
"""

from __future__ import annotations

import abc
import base64
import binascii
import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from typing import Any

from podbay.channel.frames import VERSION

from .atomic import write_atomic
from .errors import OpError, from_oserror
from .server import Stream

__all__ = ["System", "RealSystem", "FakeSystem", "GuestState", "guest_info", "SYSTEM_OPS"]

log = logging.getLogger("guestd.system")

# <linux/random.h>: _IOW('R', 0x03, int[2]) and _IO('R', 0x07); <linux/fs.h>: _IOWR('X', 119/120, int).
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
#: Where ``after_restore`` puts the sandbox's access token (mode 0600).
ACCESS_TOKEN_PATH = "/run/podbay/access_token"
#: ``net.extra_ca_pem``: at most this many characters (podbay.contracts.channel.GUEST_EXTRA_CA_MAX), of
#: nothing but PEM certificate blocks.
EXTRA_CA_MAX = 128 * 1024
_PEM_CERTS = re.compile(r"(?:\s*-----BEGIN CERTIFICATE-----\s*[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----)+\s*")


class System(abc.ABC):
    """Machine-level calls used by the operations."""

    def hostname(self) -> str:
        return socket.gethostname()

    @abc.abstractmethod
    def set_hostname(self, name: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def add_entropy(self, seed: bytes) -> bool:
        """Mix ``seed`` into the kernel RNG; True when it was also credited as entropy."""
        raise NotImplementedError

    @abc.abstractmethod
    def reseed_crng(self) -> bool:
        """Make /dev/urandom draw from the input pool now; False when the kernel refused."""
        raise NotImplementedError

    @abc.abstractmethod
    def set_clock(self, time_ns: int) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def set_access_token(self, token: str) -> None:
        """Store the sandbox's access token where root processes in the guest can read it."""
        raise NotImplementedError

    @abc.abstractmethod
    def configure_net(self, net: dict[str, Any]) -> str:
        """Apply a validated ``GuestNet`` (address, route, resolver, CA); returns the NIC's name."""
        raise NotImplementedError

    @abc.abstractmethod
    def mount_volumes(self, volumes: list[dict[str, Any]]) -> list[str]:
        """Mount volume slots at paths (guestd/volumes.py); returns the paths."""

    @abc.abstractmethod
    def sync(self) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def freeze(self, mount: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def thaw(self, mount: str) -> None:
        raise NotImplementedError


HOSTS = "/etc/hosts"
#: Debian's address for the machine's own name when it has no fixed one (the installer's ``127.0.1.1`` line).
SELF_ADDRESS = "127.0.1.1"


def hosts_with_hostname(hosts: str, name: str) -> str:
    """``/etc/hosts`` text with the machine's own name on the ``127.0.1.1`` line (replaced, or added at the
    end), so that the sandbox's hostname resolves (``sudo``, ``hostname -f``) without DNS. Other lines stay."""
    line = f"{SELF_ADDRESS}\t{name}"
    out, done = [], False
    for existing in hosts.splitlines():
        if existing.split("#", 1)[0].split()[:1] == [SELF_ADDRESS]:
            if not done:
                out.append(line)
                done = True
            continue
        out.append(existing)
    if not done:
        out.append(line)
    return "\n".join(out) + "\n"


class RealSystem(System):
    """The calls for real, inside a VM (needs root)."""

    def set_hostname(self, name: str) -> None:
        socket.sethostname(name)
        # Replaced whole (mode 0644), not rewritten in place: a process of a fork child may be resolving names.
        # A failure is logged, not raised: the hostname itself is set.
        try:
            write_atomic("/etc/hostname", (name + "\n").encode(), 0o644)
            with open(HOSTS, encoding="utf-8") as fh:
                hosts = fh.read()
            new = hosts_with_hostname(hosts, name)
            if new != hosts:
                write_atomic(HOSTS, new.encode(), 0o644)
        except OSError as exc:
            log.warning("hostname files: %s", exc)

    def add_entropy(self, seed: bytes) -> bool:
        fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
        try:
            try:
                fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
                return True
            except OSError as exc:
                log.warning("RNDADDENTROPY refused (%s): mixing without credit", exc)
                os.write(fd, seed)
                return False
        finally:
            os.close(fd)

    def reseed_crng(self) -> bool:
        fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
            return True
        except OSError as exc:
            log.error("RNDRESEEDCRNG refused (%s): /dev/urandom keeps its stream until the next reseed", exc)
            return False
        finally:
            os.close(fd)

    def set_clock(self, time_ns: int) -> None:
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)

    def set_access_token(self, token: str) -> None:
        # Written beside and renamed over, so a reader never sees half a token; root-only, like a key file.
        os.makedirs(os.path.dirname(ACCESS_TOKEN_PATH), mode=0o755, exist_ok=True)
        write_atomic(ACCESS_TOKEN_PATH, token.encode(), 0o600)

    def configure_net(self, net: dict[str, Any]) -> str:
        from . import net as guest_net

        name = guest_net.configure_net(net["address"], net["prefix_len"], net["gateway"], net["dns"])
        if net.get("ca_cert_pem") or net.get("extra_ca_pem"):
            guest_net.install_ca(net.get("ca_cert_pem"), net.get("extra_ca_pem"))
        return name

    def sync(self) -> None:
        os.sync()

    def mount_volumes(self, volumes: list[dict[str, Any]]) -> list[str]:
        from . import volumes as guest_volumes

        return guest_volumes.mount_volumes(volumes)

    def _ioctl_dir(self, mount: str, request: int, ok_errno: int) -> None:
        fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, request, 0)
        except OSError as exc:
            if exc.errno != ok_errno:
                raise
        finally:
            os.close(fd)

    def freeze(self, mount: str) -> None:
        self._ioctl_dir(mount, FIFREEZE, errno.EBUSY)  # EBUSY: already frozen

    def thaw(self, mount: str) -> None:
        self._ioctl_dir(mount, FITHAW, errno.EINVAL)  # EINVAL: not frozen


class FakeSystem(System):
    """Records every call (``calls``, and as JSON lines in ``log_path`` if given); changes nothing."""

    def __init__(self, log_path: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.log_path = log_path
        self._hostname = socket.gethostname()
        self._lock = threading.Lock()

    def _record(self, name: str, arg: Any) -> None:
        with self._lock:
            self.calls.append((name, arg))
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps([name, arg]) + "\n")

    def hostname(self) -> str:
        return self._hostname

    def set_hostname(self, name: str) -> None:
        self._hostname = name
        self._record("set_hostname", name)

    def add_entropy(self, seed: bytes) -> bool:
        self._record("add_entropy", base64.b64encode(seed).decode())
        return True

    def reseed_crng(self) -> bool:
        self._record("reseed_crng", None)
        return True

    def set_clock(self, time_ns: int) -> None:
        self._record("set_clock", time_ns)

    def set_access_token(self, token: str) -> None:
        self._record("set_access_token", token)

    def configure_net(self, net: dict[str, Any]) -> str:
        self._record("configure_net", net)
        return "eth0"

    def sync(self) -> None:
        self._record("sync", None)

    def mount_volumes(self, volumes: list[dict[str, Any]]) -> list[str]:
        self._record("mount_volumes", volumes)
        return [v["path"] for v in volumes]

    def freeze(self, mount: str) -> None:
        self._record("freeze", mount)

    def thaw(self, mount: str) -> None:
        self._record("thaw", mount)


class GuestState:
    """State shared by operations: the system interface, env for execs, frozen mounts and the thaw timer."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.extra_env: dict[str, str] = {}
        self.frozen: list[str] = []
        self.lock = threading.Lock()
        self.thaw_timer: threading.Timer | None = None


_BOOT_ID: list[str] = []


def _boot_id() -> str:
    """The kernel's boot id, read once: it stays the same for the life of this process (a restored guest
    keeps its template's boot), and reading it costs about a millisecond under TCG."""
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
                _BOOT_ID.append(fh.read().strip())
        except OSError:
            return ""
    return _BOOT_ID[0]


def guest_info(state: GuestState, session: str | None) -> dict[str, Any]:
    """The ``GuestInfo`` shape: protocol version, boot id, uptime (CLOCK_BOOTTIME s), pid, hostname."""
    return {
        "version": VERSION,
        "boot_id": _boot_id(),
        "uptime_s": time.clock_gettime(time.CLOCK_BOOTTIME),
        "pid": os.getpid(),
        "hostname": state.system.hostname(),
        "session": session,
    }


def _state(stream: Stream) -> GuestState:
    state = stream.server.state
    assert isinstance(state, GuestState)
    return state


def op_ping(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``ping``/``hello`` -> GuestInfo."""
    return guest_info(_state(stream), stream.session)


def _ipv4(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise OpError("invalid", f"{what} must be an IPv4 address")
    try:
        if socket.inet_ntoa(socket.inet_aton(value)) != value or value.count(".") != 3:
            raise OSError
    except OSError as exc:
        raise OpError("invalid", f"{what} must be an IPv4 address") from exc
    return value


def _net_args(net: Any) -> dict[str, Any] | None:
    """Validate ``after_restore.net`` (``GuestNet``) into a plain dict, or None when absent."""
    if net is None:
        return None
    if not isinstance(net, dict):
        raise OpError("invalid", "net must be an object")
    prefix = net.get("prefix_len", 30)
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 8 <= prefix <= 30:
        raise OpError("invalid", "net.prefix_len must be in 8..30")
    dns = net.get("dns", [])
    if not isinstance(dns, list) or len(dns) > 3:
        raise OpError("invalid", "net.dns must be a list of at most 3 addresses")
    ca = net.get("ca_cert_pem")
    if ca is not None and (not isinstance(ca, str) or len(ca) > 16384 or "BEGIN CERTIFICATE" not in ca):
        raise OpError("invalid", "net.ca_cert_pem must be one PEM certificate")
    extra = net.get("extra_ca_pem")
    if extra is not None and (not isinstance(extra, str) or len(extra) > EXTRA_CA_MAX
                              or not _PEM_CERTS.fullmatch(extra)):
        raise OpError("invalid", f"net.extra_ca_pem must be PEM certificates, at most {EXTRA_CA_MAX} characters")
    return {"address": _ipv4(net.get("address"), "net.address"), "prefix_len": prefix,
            "gateway": _ipv4(net.get("gateway"), "net.gateway"),
            "dns": [_ipv4(d, "net.dns") for d in dns], "ca_cert_pem": ca, "extra_ca_pem": extra}


def _volume_args(volumes: Any) -> list[dict[str, Any]] | None:
    """Validate ``after_restore.volumes`` (``GuestVolume``: slot, absolute path, readonly), or None."""
    if volumes is None:
        return None
    if not isinstance(volumes, list) or len(volumes) > 16:
        raise OpError("invalid", "volumes must be a list of at most 16 entries")
    out = []
    for v in volumes:
        if not isinstance(v, dict):
            raise OpError("invalid", "each volume must be an object")
        slot, path, ro = v.get("slot"), v.get("path"), v.get("readonly", False)
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < 16:
            raise OpError("invalid", "volume slot must be an integer in 0..15")
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path or ".." in path.split("/"):
            raise OpError("invalid", "volume path must be absolute, without '..'")
        out.append({"slot": slot, "path": os.path.normpath(path), "readonly": bool(ro)})
    return out


def op_after_restore(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``after_restore {hostname?, seed_b64?, time_ns?, env?, access_token?, net?, volumes?}`` -> ``{hostname,
    entropy_credited, clock_set, env_keys, access_token_set, net_interface, volumes_mounted}``. Everything is
    validated before anything is changed."""
    state = _state(stream)
    volumes = _volume_args(args.get("volumes"))
    hostname, seed_b64, time_ns, env, token = (
        args.get(k) for k in ("hostname", "seed_b64", "time_ns", "env", "access_token"))
    net = _net_args(args.get("net"))
    if token is not None and (not isinstance(token, str) or not 16 <= len(token) <= 256 or not token.isprintable()):
        raise OpError("invalid", "access_token must be 16..256 printable characters")
    if hostname is not None and (not isinstance(hostname, str) or not 0 < len(hostname) <= 64):
        raise OpError("invalid", "hostname must be 1..64 characters")
    seed = b""
    if seed_b64 is not None:
        try:
            seed = base64.b64decode(str(seed_b64), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise OpError("invalid", f"seed_b64: {exc}") from exc
        if len(seed) > 4096:
            raise OpError("invalid", "seed longer than 4096 bytes")
    if time_ns is not None and (isinstance(time_ns, bool) or not isinstance(time_ns, int) or time_ns < 0):
        raise OpError("invalid", "time_ns must be a non-negative integer")
    if env is not None and (
        not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise OpError("invalid", "env must map strings to strings")
    credited = clock_set = reseeded = token_set = False
    nic: str | None = None
    try:
        if time_ns is not None:
            state.system.set_clock(time_ns)
            clock_set = True
        if seed:
            credited = state.system.add_entropy(seed)
            reseeded = state.system.reseed_crng()
        if hostname is not None:
            state.system.set_hostname(hostname)
        if token is not None:
            state.system.set_access_token(token)
            token_set = True
        if net is not None:
            nic = state.system.configure_net(net)
        mounted = state.system.mount_volumes(volumes) if volumes else []
    except OSError as exc:
        raise from_oserror(exc) from exc
    if env is not None:
        state.extra_env = dict(env)
    return {
        "hostname": state.system.hostname(),
        "entropy_credited": credited,
        "crng_reseeded": reseeded,
        "clock_set": clock_set,
        "env_keys": sorted(state.extra_env),
        "access_token_set": token_set,
        "net_interface": nic,
        "volumes_mounted": mounted,
    }


def _mounts(args: dict[str, Any]) -> list[str]:
    mounts = args.get("mounts", ["/"])
    if not isinstance(mounts, list) or not mounts or not all(isinstance(m, str) and m.startswith("/") for m in mounts):
        raise OpError("invalid", "mounts must be a non-empty list of absolute paths")
    return list(dict.fromkeys(mounts))


def _thaw_all(state: GuestState, mounts: list[str], *, why: str) -> list[str]:
    thawed: list[str] = []
    with state.lock:
        for mount in reversed(mounts):
            try:
                state.system.thaw(mount)
                thawed.append(mount)
            except OSError as exc:
                log.error("thaw %s (%s): %s", mount, why, exc)
            if mount in state.frozen:
                state.frozen.remove(mount)
        if not state.frozen and state.thaw_timer is not None:
            state.thaw_timer.cancel()
            state.thaw_timer = None
    thawed.reverse()
    return thawed


def op_freeze(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``freeze {mounts=["/"], timeout_s=30}``: sync, FIFREEZE each mount -> ``{"mounts": [...]}``.
    On a failure the mounts frozen so far are thawed again."""
    state = _state(stream)
    mounts = _mounts(args)
    timeout = args.get("timeout_s", 30.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
        raise OpError("invalid", "timeout_s must be in (0, 600]")
    state.system.sync()
    done: list[str] = []
    failed: OpError | None = None
    with state.lock:
        try:
            for mount in mounts:
                state.system.freeze(mount)
                done.append(mount)
                if mount not in state.frozen:
                    state.frozen.append(mount)
        except OSError as exc:
            failed = from_oserror(exc, mount)
        else:
            if state.thaw_timer is not None:
                state.thaw_timer.cancel()
            timer = threading.Timer(timeout, lambda: _auto_thaw(state))
            timer.daemon = True
            state.thaw_timer = timer
            timer.start()
    if failed is not None:
        _thaw_all(state, done, why="freeze failed")
        raise failed
    return {"mounts": done}


def _auto_thaw(state: GuestState) -> None:
    with state.lock:
        frozen = list(state.frozen)
        state.thaw_timer = None
    if frozen:
        log.warning("no thaw arrived in time: thawing %s", frozen)
        _thaw_all(state, frozen, why="timeout")


def op_thaw(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """``thaw {mounts=["/"]}``: FITHAW each mount (not frozen is fine) -> ``{"mounts": [...]}``."""
    state = _state(stream)
    return {"mounts": _thaw_all(state, _mounts(args), why="thaw")}


SYSTEM_OPS = {
    "hello": op_ping,
    "ping": op_ping,
    "after_restore": op_after_restore,
    "freeze": op_freeze,
    "thaw": op_thaw,
}
