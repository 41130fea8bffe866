"""QEMU runs unprivileged and confined (docs/DESIGN.md §6): a system user of its own inside bubblewrap.

The guest is untrusted, and so is the QEMU process that emulates its devices. The node agent (root) starts each
QEMU as::

    bwrap <namespaces, minimal filesystem> -- setpriv <user, no groups, no capabilities> -- qemu-system-x86_64 ...

- **User.** One system user and group (``PODBAY_VMM_USER``, default ``podbay-vm``), created idempotently with
  ``useradd --system`` when the node agent starts. It owns nothing but the VM directories it is given, so it
  cannot read the data dir, PostgreSQL's cluster, the build cache or the node agent's secrets. With
  ``PODBAY_VMM_UID_RANGE`` (e.g. ``200000-265535``) each QEMU runs instead as a uid and gid of its own from
  that range (:class:`UidPool`; no passwd entry needed), so two guests' QEMUs share no owner: neither can
  open the other's files even outside their mount namespaces, nor share per-uid kernel state (keyrings,
  process and inotify limits). Signalling and ptracing another QEMU is already impossible with one shared
  user: each QEMU is alone in its pid namespace and its seccomp filter denies fork and exec.
- **Namespaces.** New mount, pid, ipc, uts and network namespaces (and a cgroup namespace where the kernel
  allows). QEMU needs no host network: a NIC is an already-open tap fd handed down by the node agent.
- **Filesystem.** The root is an empty tmpfs, remounted read-only once populated: ``/usr`` read-only (QEMU,
  its libraries, firmware under ``/usr/share/qemu`` and ``/usr/share/seabios``), the ``/lib*``, ``/bin``
  symlinks of a merged-usr host (or the directories themselves), ``/etc/ld.so.cache``; in ``/dev`` only
  ``null``, ``urandom`` and, when accel is kvm, ``kvm``; the VM's own directory and the kernel and
  initramfs (read-only), each at the same path as on the host so QEMU's argv (and the node agent's checks of
  ``/proc/<pid>/cmdline``) stay the same. No ``/proc`` at all, no ``/sys``, no ``/root``, no data dir, no
  other VM. Snapshots and the migration state file are never mounted: they travel as fds over QMP.
- **Files.** The VM directory stays root's (group: the user's, mode 0750): QEMU writes the content of
  ``ram`` and ``disk.img`` (its own, mode 0600) but can neither create, rename, replace nor
  unlink a name there, so the node agent (root), which reflinks, moves and writes files in that directory,
  never follows a symlink QEMU planted. QEMU creates its sockets in ``run/``, which is the user's only until
  QMP answers, then root's again (:func:`lock_run_dir`). The serial console is one of those sockets:
  ``console.log`` is written by the node agent (``console.py``, capped and rotated), never by QEMU.
- **Privileges.** ``setpriv`` switches to the user with no supplementary groups (the group of ``/dev/kvm``
  only under kvm), clears the inheritable, ambient and bounding capability sets and sets ``no_new_privs``, so
  the QEMU process has ``CapEff`` 0 and can never regain a capability.

Why bwrap runs as root plus ``setpriv`` rather than bwrap as the user with ``--unshare-user --uid``: an
unprivileged bwrap resolves its bind sources with the user's own rights, and the VM directories live under a
data dir (often in ``/root``) that the user must not be able to traverse; ``--bind-fd`` with a directory fd
opened by root is refused too (``/proc/self/fd/N`` is not accessible once bwrap has entered the new user
namespace). As root, bwrap sets the sandbox up, and the privileges are dropped by the last exec before QEMU.

Why ``--as-pid-1`` and not ``--die-with-parent``: QEMU must outlive a node-agent restart (the agent re-attaches
through ``qemu.pid``), so nothing ties its life to the agent; and with ``--as-pid-1`` the process bwrap reports
as ``child-pid`` on ``--info-fd`` *is* QEMU (setpriv execs it), which is the host pid the node agent signals,
watches with a pidfd and reads CPU time from. QEMU's own ``-pidfile`` would record its pid inside the new pid
namespace (1), so the wrapper drops that option and the node agent writes the host pid itself. QEMU handles
SIGTERM, and SIGKILL from the host always reaches a namespace's init, so signals keep working.

``PODBAY_VMM_CONFINE=false`` turns all of this off (QEMU as the node agent's user, as before) for debugging.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pwd
import shutil
import select
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from podbay.config import Settings
from podbay.errors import Unavailable
from podbay.faults import fault_point

__all__ = [
    "DEFAULT_VMM_USER", "ConfinementError", "VmmUser", "Confinement", "ensure_vmm_user", "confine_argv",
    "strip_pidfile", "own_vm_files", "check_readable", "kvm_group", "host_has_merged_usr", "from_settings",
    "spawn_confined", "read_child_pid", "start_confined", "lock_run_dir", "VM_WRITABLE_FILES", "RUN_DIR",
    "UidRange", "UidPool", "UID_REGISTRY",
]

log = logging.getLogger("podbay.nodeagent.confine")

DEFAULT_VMM_USER = "podbay-vm"
_BIND_HOST_DIRS = ("/usr",)
_MERGED_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib64")
_ETC_FILES = ("/etc/ld.so.cache",)
_DEVICES = ("/dev/null", "/dev/urandom")
VM_WRITABLE_FILES = ("ram", "disk.img", "vol0.img", "vol1.img", "vol2.img", "vol3.img")
"""Files of a VM directory that QEMU opens for writing (see ``vmm.VmPaths``); the node agent chowns them."""
RUN_DIR = "run"
"""The subdirectory of a VM directory where QEMU creates its QMP and channel sockets."""


class ConfinementError(Unavailable):
    """QEMU cannot be confined here (bwrap or setpriv missing, the user cannot be created, not root)."""

    code = "vmm_confinement_unavailable"
    http_status = 503
    retryable = False


@dataclass(frozen=True)
class VmmUser:
    """The system user QEMU runs as: ``name``, ``uid``, ``gid``."""

    name: str
    uid: int
    gid: int


def ensure_vmm_user(name: str = DEFAULT_VMM_USER) -> VmmUser:
    """The system user ``name``, created with a group of its own, no home and no login shell when missing.

    Idempotent (a concurrent creation by another process is fine). Needs root to create it. Raises
    :class:`ConfinementError` when the user can neither be found nor created.
    """
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        done = subprocess.run(
            ["useradd", "--system", "--user-group", "--home-dir", "/nonexistent", "--no-create-home",
             "--shell", "/usr/sbin/nologin", "--comment", "podbay guest VMM (QEMU)", name],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise ConfinementError(
                f"cannot create system user {name!r} for QEMU: {done.stderr.strip() or done.returncode}"
            ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ConfinementError(f"PODBAY_VMM_USER {name!r} is root: QEMU must run as an unprivileged user")
    return VmmUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


#: Where the uids of :class:`UidPool` are recorded (a tmpfs: at boot no QEMU runs and every uid is free).
UID_REGISTRY = Path("/run/podbay/vmm-uids")
# A uid taken for a QEMU that is starting (its pid not known yet) stays taken this long, seconds.
_UID_STARTING_S = 120.0


@dataclass(frozen=True)
class UidRange:
    """``first`` .. ``first + count - 1``: the uids (and equal gids) QEMUs may run as."""

    first: int
    count: int

    @classmethod
    def parse(cls, text: str) -> UidRange | None:
        """``"A-B"`` (inclusive, A >= 1000, B >= A) or empty (None). Raises ``ValueError`` otherwise."""
        if not text.strip():
            return None
        lo, sep, hi = text.strip().partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or not 1000 <= int(lo) <= int(hi) < 2**31:
            raise ValueError(f"a uid range is A-B with 1000 <= A <= B < 2^31, not {text!r}")
        return cls(int(lo), int(hi) - int(lo) + 1)


class UidPool:
    """Uids of :class:`UidRange` handed to QEMUs, one each, recorded in ``registry/<uid>`` as ``"<pid>
    <vm dir>"`` (pid 0 while starting) under an exclusive lock, so node agents (and their restarts) on one host
    agree. A uid is free when it has no record, when its QEMU is gone (no such pid, or that pid now runs as
    another uid), or when it was taken for a start that never recorded a pid within two minutes. Records are
    freed lazily by the next :meth:`take`; a re-attached QEMU keeps its uid and record."""

    def __init__(self, uids: UidRange, registry: Path = UID_REGISTRY) -> None:
        self.uids = uids
        self.registry = registry

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.registry.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.registry / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _in_use(self, uid: int) -> bool:
        record = self.registry / str(uid)
        try:
            pid_text, _, _ = record.read_text().partition(" ")
            pid = int(pid_text)
            if pid == 0:
                return time.time() - record.stat().st_mtime < _UID_STARTING_S
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError):
            return False
        line = next((ln for ln in status.splitlines() if ln.startswith("Uid:")), "")
        return line.split()[1:2] == [str(uid)]

    def take(self, vm_dir: Path) -> int:
        """A free uid, recorded as starting for ``vm_dir``. Raises :class:`ConfinementError` when every uid of
        the range runs a QEMU."""
        with self._locked():
            for uid in range(self.uids.first, self.uids.first + self.uids.count):
                if not self._in_use(uid):
                    (self.registry / str(uid)).write_text(f"0 {vm_dir}\n")
                    return uid
        raise ConfinementError(f"all {self.uids.count} QEMU uids from {self.uids.first} are in use "
                               "(PODBAY_VMM_UID_RANGE)")

    def bind(self, uid: int, pid: int, vm_dir: Path) -> None:
        """Record that QEMU ``pid`` runs as ``uid``."""
        with self._locked():
            (self.registry / str(uid)).write_text(f"{pid} {vm_dir}\n")

    def release(self, uid: int) -> None:
        """Free ``uid`` at once (its QEMU did not start)."""
        with self._locked():
            (self.registry / str(uid)).unlink(missing_ok=True)


@dataclass(frozen=True)
class Confinement:
    """How QEMU is confined: ``user`` to run as, the absolute ``bwrap`` and ``setpriv`` binaries, and ``uids``:
    a pool giving each QEMU a uid of its own instead of ``user``'s (None: every QEMU runs as ``user``)."""

    user: VmmUser
    bwrap: str
    setpriv: str
    uids: UidPool | None = None

    @classmethod
    def prepare(cls, user_name: str = DEFAULT_VMM_USER) -> Confinement:
        """Check the tools and privileges confinement needs and make sure the user exists.

        Raises :class:`ConfinementError` with what to install or set (``PODBAY_VMM_CONFINE=false`` to debug
        without confinement).
        """
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise ConfinementError("bwrap not found: install Debian bubblewrap (scripts/setup.sh does), or set "
                                   "PODBAY_VMM_CONFINE=false to run QEMU unconfined")
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise ConfinementError("setpriv not found: install Debian util-linux, or set PODBAY_VMM_CONFINE=false")
        if os.geteuid() != 0:
            raise ConfinementError("confining QEMU needs root (bubblewrap sets up namespaces, then switches to "
                                   f"{user_name!r}); run the node agent as root or set PODBAY_VMM_CONFINE=false")
        return cls(ensure_vmm_user(user_name), bwrap, setpriv)


def strip_pidfile(qemu_argv: list[str]) -> list[str]:
    """``qemu_argv`` without ``-pidfile PATH``: inside a pid namespace QEMU would record its own pid there as 1."""
    out: list[str] = []
    skip = False
    for arg in qemu_argv:
        if skip:
            skip = False
        elif arg == "-pidfile":
            skip = True
        else:
            out.append(arg)
    return out


def _ancestors(paths: list[PurePosixPath]) -> list[PurePosixPath]:
    """Every proper ancestor directory of ``paths`` (absolute), parents first, without duplicates and ``/``."""
    seen: dict[PurePosixPath, None] = {}
    for p in paths:
        for parent in reversed(p.parents):
            if parent != PurePosixPath("/"):
                seen.setdefault(parent)
    return list(seen)


def confine_argv(
    qemu_argv: list[str],
    *,
    user: VmmUser,
    vm_dir: Path,
    read_only: list[Path],
    info_fd: int,
    kvm: bool,
    kvm_gid: int | None = None,
    bwrap: str = "bwrap",
    setpriv: str = "setpriv",
    merged_usr: bool = True,
) -> list[str]:
    """The bwrap + setpriv argv that runs ``qemu_argv`` confined (see the module docstring). Pure function.

    ``vm_dir`` is bound read-write and each of ``read_only`` (kernel, initramfs; files) read-only, all at their
    own absolute paths; ``info_fd`` is where bwrap writes ``{"child-pid": <QEMU's host pid>, ...}``; ``kvm``
    adds ``/dev/kvm`` and, when ``kvm_gid`` is given, that group as QEMU's only supplementary group;
    ``merged_usr`` makes ``/lib*``, ``/bin``, ``/sbin`` symlinks into ``/usr`` (else the host dirs are bound).
    ``-pidfile`` is dropped from ``qemu_argv``. Paths must be absolute (ValueError otherwise).
    """
    targets = [PurePosixPath(vm_dir), *(PurePosixPath(p) for p in read_only)]
    for t in targets:
        if not t.is_absolute():
            raise ValueError(f"confined QEMU needs absolute paths, got {t}")
    argv = [
        bwrap,
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
        # Own session (no controlling terminal to push input into); QEMU is the namespace's pid 1 so that the
        # pid on --info-fd is QEMU's. No --die-with-parent: QEMU outlives a node-agent restart.
        "--new-session", "--as-pid-1", "--info-fd", str(info_fd),
        "--hostname", "podbay-vm", "--clearenv", "--setenv", "PATH", "/usr/bin",
    ]
    for d in _BIND_HOST_DIRS:
        argv += ["--ro-bind", d, d]
    for link in _MERGED_USR_LINKS:
        if merged_usr:
            argv += ["--symlink", f"usr{link}", link]
        else:
            argv += ["--ro-bind-try", link, link]
    for f in _ETC_FILES:
        argv += ["--ro-bind-try", f, f]
    argv += ["--dir", "/dev"]
    for dev in (*_DEVICES, *(("/dev/kvm",) if kvm else ())):
        argv += ["--dev-bind", dev, dev]
    # bwrap would create missing parents with the host's mode (0700 for /root): make them traversable.
    for parent in _ancestors(targets):
        argv += ["--perms", "0755", "--dir", str(parent)]
    argv += ["--bind", str(vm_dir), str(vm_dir)]
    for p in read_only:
        argv += ["--ro-bind", str(p), str(p)]
    argv += ["--remount-ro", "/", "--chdir", str(vm_dir), "--"]
    groups = f"--groups={kvm_gid}" if kvm and kvm_gid else "--clear-groups"
    argv += [
        setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", groups,
        "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
    ]
    return argv + strip_pidfile(qemu_argv)


def kvm_group() -> int | None:
    """The group of ``/dev/kvm`` when it grants that group read-write, else None (root-only device)."""
    try:
        st = os.stat("/dev/kvm")
    except OSError:
        return None
    if st.st_gid != 0 and st.st_mode & stat.S_IRGRP and st.st_mode & stat.S_IWGRP:
        return st.st_gid
    return None


def host_has_merged_usr() -> bool:
    """Whether ``/lib`` is a symlink into ``/usr`` (Debian bookworm and later)."""
    return os.path.islink("/lib") and os.readlink("/lib").lstrip("/").startswith("usr")


def own_vm_files(vm_dir: Path, run_dir: Path, names: tuple[str, ...], user: VmmUser) -> None:
    """Prepare a VM directory for a confined QEMU: it may write the content of its files, never their names.

    ``vm_dir`` stays root's, mode 0750 with the VMM user's group (QEMU can traverse it but cannot create,
    rename, replace or unlink anything in it: the node agent, as root, later reflinks, reads, moves and writes
    files there, and must never meet a symlink QEMU planted). Each of ``names`` (``ram``, ``disk.img``, the
    volume slots) is created empty when missing, since QEMU cannot create it, and given to the user; a
    name that is not a regular file (a symlink, a directory) is refused with :class:`ConfinementError`.
    ``run_dir`` (QEMU's sockets) is emptied and given to the user, who creates its sockets there; the agent
    takes it back with :func:`lock_run_dir` once QEMU answers.
    """
    os.chown(vm_dir, 0, user.gid, follow_symlinks=False)
    os.chmod(vm_dir, 0o750, follow_symlinks=False)
    for name in names:
        path = vm_dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfinementError(f"{path} is not a regular file")
            os.fchown(fd, user.uid, user.gid)
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        run_dir.unlink()
    run_dir.mkdir(mode=0o700, exist_ok=True)
    for entry in os.listdir(run_dir):
        os.unlink(run_dir / entry)  # stale sockets of an earlier QEMU (run_dir holds no directories)
    os.chown(run_dir, user.uid, user.gid, follow_symlinks=False)
    os.chmod(run_dir, 0o700, follow_symlinks=False)


def lock_run_dir(run_dir: Path, sockets: tuple[Path, ...]) -> None:
    """Take ``run_dir`` back from QEMU once its sockets exist, and check each of ``sockets`` is a socket.

    From then on QEMU cannot swap a socket for a symlink to some other socket of the host that the node
    agent (root) would then connect to; its listening sockets keep working. Raises :class:`ConfinementError`
    when a socket is missing or is not a socket.
    """
    os.chown(run_dir, 0, 0, follow_symlinks=False)
    os.chmod(run_dir, 0o755, follow_symlinks=False)
    for sock in sockets:
        try:
            mode = os.lstat(sock).st_mode
        except FileNotFoundError:
            continue  # QEMU creates the channel socket at start; a missing one just fails to connect later
        if not stat.S_ISSOCK(mode):
            raise ConfinementError(f"{sock} is not a socket")


def check_readable(paths: list[Path]) -> None:
    """Raise :class:`ConfinementError` when a file QEMU reads (kernel, initramfs) is not world-readable."""
    for p in paths:
        try:
            mode = os.stat(p).st_mode
        except OSError as exc:
            raise ConfinementError(f"cannot stat {p}: {exc}") from exc
        if not mode & stat.S_IROTH:
            raise ConfinementError(f"{p} is not readable by the VMM user (mode {stat.filemode(mode)})")


def from_settings(settings: Settings) -> Confinement | None:
    """The node's confinement (``PODBAY_VMM_CONFINE``, ``PODBAY_VMM_USER``), or None when it is turned off.

    Raises :class:`ConfinementError` when it is on but cannot work (start-up fails with that message).
    """
    if not settings.vmm_confine:
        log.warning("PODBAY_VMM_CONFINE=false: QEMU runs unconfined as uid %d", os.geteuid())
        return None
    conf = Confinement.prepare(settings.vmm_user)
    try:
        uids = UidRange.parse(settings.vmm_uid_range)
    except ValueError as exc:
        raise ConfinementError(f"PODBAY_VMM_UID_RANGE: {exc}") from exc
    return dataclasses.replace(conf, uids=UidPool(uids)) if uids is not None else conf


def spawn_confined(
    qemu_argv: list[str], confinement: Confinement, *, vm_dir: Path, read_only: list[Path], kvm: bool,
    log_file: int, pass_fds: tuple[int, ...] = (), prefix: list[str] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``qemu_argv`` confined; returns bwrap's Popen and the read end of its ``--info-fd`` pipe.

    Prepares the VM directory first (:func:`own_vm_files`). ``log_file`` receives stdout and stderr
    (bwrap's errors included); ``pass_fds`` are handed down to QEMU unchanged (e.g. an open tap device);
    ``prefix`` runs before bwrap and must exec it (e.g. ``nice -n 10``).
    The caller reads QEMU's host pid with :func:`read_child_pid` and closes the returned fd. Raises
    :class:`ConfinementError` (no QEMU binary, unreadable kernel), ``OSError`` (bwrap could not be executed,
    a VM file is a symlink).
    """
    binary = shutil.which(qemu_argv[0])
    if binary is None:
        raise ConfinementError(f"{qemu_argv[0]} not found")
    if not Path(binary).resolve().is_relative_to("/usr"):
        read_only = [*read_only, Path(binary)]  # e.g. a QEMU of its own in /opt (its libraries must be in /usr)
    qemu_argv = [binary, *qemu_argv[1:]]
    check_readable(read_only)
    own_vm_files(vm_dir, vm_dir / RUN_DIR, VM_WRITABLE_FILES, confinement.user)
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    try:
        argv = confine_argv(
            qemu_argv, user=confinement.user, vm_dir=vm_dir, read_only=read_only, info_fd=info_w, kvm=kvm,
            kvm_gid=kvm_group() if kvm else None, bwrap=confinement.bwrap, setpriv=confinement.setpriv,
            merged_usr=host_has_merged_usr(),
        )
        popen = subprocess.Popen(
            [*(prefix or []), *argv], stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, cwd="/",
            start_new_session=True, close_fds=True, pass_fds=(info_w, *pass_fds),
        )
    except BaseException:
        os.close(info_r)
        raise
    finally:
        os.close(info_w)
    return popen, info_r


def read_child_pid(fd: int, timeout_s: float) -> int:
    """QEMU's host pid from bwrap's ``--info-fd`` JSON (``child-pid``); blocking, bounded by ``timeout_s``.

    Raises :class:`ConfinementError` when bwrap closed the pipe without it (it failed to set up the sandbox:
    its message is in ``qemu.log``) or did not write it in time.
    """
    deadline = time.monotonic() + timeout_s
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfinementError(f"bwrap did not report the QEMU pid within {timeout_s} s")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        buf += chunk
        try:
            return int(json.loads(buf)["child-pid"])
        except (ValueError, KeyError, TypeError):
            if not chunk:
                raise ConfinementError("bwrap exited before starting QEMU") from None


async def start_confined(
    qemu_argv: list[str], confinement: Confinement, *, vm_dir: Path, read_only: list[Path], kvm: bool,
    log_path: Path, pidfile: Path, timeout_s: float, pass_fds: tuple[int, ...] = (),
    prefix: list[str] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``qemu_argv`` confined; returns bwrap's Popen and QEMU's host pid, also written to ``pidfile``.

    QEMU's stdout and stderr (and bwrap's) are appended to ``log_path``. With a uid pool
    (``confinement.uids``) QEMU runs as a uid of its own, recorded with its pid. Raises
    :class:`ConfinementError` or ``OSError``; on error nothing is left running.
    """
    pool = confinement.uids
    uid = await asyncio.to_thread(pool.take, vm_dir) if pool is not None else None
    if uid is not None:
        confinement = dataclasses.replace(confinement, user=VmmUser(f"{confinement.user.name}-{uid}", uid, uid))
    try:
        popen, pid = await _start_confined(qemu_argv, confinement, vm_dir=vm_dir, read_only=read_only, kvm=kvm,
                                           log_path=log_path, pidfile=pidfile, timeout_s=timeout_s,
                                           pass_fds=pass_fds, prefix=prefix)
    except BaseException:
        if pool is not None and uid is not None:
            await asyncio.to_thread(pool.release, uid)
        raise
    if pool is not None and uid is not None:
        await asyncio.to_thread(pool.bind, uid, pid, vm_dir)
    return popen, pid


async def _start_confined(
    qemu_argv: list[str], confinement: Confinement, *, vm_dir: Path, read_only: list[Path], kvm: bool,
    log_path: Path, pidfile: Path, timeout_s: float, pass_fds: tuple[int, ...], prefix: list[str] | None,
) -> tuple[subprocess.Popen[bytes], int]:
    def spawn() -> tuple[subprocess.Popen[bytes], int]:
        with open(log_path, "ab") as logf:
            return spawn_confined(qemu_argv, confinement, vm_dir=vm_dir, read_only=read_only, kvm=kvm,
                                  log_file=logf.fileno(), pass_fds=pass_fds, prefix=prefix)

    # On a worker thread: forking the node agent took 3-5 ms, during which its event loop (and a warm claim
    # waiting on it) stood still.
    popen, info_r = await asyncio.to_thread(spawn)
    try:
        pid = await asyncio.to_thread(read_child_pid, info_r, timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, signal.SIGKILL)
        await asyncio.to_thread(popen.wait)
        raise
    finally:
        os.close(info_r)
    # A crash here leaves QEMU running with no pidfile: cleanup finds it by its VM directory instead.
    fault_point("vm.spawned")
    # QEMU's own -pidfile would say 1 (its pid inside the namespace): attach and cleanup read this one.
    tmp = pidfile.with_name(pidfile.name + ".tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, pidfile)
    return popen, pid
