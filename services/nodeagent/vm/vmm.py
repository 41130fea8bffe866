"""The VMM driver: QEMU ``microvm`` guests driven through QMP (``qemu.qmp``).

A VM lives in one directory (:class:`VmPaths`): ``disk.img`` (raw, virtio-blk-device), ``ram`` (guest RAM as a
shared memory-backend-file, so a full snapshot is a tiny device-state file plus a reflink of this file),
``run/qmp.sock``, ``run/channel.sock`` (virtio-serial port ``org.podbay.channel``; in a subdirectory so that a
confined QEMU can create them without write access to the VM directory), ``run/console.sock`` (the serial
console, which the node agent reads into ``console.log``, capped and rotated: ``console.py``),
``qemu.pid`` (QEMU's host pid) and ``qemu.log`` (QEMU's own stderr), and ``vol0.img`` .. ``vol3.img``: the
:data:`VOLUME_SLOTS` volume slots (below). One virtio-net NIC (MAC
:data:`GUEST_MAC`) is backed by a tap the node agent opened and passes as ``tap_fd`` (QEMU needs no privilege),
or else by an empty hub (never slirp); the backend is not migrated state, so snapshots restore on either. QEMU runs in its own session so that it
outlives the node agent, which re-attaches with :meth:`Vmm.attach`. Machine and kernel command line follow
docs/DESIGN.md §3. Unless ``PODBAY_VMM_CONFINE=false``, QEMU runs unprivileged inside bubblewrap (``confine.py``):
the argv built here is wrapped, and the node agent writes ``qemu.pid`` from what bwrap reports.

Volume slots. The microvm machine has no hot-plug, and a sandbox is a restore of its template's snapshot,
whose device set must match the restoring QEMU's. So every guest has :data:`VOLUME_SLOTS` virtio-blk devices
(virtio-mmio, serial ``podbay-vol<N>``, after the root disk, so the root stays ``/dev/vda``), backed by
``vol<N>.img`` in the VM directory: an empty file (capacity 0) when unused; the node agent puts a hard link
to a volume's ext4 file there for a read-write attach, a reflink copy for a read-only one (so whatever the
guest does, the volume's file is unchanged; sandboxes.py). A virtio-blk device's capacity is not migrated state: after the
incoming migration the restore issues ``block_resize`` of every non-empty slot to its own size, which
raises the config-change interrupt, and the guest's driver reads the new capacity (checked by hand on QEMU
7.2 under TCG: "vdc: detected capacity change from 0 to 131072"). guestd then mounts each slot by serial.

:class:`Vmm` is the interface (tests use fakes); :class:`QemuVmm` is the implementation. Errors::

    VmmError(PodbayError)                vmm_error
    ├── VmStartError(Unavailable)        vm_start_failed   QEMU did not start or QMP never answered; retryable
    ├── VmTimeout(Timeout)               vm_timeout        an operation ran past its bound; retryable
    ├── VmGone(NotFound)                 vm_gone           the QEMU process is not running
    └── VmOperationError                 vm_operation_failed  QMP refused a command, migration failed, I/O
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterable, Awaitable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from prometheus_client import Counter, Histogram
from pydantic import BaseModel, Field
from podbay.config import DEFAULT_TCG_TB_SIZE_MIB
from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError, StateError

from podbay.errors import NotFound, PodbayError, Timeout, Unavailable
from podbay.reflink import reflink_or_copy
from . import cgroups, confine
from .console import ConsoleLimits, start_pump
from .accel import Accel, host_tsc_khz, kernel_cmdline

__all__ = [
    "VmmError", "VmStartError", "VmTimeout", "VmGone", "VmOperationError",
    "VmConfig", "VmPaths", "VmProcess", "SnapshotResult", "Vmm", "QemuVmm",
    "kernel_cmdline", "build_qemu_argv", "reflink_or_copy", "CHANNEL_PORT_NAME", "GUEST_MAC", "VOLUME_SLOTS",
    "volume_slot_name", "VOLUME_SERIAL_PREFIX", "SECCOMP",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
CHANNEL_PORT_NAME = "org.podbay.channel"
#: The guest NIC's MAC (locally administered). Migrated with the device state, so every restore keeps it.
GUEST_MAC = "52:54:00:00:00:02"
_QMP_CONNECT_TIMEOUT_S = 5.0
#: QEMU's built-in seccomp filter (``-sandbox``, QEMU built with libseccomp): ``obsolete`` (old system calls),
#: ``elevateprivileges`` (setuid and friends), ``spawn`` (fork, exec) and ``resourcecontrol`` (scheduler,
#: affinity, priority) denied, so a guest that takes over QEMU's device emulation cannot start a program, gain a
#: privilege or retune the host's scheduling. The node agent sets nice values of QEMU's threads from outside.
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: Volume slots every guest has (module docstring); part of the template's machine (template.MACHINE).
VOLUME_SLOTS = 4
#: Slot N's virtio-blk serial, which guestd finds in ``/sys/block/vd*/serial``.
VOLUME_SERIAL_PREFIX = "podbay-vol"


def volume_slot_name(slot: int) -> str:
    """The file of volume slot ``slot`` in a VM directory (``vol<N>.img``)."""
    return f"vol{slot}.img"


# ----------------------------------------------------------------------------------------------- errors


class VmmError(PodbayError):
    """Base of the VMM driver's errors."""

    code = "vmm_error"


class VmStartError(VmmError, Unavailable):
    code = "vm_start_failed"
    http_status = 503
    retryable = True


class VmTimeout(VmmError, Timeout):
    code = "vm_timeout"
    http_status = 504
    retryable = True


class VmGone(VmmError, NotFound):
    code = "vm_gone"
    http_status = 404


class VmOperationError(VmmError):
    code = "vm_operation_failed"


# ---------------------------------------------------------------------------------------------- metrics

BOOTS = Counter("podbay_vmm_boots", "Fresh QEMU boots.", ["accel", "outcome"])
RESTORES = Counter("podbay_vmm_restores", "Restores from a full snapshot.", ["accel", "outcome"])
RESTORE_RETRIES = Counter("podbay_vmm_restore_retries", "Restore attempts retried after a failure.")
TIMEOUTS = Counter("podbay_vmm_timeouts", "VMM operations that ran past their bound.", ["op"])
SNAPSHOTS = Counter("podbay_vmm_snapshots", "Full snapshots taken.", ["outcome", "copy_mode"])
BOOT_SECONDS = Histogram("podbay_vmm_boot_seconds", "QEMU start to QMP ready on a fresh boot.")
RESTORE_SECONDS = Histogram(
    "podbay_vmm_restore_seconds", "Restore start to guest running (or paused when asked).",
    buckets=(0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
SNAPSHOT_PAUSE_SECONDS = Histogram(
    "podbay_vmm_snapshot_pause_seconds", "Time a guest stays stopped for a full snapshot.",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
)

# ------------------------------------------------------------------------------------------------ model


class VmConfig(BaseModel):
    """How to run a guest. The same machine shape must be used to restore a snapshot as to take it."""

    kernel: Path
    initrd: Path
    memory_mib: int = Field(256, ge=16)
    vcpus: int = Field(1, ge=1, le=64)
    accel: Accel = "tcg"
    tsc_khz: int | None = Field(None, description="Host TSC in kHz; None reads it from the host.")
    tcg_tb_size_mib: int = Field(DEFAULT_TCG_TB_SIZE_MIB, ge=0, le=2048, description="TCG's translation "
                                 "buffer in MiB (``-accel tcg,tb-size=``); 0 = QEMU's default (1 GiB on 7.2, "
                                 "resident once a guest has run a while). Not used under KVM. Not part of the "
                                 "machine: a snapshot restores under any size.")
    extra_append: str = Field("", description="Appended to the kernel command line.")
    qemu_binary: str = "qemu-system-x86_64"
    boot_timeout_s: float = Field(90.0, description="Bound on QEMU start to QMP ready.")
    restore_timeout_s: float = Field(30.0, description="Bound on one restore attempt.")
    restore_retries: int = Field(2, ge=0)
    op_timeout_s: float = Field(10.0, description="Bound on a single QMP command.")
    snapshot_timeout_s: float = Field(60.0, description="Bound on a full snapshot.")
    seccomp: bool = Field(True, description="QEMU's own seccomp filter (:data:`SECCOMP`): no exec, fork, "
                          "setuid, scheduler or obsolete system calls. Not part of the machine.")
    nice: int = Field(0, ge=0, le=19, description="Nice value QEMU starts with (setpriority(2)); 0 keeps the "
                      "node agent's. Warm slots are prepared at a higher one, so their restores and first "
                      "steps yield the CPU to running sandboxes and to claims (:func:`set_nice`).")


@dataclass(frozen=True)
class VmPaths:
    """The files of one VM directory: ``disk``, ``ram``, ``qmp``, ``channel``, ``console_sock`` (all three in
    ``run``), ``console`` (the log the node agent writes from ``console_sock``), ``pidfile``, ``qemu_log``
    (QEMU's stdout and stderr)."""

    dir: Path
    run: Path = field(init=False)
    disk: Path = field(init=False)
    ram: Path = field(init=False)
    qmp: Path = field(init=False)
    channel: Path = field(init=False)
    console: Path = field(init=False)
    console_sock: Path = field(init=False)
    pidfile: Path = field(init=False)
    qemu_log: Path = field(init=False)

    def __post_init__(self) -> None:
        names = {"disk": "disk.img", "ram": "ram", "qmp": "run/qmp.sock", "channel": "run/channel.sock",
                 "console": "console.log",
                 "console_sock": "run/console.sock", "pidfile": "qemu.pid", "qemu_log": "qemu.log", "run": "run"}
        for attr, name in names.items():
            object.__setattr__(self, attr, self.dir / name)


class SnapshotResult(BaseModel):
    """A full snapshot on disk: ``state`` (device state, ~60 KB), ``ram`` and ``disk``."""

    dir: Path
    state: Path
    ram: Path
    disk: Path
    paused_ms: float = Field(description="Time the guest was stopped, in ms.")
    copy_mode: Literal["reflink", "copy"]


@dataclass(eq=False)
class VmProcess:
    """The VMM's handle on one running (or paused) QEMU process: its files, pid, config and QMP connection.
    Owned by one :class:`Vmm`, which every operation on it goes through; the node agent wraps it with its
    driver as ``vmdriver.VmHandle``. ``pid`` is QEMU's process id."""

    paths: VmPaths
    pid: int
    config: VmConfig | None
    qmp: QMPClient
    popen: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    _exited: asyncio.Event = field(default_factory=asyncio.Event)
    _pidfd: int | None = None
    _console: asyncio.Task[None] | None = None

    @property
    def dir(self) -> Path:
        return self.paths.dir


def _send_scm_rights(qmp: QMPClient, fd: int) -> None:
    """Send ``fd`` over the QMP socket with SCM_RIGHTS (what ``getfd`` expects, QMP reference "getfd").

    ``QMPClient.send_fd_scm`` reaches into the standard loop's private socket wrapper, which uvloop's
    transports do not have; a duplicate of the socket's descriptor works under both loops. The transport's
    buffer is empty between commands, so the byte cannot interleave with a command.
    """
    transport_sock = qmp._writer.transport.get_extra_info("socket")  # type: ignore[union-attr]  # noqa: SLF001  # qemu.qmp keeps its writer private; SCM_RIGHTS needs its socket (docstring)
    dup = socket.socket(fileno=os.dup(transport_sock.fileno()))
    try:
        dup.sendmsg([b" "], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("@i", fd))])
    finally:
        dup.close()  # closes only the duplicate descriptor


# ------------------------------------------------------------------------------------- command line
def _accel_arg(config: VmConfig) -> str:
    """``-accel``'s value: under TCG with the translation buffer bounded (``tb-size`` in MiB), since QEMU 7.2's
    1 GiB default fills as a guest runs and stays resident (a buffer that is full is flushed and refilled from
    its start, never returned); KVM translates nothing."""
    if config.accel == "tcg" and config.tcg_tb_size_mib:
        return f"tcg,tb-size={config.tcg_tb_size_mib}"
    return config.accel



def _volume_args(paths: VmPaths) -> list[str]:
    """The :data:`VOLUME_SLOTS` slot drives (module docstring)."""
    out: list[str] = []
    for slot in range(VOLUME_SLOTS):
        out += ["-drive", f"id=vol{slot},file={paths.dir / volume_slot_name(slot)},format=raw,if=none,"
                          "cache=writeback,discard=unmap",
                "-device", f"virtio-blk-device,drive=vol{slot},serial={VOLUME_SERIAL_PREFIX}{slot}"]
    return out


def build_qemu_argv(config: VmConfig, paths: VmPaths, *, incoming: bool = False, tsc_khz: int,
                    tap_fd: int | None = None, autostart: bool = False) -> list[str]:
    """QEMU's argv for ``config`` in ``paths``; ``incoming`` starts it paused, waiting for a migration stream.
    With ``autostart`` (live migration, ``migrate.py``) an incoming QEMU runs the guest as soon as the stream
    ends if the source was running (no ``-S``), so the node agent's ``cont`` is not part of the downtime.

    ``tap_fd`` is an open tap descriptor QEMU inherits (``pass_fds``) as the NIC's backend; None connects the
    NIC to an empty hub (no network at all). The tap is opened without ``IFF_VNET_HDR`` (QEMU takes vnet_hdr
    from the descriptor; ``vnet_hdr=`` is refused with ``fd=``): a device whose state was saved with the
    virtio-net header refuses to load on a backend without one ("saved image requires vnet_hdr=on"), so
    without it a snapshot restores on a tap or on the hub alike (the guest loses offloads, not correctness)."""
    netdev = (f"tap,id=net0,fd={tap_fd},vhost=off" if tap_fd is not None
              else "hubport,id=net0,hubid=0")
    mem = f"{config.memory_mib}M"
    argv = [
        config.qemu_binary,
        "-M", "microvm,pit=on,pic=on,rtc=on,memory-backend=mem",
        "-accel", _accel_arg(config),
        "-cpu", "host" if config.accel == "kvm" else "max",
        "-m", mem, "-smp", str(config.vcpus),
        "-object", f"memory-backend-file,id=mem,size={mem},mem-path={paths.ram},share=on",
        "-kernel", str(config.kernel), "-initrd", str(config.initrd),
        "-append", kernel_cmdline(tsc_khz, config.extra_append),
        "-nodefaults", "-no-user-config", "-nographic",
        # A guest reboot or panic (panic=-1) ends QEMU, so the node agent sees it instead of a silent reboot.
        "-no-reboot",
        # The serial console is read by the node agent into a capped log (console.py), never a file of QEMU's.
        "-chardev", f"socket,id=con0,path={paths.console_sock},server=on,wait=off", "-serial", "chardev:con0",
        "-drive", f"id=root,file={paths.disk},format=raw,if=none,cache=writeback,discard=unmap",
        "-device", "virtio-blk-device,drive=root",
        *_volume_args(paths),
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=ch0,path={paths.channel},server=on,wait=off",
        "-device", f"virtserialport,chardev=ch0,name={CHANNEL_PORT_NAME}",
        "-netdev", netdev, "-device", f"virtio-net-device,netdev=net0,mac={GUEST_MAC}",
        "-qmp", f"unix:{paths.qmp},server=on,wait=off",
        "-pidfile", str(paths.pidfile),
    ]
    if config.seccomp:
        argv += ["-sandbox", SECCOMP]
    if incoming:
        argv += (["-incoming", "defer"] if autostart else ["-S", "-incoming", "defer"])
    return argv


# ---------------------------------------------------------------------------------------------- interface


class Vmm(abc.ABC):
    """What the node agent needs from a VMM. Every call is bounded by a timeout."""

    @abc.abstractmethod
    async def boot(self, config: VmConfig, vm_dir: Path, *, tap_fd: int | None = None) -> VmProcess:
        """Fresh boot of kernel + initrd + ``vm_dir/disk.img``; returns once QMP answers (guest running).
        ``tap_fd``: the NIC's tap (see :func:`build_qemu_argv`); the caller keeps and closes its copy."""

    @abc.abstractmethod
    async def restore(self, snapshot_dir: Path, vm_dir: Path, config: VmConfig, *, paused: bool = False,
                      tap_fd: int | None = None) -> VmProcess:
        """Copy RAM and disk from ``snapshot_dir`` into ``vm_dir`` and resume the snapshot there."""

    @abc.abstractmethod
    async def snapshot_full(self, vm: VmProcess, dest_dir: Path, *, leave_stopped: bool = False) -> SnapshotResult:
        """Device state + RAM + disk into ``dest_dir``; the guest is stopped meanwhile."""

    @abc.abstractmethod
    async def attach(self, vm_dir: Path, config: VmConfig | None = None) -> VmProcess:
        """Re-attach to a QEMU left running by an earlier node agent; raises :class:`VmGone`."""

    @abc.abstractmethod
    async def pause(self, vm: VmProcess) -> None: ...

    @abc.abstractmethod
    async def resume(self, vm: VmProcess) -> None: ...

    @abc.abstractmethod
    async def stop(self, vm: VmProcess, timeout_s: float = 5.0) -> None:
        """Ask QEMU to quit (disks flushed); SIGKILL after ``timeout_s``."""

    @abc.abstractmethod
    async def kill(self, vm: VmProcess) -> None: ...

    @abc.abstractmethod
    def is_alive(self, vm: VmProcess) -> bool: ...

    @abc.abstractmethod
    async def wait_exit(self, vm: VmProcess, timeout_s: float | None = None) -> int | None:
        """Wait until QEMU exits; its exit code when it was our child, else None."""

    @abc.abstractmethod
    async def query_status(self, vm: VmProcess) -> str:
        """QEMU's run state: ``running``, ``paused``, ``postmigrate``, ``inmigrate``, ``shutdown``, ..."""

    @abc.abstractmethod
    async def start_incoming(self, config: VmConfig, paths: VmPaths, *, tap_fd: int | None = None) -> VmProcess:
        """Start a guest that waits for a live migration stream on ``paths`` (vmmigrate.py)."""

    @abc.abstractmethod
    async def execute(self, vm: VmProcess, cmd: str, args: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> Any:
        """Run one QMP command on ``vm``, bounded; returns its answer."""

    @abc.abstractmethod
    async def give_fd(self, vm: VmProcess, fd: int, name: str) -> None:
        """Hand the open descriptor ``fd`` to QEMU as monitor fd ``name`` (QMP ``getfd``); the caller keeps
        and closes its own copy."""

    @abc.abstractmethod
    def events(self, vm: VmProcess, *names: str) -> AbstractContextManager[AsyncIterable[Mapping[str, Any]]]:
        """A listener for QMP events ``names`` of ``vm``: enter it before the command that causes them (so none
        is missed), then iterate it for the events (each with ``event`` and ``data``)."""

    @abc.abstractmethod
    async def detach(self, vm: VmProcess) -> None:
        """Drop the connection to ``vm`` and leave QEMU running (a later :meth:`attach` picks it up)."""

    @abc.abstractmethod
    async def set_nice(self, vm: VmProcess, nice: int) -> None:
        """Give every thread of ``vm``'s process the nice value ``nice`` (:func:`set_nice`)."""


def set_nice(pid: int, nice: int) -> int:
    """Set the nice value of every thread of process ``pid`` (Linux keeps one per thread: setpriority(2)
    with PRIO_PROCESS and a thread id; threads QEMU starts later inherit their creator's). Returns the number
    of threads changed; a thread that exits meanwhile is skipped. Raises ``ProcessLookupError`` when ``pid``
    is gone, ``PermissionError`` when lowering it without CAP_SYS_NICE."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    done = 0
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            done += 1
        except ProcessLookupError:
            continue
    return done


# ----------------------------------------------------------------------------------------- QEMU driver


_FROM_SETTINGS: Any = object()


class QemuVmm(Vmm):
    """The QEMU implementation of :class:`Vmm`. ``confinement``: None runs QEMU unconfined; by default it is
    read from the settings (``PODBAY_VMM_CONFINE``, ``PODBAY_VMM_USER``) at the first start."""

    def __init__(self, *, tsc_khz: int | None = None, confinement: confine.Confinement | None = _FROM_SETTINGS,
                 console_limits: ConsoleLimits | None = None,
                 vm_cgroups: tuple[cgroups.VmCgroups, dict[str, Any]] | None = None) -> None:
        self._tsc_khz = tsc_khz
        self._confinement = confinement
        self._console_limits = console_limits
        self._cgroups = vm_cgroups
        self._reaping: set[asyncio.Task[None]] = set()

    def console_limits(self) -> ConsoleLimits:
        """The console log's cap and rate (``PODBAY_CONSOLE_LOG_MAX_KIB``, ``PODBAY_CONSOLE_LOG_RATE_KIB_S``)."""
        if self._console_limits is None:
            from podbay.config import get_settings

            s = get_settings()
            self._console_limits = ConsoleLimits(s.console_log_max_kib * 1024, s.console_log_rate_kib_s * 1024)
        return self._console_limits

    def cgroups(self) -> tuple[cgroups.VmCgroups, dict[str, Any]]:
        """The node's QEMU cgroups and the settings' part of their limits (``cgroups.from_settings``), set up
        (and emptied of leftovers) at first use."""
        if self._cgroups is None:
            from podbay.config import get_settings

            self._cgroups = cgroups.from_settings(get_settings())
        self._cgroups[0].setup()
        return self._cgroups

    def _place(self, config: VmConfig, paths: VmPaths, pid: int) -> None:
        """Move QEMU ``pid`` into a cgroup of its own with the limits of ``config`` (cgroups.py; best effort)."""
        slice_, params = self.cgroups()
        tb_mib = (config.tcg_tb_size_mib or 1024) if config.accel == "tcg" else 0  # 0: QEMU 7.2's 1 GiB
        io_device = cgroups.block_device(paths.dir) if params.get("io_max") else None
        values = cgroups.cgroup_values(vcpus=config.vcpus, memory_mib=config.memory_mib, tb_mib=tb_mib,
                                       io_device=io_device, **params)
        slice_.place(cgroups.cgroup_name(paths.dir, pid), pid, values)

    def confinement(self) -> confine.Confinement | None:
        """The confinement in force (resolved from the settings once); raises ``confine.ConfinementError``."""
        if self._confinement is _FROM_SETTINGS:
            from podbay.config import get_settings

            self._confinement = confine.from_settings(get_settings())
        return self._confinement

    # -- helpers

    def _tsc(self, config: VmConfig) -> int:
        return config.tsc_khz or self._tsc_khz or host_tsc_khz()

    async def _bounded(self, op: str, aw: Awaitable[T], timeout_s: float) -> T:
        try:
            return await asyncio.wait_for(aw, timeout_s)
        except TimeoutError as exc:
            TIMEOUTS.labels(op).inc()
            raise VmTimeout(f"{op} did not finish within {timeout_s} s", details={"op": op}) from exc

    async def execute(self, vm: VmProcess, cmd: str, args: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> Any:
        """Run QMP command ``cmd`` on ``vm`` and return its answer, bounded by ``timeout_s`` (default: the VM's
        ``op_timeout_s``). Raises ``VmTimeout``, ``VmOperationError`` (QEMU refused it: ``details.qmp_class``)
        or ``VmGone`` (QEMU exited)."""
        try:
            return await self._bounded(
                f"qmp:{cmd}", vm.qmp.execute(cmd, args),
                timeout_s or (vm.config.op_timeout_s if vm.config else 10.0),
            )
        except ExecuteError as exc:
            # str(ExecuteError) is QEMU's "desc"; the class (e.g. GenericError) is a QMP error class name.
            raise VmOperationError(f"QMP {cmd} failed: {exc}",
                                   details={"cmd": cmd, "qmp_class": exc.error_class}) from exc
        except (StateError, QMPError, EOFError, OSError) as exc:
            if not self.is_alive(vm):
                raise VmGone(f"QEMU {vm.pid} of {vm.dir.name} is gone ({cmd})", details={"vm": vm.dir.name}) from exc
            raise VmOperationError(f"QMP {cmd}: {exc!r}", details={"cmd": cmd}) from exc

    async def _spawn(self, config: VmConfig, paths: VmPaths, *, incoming: bool,
                     tap_fd: int | None = None, autostart: bool = False) -> tuple[subprocess.Popen[bytes], int]:
        """Start QEMU, confined unless turned off; returns its Popen (bwrap's when confined) and QEMU's pid.
        ``tap_fd`` (the sandbox's tap, opened by the node agent) is inherited by QEMU."""
        paths.dir.mkdir(parents=True, exist_ok=True)
        paths.run.mkdir(exist_ok=True)
        for p in (paths.qmp, paths.channel, paths.console_sock, paths.pidfile):
            p.unlink(missing_ok=True)
        for slot in range(VOLUME_SLOTS):  # an unused slot is an empty file (capacity 0)
            open(paths.dir / volume_slot_name(slot), "ab").close()
        argv = build_qemu_argv(config, paths, incoming=incoming, tsc_khz=self._tsc(config), tap_fd=tap_fd,
                               autostart=autostart)
        popen, pid = await self._start(config, paths, argv, tap_fd)
        await asyncio.to_thread(self._place, config, paths, pid)
        return popen, pid

    async def _start(self, config: VmConfig, paths: VmPaths, argv: list[str],
                     tap_fd: int | None) -> tuple[subprocess.Popen[bytes], int]:
        # Through nice(1) rather than a preexec function (not safe with the agent's threads); it execs, so
        # the pid stays the one bwrap (or QEMU) gets.
        prefix = ["nice", "-n", str(config.nice)] if config.nice else []
        fds = (tap_fd,) if tap_fd is not None else ()
        try:
            if (conf := self.confinement()) is not None:
                return await confine.start_confined(
                    argv, conf, vm_dir=paths.dir.absolute(), kvm=config.accel == "kvm", log_path=paths.qemu_log,
                    read_only=[config.kernel.absolute(), config.initrd.absolute()], pidfile=paths.pidfile,
                    timeout_s=_QMP_CONNECT_TIMEOUT_S, pass_fds=fds, prefix=prefix,
                )
            log.debug("starting %s", shlex.join(argv))
            with open(paths.qemu_log, "ab") as logf:
                popen = subprocess.Popen(
                    [*prefix, *argv], stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, cwd=paths.dir,
                    start_new_session=True, close_fds=True, pass_fds=(tap_fd,) if tap_fd is not None else (),
                )
            return popen, popen.pid
        except (OSError, confine.ConfinementError) as exc:
            raise VmStartError(f"cannot start {config.qemu_binary}: {exc} {self._qemu_log_tail(paths)}",
                               details={"vm_dir": str(paths.dir)}) from exc

    def _lock(self, paths: VmPaths) -> None:
        """Once QMP answers, a confined QEMU's socket directory goes back to root (``confine.lock_run_dir``)."""
        if self.confinement() is not None:
            try:
                confine.lock_run_dir(paths.run, (paths.qmp, paths.channel, paths.console_sock))
            except (OSError, confine.ConfinementError) as exc:
                raise VmStartError(f"QEMU's socket directory: {exc}", details={"vm_dir": str(paths.dir)}) from exc

    def _qemu_log_tail(self, paths: VmPaths) -> str:
        try:
            return paths.qemu_log.read_text(errors="replace").strip()[-500:]
        except OSError:
            return ""

    async def _connect(self, paths: VmPaths, pid: int, popen: subprocess.Popen[bytes] | None,
                       config: VmConfig | None, timeout_s: float) -> VmProcess:
        """Connect QMP (retrying until the socket exists) and start watching the process."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        qmp = QMPClient(f"vm-{paths.dir.name}")
        while True:
            if popen is not None and popen.poll() is not None:
                raise VmStartError(
                    f"QEMU exited with {popen.returncode} at start: {self._qemu_log_tail(paths)}",
                    details={"vm_dir": str(paths.dir)},
                )
            try:
                # Not before the socket exists: every failed connect makes qemu.qmp format and log a traceback
                # (~3 ms on the event loop, which a warm claim may be waiting on).
                if not paths.qmp.exists():
                    raise FileNotFoundError(f"{paths.qmp} does not exist yet")
                await asyncio.wait_for(qmp.connect(str(paths.qmp)), max(0.05, deadline - loop.time()))
                break
            except (ConnectError, OSError, TimeoutError) as exc:
                if loop.time() >= deadline:
                    TIMEOUTS.labels("qmp_connect").inc()
                    raise VmStartError(
                        f"QMP did not answer within {timeout_s} s: {exc!r} {self._qemu_log_tail(paths)}",
                        details={"vm_dir": str(paths.dir)},
                    ) from exc
                await asyncio.sleep(0.005)
        vm = VmProcess(paths=paths, pid=pid, config=config, qmp=qmp, popen=popen)
        self._watch(vm)
        vm._console = start_pump(paths.console_sock, paths.console, self.console_limits())
        return vm

    def _watch(self, vm: VmProcess) -> None:
        """Notice QEMU's exit through a pidfd, even when QEMU is not our child."""
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(vm.pid)
        except ProcessLookupError:
            self._on_exit(vm)
            return
        vm._pidfd = fd

        def ready() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            vm._pidfd = None
            self._on_exit(vm)

        loop.add_reader(fd, ready)

    def _on_exit(self, vm: VmProcess) -> None:
        """QEMU exited. Confined, ``popen`` is bwrap, which exits a moment after QEMU: it is reaped on a worker
        thread (a blocking ``wait`` here held the event loop for milliseconds, up to 1 s) before ``_exited``
        is set, so the exit code is known by then."""
        if vm.popen is not None and vm.popen.poll() is None:
            task = asyncio.get_running_loop().create_task(self._reap(vm))
            self._reaping.add(task)
            task.add_done_callback(self._reaping.discard)
            return
        self._exit_done(vm)

    async def _reap(self, vm: VmProcess) -> None:
        assert vm.popen is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(vm.popen.wait, 1)
        self._exit_done(vm)

    def _exit_done(self, vm: VmProcess) -> None:
        # The console pump sees EOF by itself; cancelling also covers a QEMU that exits before accepting it.
        if vm._console is not None:
            vm._console.cancel()
        if self._cgroups is not None:
            self._cgroups[0].remove(cgroups.cgroup_name(vm.paths.dir, vm.pid))
        if vm.popen is not None:
            vm.exit_code = vm.popen.returncode
            if vm.popen.pid != vm.pid and vm.exit_code is not None and vm.exit_code > 128:
                vm.exit_code = 128 - vm.exit_code  # bwrap reports QEMU's death by signal N as 128 + N
        # Confined, the node agent wrote qemu.pid (QEMU's -pidfile would say 1), so it removes it as QEMU would.
        with contextlib.suppress(OSError, ValueError):
            if int(vm.paths.pidfile.read_text().strip()) == vm.pid:
                vm.paths.pidfile.unlink()
        vm._exited.set()

    async def _close_qmp(self, vm: VmProcess) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(vm.qmp.disconnect(), 2.0)

    async def _abort_start(self, vm: VmProcess | None, popen: subprocess.Popen[bytes], pid: int) -> None:
        if vm is not None:
            await self.kill(vm)
            return
        # Confined, ``pid`` is QEMU and ``popen`` bwrap, which does not take QEMU down with it.
        for p in {pid, popen.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        await asyncio.to_thread(popen.wait)

    async def start_incoming(self, config: VmConfig, paths: VmPaths, *, tap_fd: int | None = None) -> VmProcess:
        """Start a QEMU on ``paths`` (its disk and RAM files made by the caller) that waits for a live migration
        (``-incoming defer``) and runs the guest on arrival; the caller feeds it the stream
        (services/nodeagent/vm/vmmigrate.py). Raises ``VmStartError``; nothing is left running."""
        popen, pid = await self._spawn(config, paths, incoming=True, tap_fd=tap_fd, autostart=True)
        vm: VmProcess | None = None
        try:
            vm = await self._connect(paths, pid, popen, config, 5.0)
            self._lock(paths)
            return vm
        except BaseException:
            await self._abort_start(vm, popen, pid)
            raise

    async def _migration_done(self, vm: VmProcess, what: str) -> None:
        """Poll ``query-migrate`` until completed; raise on failure."""
        while True:
            info = await self.execute(vm, "query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise VmOperationError(f"{what} migration {status}: {info.get('error-desc', '')}")
            await asyncio.sleep(0.001)

    async def give_fd(self, vm: VmProcess, fd: int, name: str) -> None:
        """``getfd`` with SCM_RIGHTS (:func:`_send_scm_rights`). Raises as :meth:`execute`."""
        _send_scm_rights(vm.qmp, fd)
        await self.execute(vm, "getfd", {"fdname": name})

    def events(self, vm: VmProcess, *names: str) -> AbstractContextManager[AsyncIterable[Mapping[str, Any]]]:
        """``qemu.qmp``'s event listener for ``names`` (a QMP message is a mapping)."""
        return vm.qmp.listener(names)

    async def detach(self, vm: VmProcess) -> None:
        """Close the QMP connection, bounded by 2 s; QEMU keeps running. An already closed connection is fine.
        The console pump stops too (QEMU drops console output until the next :meth:`attach`)."""
        if vm._console is not None:
            vm._console.cancel()
        try:
            await asyncio.wait_for(vm.qmp.disconnect(), 2.0)
        except Exception:  # already gone: nothing to release
            pass

    async def _send_fd(self, vm: VmProcess, path: Path, flags: int, name: str) -> None:
        """Hand QEMU an open file as monitor fd ``name`` (``getfd`` with SCM_RIGHTS)."""
        fd = os.open(path, flags, 0o600)
        try:
            await self.give_fd(vm, fd, name)
        finally:
            os.close(fd)

    # -- operations

    async def boot(self, config: VmConfig, vm_dir: Path, *, tap_fd: int | None = None) -> VmProcess:
        paths = VmPaths(vm_dir)
        if not paths.disk.exists():
            raise VmStartError(f"no disk image at {paths.disk}")
        paths.ram.unlink(missing_ok=True)  # a fresh boot starts from sparse RAM
        t0 = time.monotonic()
        popen, pid = await self._spawn(config, paths, incoming=False, tap_fd=tap_fd)
        vm: VmProcess | None = None
        try:
            vm = await self._connect(paths, pid, popen, config, min(config.boot_timeout_s, 30.0))
            self._lock(paths)
            await self._set_caps(vm)
        except BaseException:
            BOOTS.labels(config.accel, "failed").inc()
            await self._abort_start(vm, popen, pid)
            raise
        BOOTS.labels(config.accel, "ok").inc()
        BOOT_SECONDS.observe(time.monotonic() - t0)
        return vm

    async def _set_caps(self, vm: VmProcess) -> None:
        # RAM lives in a shared file that snapshots reflink, so migration streams only device state.
        await self.execute(vm, "migrate-set-capabilities",
                        {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})

    async def restore(self, snapshot_dir: Path, vm_dir: Path, config: VmConfig, *, paused: bool = False,
                      tap_fd: int | None = None) -> VmProcess:
        """Restore ``snapshot_dir`` (``state``, ``ram``, ``disk.img``) into ``vm_dir``.

        Each attempt is bounded by ``config.restore_timeout_s``; up to ``config.restore_retries`` retries. With
        ``paused`` the guest is left stopped (``cont`` it with :meth:`resume`). docs/DESIGN.md §3: ~65 ms to
        running under TCG. Raises :class:`VmStartError`, :class:`VmTimeout`, :class:`VmOperationError`.
        """
        state = snapshot_dir / "state"
        if not state.exists():
            raise VmStartError(f"no snapshot state at {state}")
        t0 = time.monotonic()
        last: Exception | None = None
        for attempt in range(config.restore_retries + 1):
            if attempt:
                RESTORE_RETRIES.inc()
            try:
                vm = await self._bounded(
                    "restore", self._restore_once(snapshot_dir, VmPaths(vm_dir), config, paused, tap_fd),
                    config.restore_timeout_s,
                )
            except (VmmError, OSError) as exc:
                last = exc
                log.warning("restore attempt %d of %s failed: %s", attempt + 1, vm_dir, exc)
                continue
            RESTORES.labels(config.accel, "ok").inc()
            RESTORE_SECONDS.observe(time.monotonic() - t0)
            return vm
        RESTORES.labels(config.accel, "failed").inc()
        if isinstance(last, VmmError):
            raise last
        raise VmStartError(f"restore of {snapshot_dir} failed: {last}") from last

    async def _restore_once(self, snap: Path, paths: VmPaths, config: VmConfig, paused: bool,
                            tap_fd: int | None) -> VmProcess:
        paths.dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(reflink_or_copy, snap / "ram", paths.ram)
        await asyncio.to_thread(reflink_or_copy, snap / "disk.img", paths.disk)
        popen, pid = await self._spawn(config, paths, incoming=True, tap_fd=tap_fd)
        vm: VmProcess | None = None
        try:
            vm = await self._connect(paths, pid, popen, config, _QMP_CONNECT_TIMEOUT_S)
            self._lock(paths)
            await self._set_caps(vm)
            await self._send_fd(vm, snap / "state", os.O_RDONLY | os.O_CLOEXEC, "migin")
            await self.execute(vm, "migrate-incoming", {"uri": "fd:migin"})
            await self._migration_done(vm, "incoming")
            await self._announce_volumes(vm, paths)
            if not paused:
                await self.execute(vm, "cont")
            return vm
        except BaseException:
            await self._abort_start(vm, popen, pid)
            raise

    async def _announce_volumes(self, vm: VmProcess, paths: VmPaths) -> None:
        """``block_resize`` each attached (non-empty) slot to its own size: the capacity the guest saw when the
        snapshot was taken is stale, and a resize raises the config-change interrupt (module docstring)."""
        for slot in range(VOLUME_SLOTS):
            size = (paths.dir / volume_slot_name(slot)).stat().st_size
            if size:
                await self.execute(vm, "block_resize", {"device": f"vol{slot}", "size": size})

    async def snapshot_full(self, vm: VmProcess, dest_dir: Path, *, leave_stopped: bool = False) -> SnapshotResult:
        """Stop, migrate device state to ``dest_dir/state``, reflink (or copy) RAM and disk, then ``cont``.

        ``paused_ms`` is the time from ``stop`` to ``cont`` (or to the end when ``leave_stopped``). A guest that
        was paused before stays paused. Raises :class:`VmOperationError`, :class:`VmTimeout`, :class:`VmGone`.
        """
        timeout = vm.config.snapshot_timeout_s if vm.config else 60.0
        try:
            return await self._bounded("snapshot", self._snapshot(vm, dest_dir, leave_stopped), timeout)
        except BaseException:
            SNAPSHOTS.labels("failed", "none").inc()
            raise

    async def _snapshot(self, vm: VmProcess, dest: Path, leave_stopped: bool) -> SnapshotResult:
        dest.mkdir(parents=True, exist_ok=True)
        status = await self.query_status(vm)
        was_running = status == "running"
        if status == "postmigrate":
            # A stopped guest snapshotted before (or whose suspend failed after its snapshot) is left by QEMU
            # in ``postmigrate``, from which QEMU refuses another migration ("Can't migrate the vm that was
            # paused due to previous migration") and which ``stop`` does not leave: only ``cont`` does. So
            # the guest runs for the two QMP round trips (about a millisecond) before it is stopped again.
            await self.execute(vm, "cont")
            await self.execute(vm, "stop")
        # The state file is handed to QEMU before ``stop``: one QMP round trip fewer while the guest is held.
        tmp_state = dest / "state.part"
        await self._send_fd(vm, tmp_state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, "migout")
        # Attached volumes, known now: what a fork child's own view or copy of a volume starts from
        # (services/nodeagent/storage/volumes.py), copied below as they are at this moment, matching the memory.
        volumes = [vm.paths.dir / volume_slot_name(slot) for slot in range(VOLUME_SLOTS)]
        volumes = [src for src in volumes if src.exists() and src.stat().st_size > 0]
        t0 = time.monotonic()
        await self.execute(vm, "stop")
        resumed = False
        try:
            # RAM, disk and volumes are reflinked at once, each on a worker thread, while QEMU writes the
            # device state: none depends on another, and each only needs the guest stopped.
            copies = asyncio.gather(
                asyncio.to_thread(reflink_or_copy, vm.paths.ram, dest / "ram"),
                asyncio.to_thread(reflink_or_copy, vm.paths.disk, dest / "disk.img"),
                *(asyncio.to_thread(reflink_or_copy, src, dest / src.name) for src in volumes),
                return_exceptions=True)
            try:
                await self.execute(vm, "migrate", {"uri": "fd:migout"})
                await self._migration_done(vm, "outgoing")
            finally:
                done = await copies  # every copy has ended before the guest runs again or an error leaves
            for result in done:
                if isinstance(result, BaseException):
                    raise result
            ram_mode, disk_mode = done[0], done[1]
            os.replace(tmp_state, dest / "state")
            if was_running and not leave_stopped:
                await self.execute(vm, "cont")
                resumed = True
        finally:
            if was_running and not leave_stopped and not resumed and self.is_alive(vm):
                with contextlib.suppress(VmmError):
                    await self.execute(vm, "cont")
        paused_ms = (time.monotonic() - t0) * 1000
        mode: Literal["reflink", "copy"] = "reflink" if ram_mode == disk_mode == "reflink" else "copy"
        SNAPSHOTS.labels("ok", mode).inc()
        SNAPSHOT_PAUSE_SECONDS.observe(paused_ms / 1000)
        return SnapshotResult(dir=dest, state=dest / "state", ram=dest / "ram", disk=dest / "disk.img",
                              paused_ms=paused_ms, copy_mode=mode)

    async def attach(self, vm_dir: Path, config: VmConfig | None = None) -> VmProcess:
        paths = VmPaths(vm_dir)
        try:
            pid = int(paths.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError) as exc:
            # Named by the VM directory's name (the sandbox's id), not its path: the message reaches API clients
            # (a sandbox's failure_reason), which have no business with the node's paths.
            raise VmGone(f"no running QEMU for {vm_dir.name}", details={"vm": vm_dir.name}) from exc
        # The pid may have been reused by an unrelated process after QEMU died.
        if str(paths.qmp).encode() not in cmdline:
            raise VmGone(f"pid {pid} is not the QEMU of {vm_dir.name}", details={"vm": vm_dir.name})
        await asyncio.to_thread(self.cgroups)  # it stays in its cgroup; leftovers of exited ones go
        return await self._connect(paths, pid, None, config, _QMP_CONNECT_TIMEOUT_S)

    async def pause(self, vm: VmProcess) -> None:
        await self.execute(vm, "stop")

    async def resume(self, vm: VmProcess) -> None:
        await self.execute(vm, "cont")

    async def set_nice(self, vm: VmProcess, nice: int) -> None:
        """Give every thread of ``vm``'s QEMU the nice value ``nice`` (:func:`set_nice`)."""
        await asyncio.to_thread(set_nice, vm.pid, nice)

    async def stop(self, vm: VmProcess, timeout_s: float = 5.0) -> None:
        if self.is_alive(vm):
            with contextlib.suppress(VmmError):
                await self.execute(vm, "quit", timeout_s=timeout_s)
            try:
                await self.wait_exit(vm, timeout_s)
            except VmTimeout:
                await self.kill(vm)
        await self._close_qmp(vm)

    async def kill(self, vm: VmProcess) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(vm.pid, signal.SIGKILL)
        await self.wait_exit(vm, 10.0)
        await self._close_qmp(vm)

    def is_alive(self, vm: VmProcess) -> bool:
        if vm._exited.is_set():
            return False
        if vm.popen is not None:
            return vm.popen.poll() is None
        try:
            os.kill(vm.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    async def wait_exit(self, vm: VmProcess, timeout_s: float | None = None) -> int | None:
        if timeout_s is None:
            await vm._exited.wait()
        else:
            await self._bounded("wait_exit", vm._exited.wait(), timeout_s)
        return vm.exit_code

    async def query_status(self, vm: VmProcess) -> str:
        info = await self.execute(vm, "query-status")
        return str(info["status"])

