"""What a VM really costs the host in memory, and what the host has left (docs/DESIGN.md §3 "Density").

Guest RAM is a shared file mapping (``-object memory-backend-file,share=on``), so the pages a guest touched
live in the page cache of its RAM file, not in anonymous memory. One VM's cost is the PSS of its QEMU
(``/proc/<pid>/smaps_rollup``): QEMU's own memory (anonymous: device state, TCG's translation buffer), its
share of the shared libraries, and the RAM-file pages it has mapped, which are the pages its guest touched.

Read-ahead also brings RAM-file pages into the page cache that the guest never touched (an idle restored
guest here: 40 MiB of RAM mapped, another 59 MiB read ahead beside it). Those are clean and unmapped, so the
kernel drops them for nothing when it needs the memory (the guest would read them again if it ever touched
them): they are reported (``ram_cached_mib``, ``unmapped_mib``) but are not a cost.

The host's own ``MemAvailable`` counts page-cache pages as reclaimable, guest RAM pages included: the kernel
could write them back to the RAM file and drop them, and the guest would fault them back in from disk, a swap
storm rather than free memory. :func:`available_for_vms` therefore subtracts the mapped file pages of the
whole host (``Mapped``: every QEMU's touched guest RAM, this node's or another stack's, and the libraries in
use).

Used by the node agent (admission by measured use, memory pressure) and the benchmarks; Linux only. Cached
pages are counted with ``cachestat(2)`` (Linux 6.5) and, on older kernels, ``mincore(2)`` over a read-only
mapping. Sizes are MiB (floats) unless a name says otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VmMemory", "HostMemory", "vm_memory", "host_memory", "file_cached_bytes", "available_for_vms",
           "tcg_buffer_mib", "parse_tcg_buffer_mib"]

_MIB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")
_SYS_CACHESTAT = 451  # the same number on every architecture (added after the syscall table unification)
_ROLLUP = re.compile(r"^(Pss|Pss_File):\s+(\d+) kB", re.M)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_cachestat_ok = True


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


@dataclass(frozen=True)
class VmMemory:
    """One VM: ``pss_mib`` of its QEMU, ``ram_cached_mib`` (its RAM file's pages in the page cache, mapped or
    not), ``unmapped_mib`` (of those, about how many its QEMU has not mapped: read ahead, free to drop) and
    ``cost_mib`` (what it costs the host: the PSS)."""

    pss_mib: float
    ram_cached_mib: float
    unmapped_mib: float
    cost_mib: float


@dataclass(frozen=True)
class HostMemory:
    """``/proc/meminfo``: ``total_mib`` (MemTotal), ``available_mib`` (MemAvailable) and ``mapped_mib`` (Mapped:
    file pages mapped by some process)."""

    total_mib: float
    available_mib: float
    mapped_mib: float


def file_cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (0 for an empty file). Raises ``OSError`` (e.g. the file is gone)."""
    global _cachestat_ok
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _cachestat_ok:
            st = _Stat()
            if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(st), 0) == 0:
                return int(st.nr_cache) * _PAGE
            if ctypes.get_errno() != errno.ENOSYS:
                raise OSError(ctypes.get_errno(), f"cachestat {path}")
            _cachestat_ok = False  # an older kernel: mincore from now on
        return _mincore_bytes(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _mincore_bytes(fd: int, size: int) -> int:
    if size <= 0:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap for mincore")
    try:
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(b & 1 for b in bytes(vec)) * _PAGE
    finally:
        _libc.munmap(addr, size)


def vm_memory(pid: int, ram: Path | None) -> VmMemory | None:
    """The memory of QEMU ``pid`` whose guest RAM file is ``ram`` (None: count PSS alone); None when the process
    is gone. A RAM file that vanished meanwhile counts 0 cached pages."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {k: int(v) * 1024 for k, v in _ROLLUP.findall(rollup)}
    pss = fields.get("Pss", 0)
    cached = 0
    if ram is not None:
        try:
            cached = file_cached_bytes(ram)
        except OSError:
            cached = 0
    # Pss_File holds the mapped RAM pages and a small share of the libraries: the estimate errs low by < 1 MiB.
    unmapped = max(0, cached - fields.get("Pss_File", 0))
    return VmMemory(pss / _MIB, cached / _MIB, unmapped / _MIB, pss / _MIB)


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ (\S{4}) \S+ \S+ (\d+)\s*(.*)$")
_RSS = re.compile(r"^Rss:\s+(\d+) kB$")


def parse_tcg_buffer_mib(smaps: str) -> float:
    """The resident MiB of TCG's translation buffer in the text of a QEMU's ``/proc/<pid>/smaps``: the largest
    anonymous mapping that is writable and executable (QEMU maps the buffer ``rwx`` in one piece, without a
    split W^X mapping on Linux hosts; nothing else in QEMU is). 0.0 when there is none (a KVM guest)."""
    best = 0
    writable_exec = False
    for line in smaps.splitlines():
        if m := _MAPPING.match(line):
            perms, inode, name = m.groups()
            writable_exec = perms.startswith("rwx") and inode == "0" and not name.strip()
        elif writable_exec and (r := _RSS.match(line)):
            best = max(best, int(r.group(1)))
            writable_exec = False
    return best / 1024


def tcg_buffer_mib(pid: int) -> float | None:
    """:func:`parse_tcg_buffer_mib` of QEMU ``pid``; None when the process is gone."""
    try:
        return parse_tcg_buffer_mib(Path(f"/proc/{pid}/smaps").read_text())
    except OSError:
        return None


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> HostMemory:
    """MemTotal, MemAvailable and Mapped of the host, MiB."""
    values: dict[str, int] = {}
    for line in meminfo.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "Mapped"):
            values[key] = int(rest.split()[0])
    return HostMemory(values["MemTotal"] / 1024, values["MemAvailable"] / 1024, values.get("Mapped", 0) / 1024)


def available_for_vms(host: HostMemory) -> float:
    """What the host can still give VMs, MiB: MemAvailable less the mapped file pages (touched guest RAM that
    it counts as cache); never below 0."""
    return max(0.0, host.available_mib - host.mapped_mib)
