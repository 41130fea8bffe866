"""Per-sandbox CPU, memory, pids and IO bounds: each QEMU in a cgroup v2 of its own under ``podbay.slice``.

A guest is untrusted and so is the QEMU that emulates it; without a bound one sandbox can take every core, the
host's memory or its pid space. The node agent (root) moves each QEMU, as soon as its pid is known, into
``<CGROUP_ROOT>/podbay.slice/<vm dir name>-<pid>`` (the pid makes two VMs of one directory name, e.g. a live
migration's source and destination or two tests' ``vm``, never share one) with, from the sandbox's size
(:func:`cgroup_values`):

- ``cpu.max`` = vCPUs x 100 % of a core + ``PODBAY_VMM_CPU_HEADROOM_PERCENT`` (50 %) for QEMU's own threads
  (I/O, migration), per 100 ms period; ``cpu.weight`` = 100 per vCPU (at most 10000).
- ``memory.max`` = guest RAM + TCG's translation buffer (0 under KVM) + ``PODBAY_VMM_MEMORY_OVERHEAD_MIB``
  (256). Guest RAM is a shared mapping of the VM directory's ``ram`` file, i.e. page cache charged to the
  cgroup that touches it: at the limit the kernel reclaims (writes back) RAM and disk-cache pages instead of
  killing; only QEMU's anonymous memory must fit. Measured here on a 256 MiB TCG guest (in a memory cgroup,
  with the guest touching all its RAM, running python and writing 64 MiB to disk): 345 MiB resident at the
  most, of which 239 MiB file pages (its RAM) and 106 MiB anonymous (QEMU's heap ~40 MiB, the 64 MiB
  translation buffer); the cgroup's usage peaked at 251 MiB (charges made before the move stay behind).
  The limit for that guest, 576 MiB, is 1.7x what it used.
- ``pids.max`` = ``PODBAY_VMM_PIDS_MAX`` (128; QEMU runs ~10 threads).
- ``io.weight`` = 100 and, when ``PODBAY_VMM_IO_MAX`` is set, ``io.max`` on the block device holding the
  VM directory.

Degrades, never fails: without cgroup v2 at ``PODBAY_CGROUP_ROOT`` (no ``cgroup.controllers``; a cgroup v1
or hybrid host), or without one of the controllers, or when a value is refused, that part is skipped and
logged once per node agent, and the VM runs unbounded there. A QEMU's cgroup is removed when it exits; when
the VMM driver first uses the slice (the node agent's first start or re-attach of a QEMU) it removes every
empty one left there (QEMUs that exited while no agent ran); a re-attached QEMU stays in its own.
``PODBAY_VMM_CGROUPS=false`` turns it all off.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from pathlib import Path

from podbay.config import Settings

__all__ = ["SLICE", "CONTROLLERS", "cgroup_values", "cgroup_name", "block_device", "VmCgroups", "from_settings"]

log = logging.getLogger(__name__)

SLICE = "podbay.slice"
#: The controllers podbay sets limits with, and the files of each it writes.
CONTROLLERS = ("cpu", "memory", "pids", "io")
_PERIOD_US = 100_000
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def cgroup_values(*, vcpus: int, memory_mib: int, tb_mib: int, cpu_headroom_percent: int, memory_overhead_mib: int,
                  pids_max: int, io_max: str = "", io_device: str | None = None) -> dict[str, str]:
    """The files of a QEMU's cgroup and their values (module docstring). ``tb_mib``: the TCG translation buffer
    (0 under KVM); ``io_device``: ``MAJOR:MINOR`` of the VM directory's block device, for ``io.max``."""
    quota = vcpus * _PERIOD_US * (100 + cpu_headroom_percent) // 100
    values = {
        "cpu.max": f"{quota} {_PERIOD_US}",
        "cpu.weight": str(min(10000, 100 * vcpus)),
        "memory.max": str((memory_mib + tb_mib + memory_overhead_mib) * 1024 * 1024),
        "pids.max": str(pids_max),
        "io.weight": "default 100",
    }
    if io_max.strip() and io_device:
        values["io.max"] = f"{io_device} {io_max.strip()}"
    return values


def cgroup_name(vm_dir: Path, pid: int) -> str:
    """The cgroup of QEMU ``pid`` of ``vm_dir``: ``<dir name>-<pid>``, safe as one path component."""
    return f"{_NAME_UNSAFE.sub('_', vm_dir.name)[:200]}-{pid}"


def block_device(path: Path) -> str | None:
    """``MAJOR:MINOR`` of the block device holding ``path``, when it is one (not btrfs's anonymous devices)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    major, minor = os.major(dev), os.minor(dev)
    return f"{major}:{minor}" if major != 0 and Path(f"/sys/dev/block/{major}:{minor}").exists() else None


class VmCgroups:
    """The node's ``podbay.slice`` under ``root`` (a cgroup v2 mount). :meth:`place` moves a QEMU into a cgroup
    of its own with limits, :meth:`remove` drops it, :meth:`reap` drops every empty one. Every method is
    best effort: it logs (once per kind of failure) and returns; nothing raises."""

    def __init__(self, root: Path, *, enabled: bool = True) -> None:
        self.root = root
        self.slice = root / SLICE
        self.enabled = enabled
        self._ready: bool | None = None
        self._controllers: frozenset[str] = frozenset()
        self._warned: set[str] = set()

    def _once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    @property
    def controllers(self) -> frozenset[str]:
        """The controllers enabled for the slice's children (after :meth:`setup`)."""
        self.setup()
        return self._controllers

    def setup(self) -> bool:
        """Create the slice and enable what it can of :data:`CONTROLLERS` for it; whether cgroup v2 is usable.
        Done once."""
        if self._ready is not None:
            return self._ready
        self._ready = False
        if not self.enabled:
            return False
        if not (self.root / "cgroup.controllers").exists():
            self._once("v2", "no cgroup v2 at %s: QEMUs run without CPU, memory, pids or IO limits", self.root)
            return False
        try:
            self.slice.mkdir(exist_ok=True)
        except OSError as exc:
            self._once("slice", "cannot create %s (%s): QEMUs run without cgroup limits", self.slice, exc)
            return False
        available = set((self.root / "cgroup.controllers").read_text().split())
        enabled: set[str] = set()
        for ctl in CONTROLLERS:
            if ctl not in available:
                continue
            try:
                for parent in (self.root, self.slice):
                    (parent / "cgroup.subtree_control").write_text(f"+{ctl}")
                enabled.add(ctl)
            except OSError as exc:
                self._once(f"enable-{ctl}", "cgroup controller %s cannot be enabled under %s: %s", ctl,
                           self.slice, exc)
        if missing := [c for c in CONTROLLERS if c not in enabled]:
            self._once("missing", "cgroup v2 at %s lacks controller(s) %s: those limits are skipped", self.root,
                       ", ".join(missing))
        self._controllers = frozenset(enabled)
        self._ready = True
        if gone := self.reap():
            log.info("removed %d empty QEMU cgroup(s) left under %s", len(gone), self.slice)
        return True

    def place(self, name: str, pid: int, values: dict[str, str]) -> Path | None:
        """Create cgroup ``name`` in the slice, write the ``values`` whose controller is enabled, then move
        ``pid`` (all its threads) into it. Returns the cgroup's path, or None when it could not be made."""
        if not self.setup():
            return None
        cg = self.slice / name
        try:
            cg.mkdir(exist_ok=True)
        except OSError as exc:
            self._once("mkdir", "cannot create cgroup %s: %s", cg, exc)
            return None
        for file, value in values.items():
            if file.split(".", 1)[0] not in self._controllers:
                continue
            try:
                (cg / file).write_text(value)
            except OSError as exc:
                self._once(f"write-{file}", "cgroup %s: %s = %r refused (%s); that limit is skipped", cg.name,
                           file, value, exc)
        try:
            (cg / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            self._once("procs", "cannot move QEMU %d into cgroup %s: %s", pid, cg, exc)
            self.remove(name)
            return None
        return cg

    def remove(self, name: str) -> None:
        """Remove cgroup ``name`` (its QEMU has exited). A cgroup that still has a process stays."""
        if not self._ready:
            return
        with contextlib.suppress(FileNotFoundError):
            try:
                (self.slice / name).rmdir()
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    self._once("rmdir", "cannot remove cgroup %s: %s", name, exc)

    def reap(self) -> list[str]:
        """Remove every empty cgroup of the slice (QEMUs that exited while the node agent was down); returns
        their names. Cgroups of running QEMUs stay with them. Done by :meth:`setup`."""
        if not self._ready:
            return []
        gone = []
        for entry in sorted(self.slice.iterdir()):
            if not entry.is_dir():
                continue
            try:
                populated = "populated 1" in (entry / "cgroup.events").read_text()
                if not populated:
                    entry.rmdir()
                    gone.append(entry.name)
            except OSError:
                continue
        return gone


def from_settings(settings: Settings) -> tuple[VmCgroups, dict[str, object]]:
    """The slice at ``PODBAY_CGROUP_ROOT`` (off unless ``PODBAY_VMM_CGROUPS``) and the keyword arguments of
    :func:`cgroup_values` that come from the settings."""
    params: dict[str, object] = {
        "cpu_headroom_percent": settings.vmm_cpu_headroom_percent,
        "memory_overhead_mib": settings.vmm_memory_overhead_mib,
        "pids_max": settings.vmm_pids_max,
        "io_max": settings.vmm_io_max,
    }
    return VmCgroups(settings.cgroup_root, enabled=settings.vmm_cgroups), params
