"""Exact change detection for reflinked files (btrfs): a file's extent map (``FS_IOC_FIEMAP``) compared with
that of a reflink taken earlier (docs/DESIGN.md §5).

A reflink (``FICLONE``) makes the copy share every physical extent of the original; a later write to either
file is copy-on-write, so the written range moves to new blocks. Hence two files on one btrfs filesystem
whose extents map the same byte ranges to the same physical blocks hold the same bytes there, and a range
whose mapping differs was written since (or rewritten with the same bytes: reported changed, the safe side).
Asked with ``FIEMAP_FLAG_SYNC``, the kernel first writes back the file's dirty pages (QEMU's writes through
the page cache, the guest RAM written through a shared mapping), which a snapshot has to write anyway.

Why extents rather than mtime or a QEMU dirty bitmap: mtime only says a write happened since some moment
(not whether the disk differs from the last snapshot, and nothing at all for the first one); a dirty bitmap
lives in one QEMU process (lost on a restart, a restore or an agent restart, and each query is a QMP round
trip that wakes the VM's main loop), while the extent maps are on disk for every snapshot ever taken and
cost one ioctl of a few KiB. Extents whose mapping is not exact (inline, delayed allocation, encoded or
compressed, unknown location) are treated as changed.

Blocking: callers run these in threads.
"""

from __future__ import annotations

import array
import fcntl
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Extent", "fiemap", "same_extents", "unchanged_ranges", "extents_equal_files", "differing_ranges"]

_FS_IOC_FIEMAP = 0xC020660B  # linux/fs.h: _IOWR('f', 11, struct fiemap)
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_ENCODED = 0x8
FIEMAP_EXTENT_NOT_ALIGNED = 0x100
FIEMAP_EXTENT_DATA_INLINE = 0x200
FIEMAP_EXTENT_SHARED = 0x2000
_INEXACT = (FIEMAP_EXTENT_UNKNOWN | FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_ENCODED | FIEMAP_EXTENT_NOT_ALIGNED
            | FIEMAP_EXTENT_DATA_INLINE)
_HDR = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
_EXT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
_BATCH = 512


@dataclass(frozen=True)
class Extent:
    """One mapped range: bytes [``logical``, ``logical + length``) of the file live at ``physical``."""

    logical: int
    physical: int
    length: int
    flags: int

    @property
    def exact(self) -> bool:
        """Whether ``physical`` identifies the bytes (see the module docstring)."""
        return not self.flags & _INEXACT


def fiemap(path: Path, *, sync: bool = True) -> list[Extent]:
    """The extent map of ``path`` in file order (holes are absent). ``sync``: write back dirty pages first.
    Raises ``OSError`` (``EOPNOTSUPP`` on filesystems without FIEMAP)."""
    out: list[Extent] = []
    start = 0
    with open(path, "rb") as f:
        while True:
            buf = array.array("B", bytes(_HDR.size + _EXT.size * _BATCH))
            _HDR.pack_into(buf, 0, start, 2**64 - 1 - start, FIEMAP_FLAG_SYNC if sync else 0, 0, _BATCH, 0)
            fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf, True)
            mapped = _HDR.unpack_from(buf, 0)[3]
            last = False
            for i in range(mapped):
                lo, ph, ln, _r1, _r2, fl, *_ = _EXT.unpack_from(buf, _HDR.size + i * _EXT.size)
                out.append(Extent(lo, ph, ln, fl))
                last = bool(fl & FIEMAP_EXTENT_LAST)
            if mapped == 0 or last or mapped < _BATCH:
                return _merge(out)
            start = out[-1].logical + out[-1].length


def _merge(exts: list[Extent]) -> list[Extent]:
    """Join extents contiguous both in the file and on disk, so two files sharing the same blocks compare
    equal however the filesystem split its reports (a clone may cut an extent where the original did not)."""
    out: list[Extent] = []
    for e in exts:
        flags = e.flags & ~FIEMAP_EXTENT_LAST & ~FIEMAP_EXTENT_SHARED
        p = out[-1] if out else None
        if (p is not None and p.exact and not flags & _INEXACT and p.logical + p.length == e.logical
                and p.physical + p.length == e.physical):
            out[-1] = Extent(p.logical, p.physical, p.length + e.length, p.flags)
        else:
            out.append(Extent(e.logical, e.physical, e.length, flags))
    return out


def same_extents(a: list[Extent], b: list[Extent]) -> bool:
    """Whether two extent maps (from :func:`fiemap`) map every byte range to the same blocks, exactly."""
    return len(a) == len(b) and all(x.exact and x == y for x, y in zip(a, b, strict=True))


def extents_equal_files(current: Path, baseline: Path) -> bool:
    """Whether ``current`` still holds exactly the bytes of its earlier reflink ``baseline``: same size, same
    filesystem and the same extent map. False when either is missing or FIEMAP is not supported (then it
    cannot be told: treat as changed)."""
    try:
        sc, sb = current.stat(), baseline.stat()
        if sc.st_size != sb.st_size or sc.st_dev != sb.st_dev:
            return False
        return same_extents(fiemap(current), fiemap(baseline))
    except OSError:
        return False


def unchanged_ranges(current: list[Extent], baseline: list[Extent], size: int, chunk_size: int) -> list[bool]:
    """Per chunk of ``chunk_size`` bytes of a ``size``-byte file: True when its bytes are certainly those of the
    baseline at the same offsets (every byte is a hole in both, or maps to the same block in both through an
    exact extent). Used to reuse a previous manifest's chunk hashes without reading the chunk."""
    n = -(-size // chunk_size) if size else 0
    same = [True] * n

    def mapping(exts: list[Extent]) -> dict[int, list[tuple[int, int, int, bool]]]:
        # chunk index -> pieces (start, end, physical-at-start, exact) clipped to that chunk
        m: dict[int, list[tuple[int, int, int, bool]]] = {}
        for e in exts:
            lo, hi = e.logical, min(e.logical + e.length, size)
            i = lo // chunk_size
            while lo < hi:
                cend = min((i + 1) * chunk_size, hi)
                m.setdefault(i, []).append((lo, cend, e.physical + (lo - e.logical), e.exact))
                lo, i = cend, i + 1
        return m

    mc, mb = mapping(current), mapping(baseline)
    for i in set(mc) | set(mb):
        pc, pb = mc.get(i, []), mb.get(i, [])
        if i < n and (pc != pb or not all(p[3] for p in pc)):
            same[i] = False
    return same



def differing_ranges(a: list[Extent], b: list[Extent], size: int) -> list[tuple[int, int]]:
    """Byte ranges ``[(start, end), ...]`` of a ``size``-byte file where two extent maps (file order, as
    :func:`fiemap` gives them) differ: mapped to other blocks, mapped in one only, or mapped inexactly in
    either. Empty when :func:`same_extents`. Linear in the number of extents."""
    idx = [0, 0]

    def at(k: int, exts: list[Extent], pos: int) -> tuple[int, Extent | None]:
        """(where the piece of ``exts`` at ``pos`` ends, the extent covering ``pos`` or None: a hole)."""
        i = idx[k]
        while i < len(exts) and exts[i].logical + exts[i].length <= pos:
            i += 1
        idx[k] = i
        if i < len(exts) and exts[i].logical <= pos:
            return exts[i].logical + exts[i].length, exts[i]
        return (exts[i].logical if i < len(exts) else size), None

    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        end_a, ea = at(0, a, pos)
        end_b, eb = at(1, b, pos)
        end = min(end_a, end_b, size)
        same = (ea is None and eb is None) or (
            ea is not None and eb is not None and ea.exact and eb.exact
            and ea.physical + (pos - ea.logical) == eb.physical + (pos - eb.logical))
        if not same:
            if out and out[-1][1] == pos:
                out[-1] = (out[-1][0], end)
            else:
                out.append((pos, end))
        pos = end
    return out
