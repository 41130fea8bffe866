"""What changed between two snapshots of one sandbox: files added, changed and removed (docs/DESIGN.md §5).

Each snapshot's ``disk.img`` is a raw ext4 image (the guest's ``/dev/vda``, mounted as its ``/``). Both are
loop-mounted read-only with ``noload`` (the journal is neither replayed nor written, so the snapshot's
file stays byte for byte as it was) in temporary mount points under ``store/tmp/``, both trees are walked
without following symlinks or crossing into other filesystems, and the entries are compared:

- a path only in ``a`` is ``removed``, only in ``b`` is ``added``;
- a different kind (file, dir, symlink, other) is ``changed``;
- a regular file is ``changed`` when its size, mode or owner differ, or, with the same size but another
  mtime, when its bytes differ (compared chunk by chunk); same size and mtime count as unchanged (as rsync
  does by default);
- a symlink is ``changed`` when its target, mode or owner differ; a device when its numbers do;
- a directory is ``changed`` only when its mode or owner differ: its size and mtime move whenever an
  entry is added or removed, and those entries are listed themselves.

``lost+found`` at the root is ignored. Mount points left by a crashed agent are cleaned up before the
next process's first diff. The work runs in a thread and is bounded by ``DIFF_TIMEOUT_S``
(checked as the walk goes); the images are unmounted in ``finally`` whatever happens. Paths are reported
as the guest sees them (``/etc/hostname``), sorted; at most ``MAX_ENTRIES`` are returned.

A full snapshot's disk is what had reached the disk when the VM stopped: writes still in the guest's
page cache are in its memory file, not in ``disk.img``, so they show up only in a later snapshot (a disk
snapshot syncs first, so it has no such lag).

The comparison itself (``compare_trees``) takes two directory roots, so it needs no mount.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Literal

from podbay.contracts.api import SnapshotDiff, SnapshotDiffEntry
from podbay.errors import InvalidRequest, NotFound, PodbayError, Timeout

from .store import NodeStore

__all__ = ["DIFF_TIMEOUT_S", "MAX_ENTRIES", "DIFF_CONCURRENCY", "compare_trees", "diff_images",
           "diff_snapshots", "cleanup_stale_mounts"]

log = logging.getLogger("podbay.nodeagent.diff")

DIFF_TIMEOUT_S = 120.0  # whole diff (mounts, walk, content compare); Settings has no field for it yet
MAX_ENTRIES = 100_000
DIFF_CONCURRENCY = 2  # diffs at once on a node: each reads two whole trees from the store
_CHUNK = 1 << 20
_MOUNT_TIMEOUT_S = 30.0
_IGNORED_AT_ROOT = frozenset({"lost+found"})
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

Kind = Literal["file", "dir", "symlink", "other"]
Change = Literal["added", "changed", "removed"]

_slots = asyncio.Semaphore(DIFF_CONCURRENCY)
_cleaned = False  # mounts left by an earlier agent process are removed before this process's first diff


def _kind(mode: int) -> Kind:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class _Deadline:
    def __init__(self, budget_s: float) -> None:
        self.at = time.monotonic() + budget_s

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise Timeout("the snapshot diff took too long", details={"timeout_s": DIFF_TIMEOUT_S})


def _scan(root: Path, deadline: _Deadline) -> dict[str, os.stat_result]:
    """Every entry under ``root`` as ``{"/rel/path": lstat}``, staying on ``root``'s filesystem."""
    root_dev = os.lstat(root).st_dev
    out: dict[str, os.stat_result] = {}
    stack: list[tuple[str, str]] = [(str(root), "")]
    while stack:
        deadline.check()
        real, rel = stack.pop()
        try:
            it = os.scandir(real)
        except OSError as exc:  # an unreadable directory is listed, its content is not
            log.warning("cannot list %s in a snapshot: %s", rel or "/", exc)
            continue
        with it:
            for e in it:
                if not rel and e.name in _IGNORED_AT_ROOT:
                    continue
                path = f"{rel}/{e.name}"
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError as exc:  # e.g. a damaged inode in an image taken without a freeze
                    log.warning("cannot stat %s in a snapshot: %s", path, exc)
                    continue
                out[path] = st
                if stat.S_ISDIR(st.st_mode) and st.st_dev == root_dev:
                    stack.append((e.path, path))
    return out


def _same_bytes(a: Path, b: Path, deadline: _Deadline) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            deadline.check()
            ca, cb = fa.read(_CHUNK), fb.read(_CHUNK)
            if ca != cb:
                return False
            if not ca:
                return True


def _changed(rel: str, sa: os.stat_result, sb: os.stat_result, root_a: Path, root_b: Path,
             deadline: _Deadline) -> bool:
    ka, kb = _kind(sa.st_mode), _kind(sb.st_mode)
    if ka != kb or sa.st_mode != sb.st_mode or sa.st_uid != sb.st_uid or sa.st_gid != sb.st_gid:
        return True
    if ka == "dir":
        return False
    if ka == "symlink":
        return os.readlink(root_a / rel[1:]) != os.readlink(root_b / rel[1:])
    if ka == "other":
        return sa.st_rdev != sb.st_rdev
    if sa.st_size != sb.st_size:
        return True
    if sa.st_mtime_ns == sb.st_mtime_ns:
        return False
    try:
        return not _same_bytes(root_a / rel[1:], root_b / rel[1:], deadline)
    except OSError as exc:  # unreadable (e.g. a corrupt block): say changed rather than hide it
        log.warning("cannot compare %s between snapshots: %s", rel, exc)
        return True


def compare_trees(root_a: Path, root_b: Path, *, deadline_s: float = DIFF_TIMEOUT_S,
                  max_entries: int = MAX_ENTRIES) -> tuple[list[SnapshotDiffEntry], dict[str, int], bool]:
    """Compare the trees under ``root_a`` (earlier) and ``root_b`` (later); see the module doc for the rules.

    Returns ``(entries sorted by path and capped at max_entries, {"added", "changed", "removed"} counts of
    every change, truncated)``. Paths are relative to the roots and start with ``/``. Raises ``Timeout``
    after ``deadline_s`` seconds; ``OSError`` when a root cannot be read.
    """
    deadline = _Deadline(deadline_s)
    ta, tb = _scan(root_a, deadline), _scan(root_b, deadline)
    counts = {"added": 0, "changed": 0, "removed": 0}
    entries: list[SnapshotDiffEntry] = []
    for rel in sorted(ta.keys() | tb.keys()):
        sa, sb = ta.get(rel), tb.get(rel)
        change: Change
        if sb is None:
            change, st = "removed", sa
        elif sa is None:
            change, st = "added", sb
        elif _changed(rel, sa, sb, root_a, root_b, deadline):
            change, st = "changed", sb
        else:
            continue
        assert st is not None
        counts[change] += 1
        if len(entries) < max_entries:
            entries.append(SnapshotDiffEntry(path=rel, change=change, kind=_kind(st.st_mode), size=st.st_size))
    return entries, counts, sum(counts.values()) > len(entries)


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_MOUNT_TIMEOUT_S)
    if proc.returncode != 0:
        # The node's paths are internal: log them, tell the caller only what failed.
        log.warning("%s failed: %s", " ".join(argv), proc.stderr.strip() or proc.returncode)
        raise PodbayError(f"{argv[0]} of a snapshot disk image failed on the node")


def _detach(mountpoint: Path) -> None:
    """Lazy unmount, the last resort; errors are only logged (a later agent start cleans up)."""
    try:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=_MOUNT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot detach %s: %s", mountpoint, exc)


@contextmanager
def _mounted(image: Path, mountpoint: Path) -> Iterator[Path]:
    """``image`` mounted read-only at ``mountpoint`` for the block; unmounted (lazily as a last resort) after.

    Raises ``PodbayError`` when mounting fails, ``Timeout`` when ``mount`` hangs.
    """
    mountpoint.mkdir()
    try:
        try:
            _run(["mount", "-t", "ext4", "-o", "ro,noload,loop,nodev,nosuid,noexec", str(image), str(mountpoint)])
        except subprocess.TimeoutExpired as exc:
            _detach(mountpoint)  # it may have been mounted after all
            raise Timeout("mounting a snapshot disk image timed out on the node") from exc
        try:
            yield mountpoint
        finally:
            try:
                _run(["umount", str(mountpoint)])
            except (PodbayError, subprocess.TimeoutExpired) as exc:
                log.warning("unmounting %s failed (%s); detaching it lazily", mountpoint, exc)
                _detach(mountpoint)
    finally:
        try:
            mountpoint.rmdir()  # rmdir, not rmtree: never delete into a filesystem still mounted
        except OSError as exc:
            log.warning("cannot remove the mount point %s: %s", mountpoint, exc)


def diff_images(image_a: Path, image_b: Path, tmp_root: Path, *, deadline_s: float = DIFF_TIMEOUT_S,
                max_entries: int = MAX_ENTRIES) -> tuple[list[SnapshotDiffEntry], dict[str, int], bool]:
    """Mount both ext4 images read-only under a new directory in ``tmp_root`` and ``compare_trees`` them.

    Blocking (run it in a thread); needs root. Raises ``PodbayError`` when an image cannot be mounted,
    ``Timeout`` after ``deadline_s``; the images are unmounted whatever happens.
    """
    t0 = time.monotonic()
    tmp_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"diff-{os.getpid()}-", dir=tmp_root))
    try:
        with ExitStack() as stack:
            ra = stack.enter_context(_mounted(image_a, work / "a"))
            rb = stack.enter_context(_mounted(image_b, work / "b"))
            left = deadline_s - (time.monotonic() - t0)
            return compare_trees(ra, rb, deadline_s=left, max_entries=max_entries)
    finally:
        try:
            work.rmdir()
        except OSError as exc:
            log.warning("cannot remove %s: %s", work, exc)


def cleanup_stale_mounts(tmp_root: Path) -> None:
    """Unmount and remove the ``diff-<pid>-*`` directories that earlier agent processes left in ``tmp_root``.

    Directories of this process are left alone, so it is safe while diffs run.
    """
    mine = f"diff-{os.getpid()}-"
    for work in tmp_root.glob("diff-*"):
        if work.name.startswith(mine):
            continue
        for mp in (work / "a", work / "b"):
            if mp.is_dir() and subprocess.run(["mountpoint", "-q", str(mp)]).returncode == 0:
                _detach(mp)
        for d in (work / "a", work / "b", work):
            try:
                if d.is_dir():
                    d.rmdir()  # rmdir, not rmtree: a mount that would not go must not be emptied
            except OSError as exc:
                log.warning("cannot remove %s: %s", d, exc)


async def diff_snapshots(store: NodeStore, sandbox_id: str, snapshot_a: str, snapshot_b: str) -> SnapshotDiff:
    """The change set from ``snapshot_a`` to ``snapshot_b`` of ``sandbox_id`` on this node.

    Files come from each snapshot's ``disk.img`` in :meth:`NodeStore.snapshot_dir`; the mounts go under
    ``<store root>/tmp``. Raises ``InvalidRequest`` for a malformed id, ``NotFound`` when a snapshot's disk is
    not on this node, ``Timeout`` after ``DIFF_TIMEOUT_S``, ``PodbayError`` when an image cannot be mounted.
    """
    for ident in (sandbox_id, snapshot_a, snapshot_b):
        if not _ID.fullmatch(ident):
            raise InvalidRequest(f"malformed id {ident!r}")
    images: list[Path] = []
    for snap in (snapshot_a, snapshot_b):
        img = store.snapshot_dir(sandbox_id, snap) / "disk.img"
        if not img.is_file():
            raise NotFound(f"snapshot {snap} of sandbox {sandbox_id} is not on this node",
                           details={"snapshot_id": snap})
        images.append(img)
    global _cleaned
    if not _cleaned:
        _cleaned = True
        await asyncio.to_thread(cleanup_stale_mounts, store.root / "tmp")
    async with _slots:
        entries, counts, truncated = await asyncio.to_thread(diff_images, images[0], images[1],
                                                             store.root / "tmp")
    return SnapshotDiff(sandbox_id=sandbox_id, from_snapshot_id=snapshot_a, to_snapshot_id=snapshot_b,
                        entries=entries, truncated=truncated, **counts)
