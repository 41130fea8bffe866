"""The tree comparison behind snapshot diffs (services/nodeagent/storage/diff.py), on plain directories."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from podbay.errors import InvalidRequest, NotFound, Timeout
from podbay_nodeagent.storage.diff import compare_trees, diff_snapshots
from podbay_nodeagent.storage.store import NodeStore


def _tree(root: Path) -> None:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("alpha\n")
    (root / "etc" / "same").write_text("unchanged\n")
    (root / "etc" / "touched").write_text("same bytes\n")
    (root / "etc" / "rewritten").write_text("aaaa\n")
    (root / "etc" / "gone").write_text("bye\n")
    (root / "etc" / "link").symlink_to("hostname")
    (root / "etc" / "becomes-dir").write_text("x")
    (root / "etc" / "modebits").write_text("m")
    (root / "var" / "old").mkdir(parents=True)
    (root / "var" / "old" / "inner").write_text("i")
    (root / "lost+found").mkdir()


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a)
    shutil.copytree(a, b, symlinks=True)
    # copytree copies mtimes, so equal files look equal by metadata; make that explicit for every file.
    for dirpath, _dirs, files in os.walk(a):
        for f in files:
            src = Path(dirpath) / f
            st = os.lstat(src)
            os.utime(b / src.relative_to(a), ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    return a, b


def _bump_mtime(p: Path) -> None:
    st = os.lstat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_lists_added_changed_removed_sorted_with_sizes(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    (b / "etc" / "hostname").write_text("beta-longer\n")          # size differs
    (b / "etc" / "new").write_text("hello")                        # added file
    (b / "srv" / "data").mkdir(parents=True)                       # added dirs
    (b / "etc" / "gone").unlink()                                  # removed
    shutil.rmtree(b / "var" / "old")                               # removed dir and its content
    _bump_mtime(b / "etc" / "touched")                             # same bytes, new mtime: unchanged
    (b / "etc" / "rewritten").write_text("bbbb\n")                 # same size, new bytes: changed
    _bump_mtime(b / "etc" / "rewritten")
    (b / "etc" / "link").unlink()
    (b / "etc" / "link").symlink_to("elsewhere")                   # another target: changed
    (b / "etc" / "becomes-dir").unlink()
    (b / "etc" / "becomes-dir").mkdir()                            # another kind: changed
    os.chmod(b / "etc" / "modebits", 0o600)                        # mode only: changed
    (b / "lost+found" / "ignored").write_text("x")                 # lost+found is ignored

    entries, counts, truncated = compare_trees(a, b)

    got = [(e.path, e.change, e.kind, e.size) for e in entries]
    assert got == [
        ("/etc/becomes-dir", "changed", "dir", os.lstat(b / "etc" / "becomes-dir").st_size),
        ("/etc/gone", "removed", "file", 4),
        ("/etc/hostname", "changed", "file", 12),
        ("/etc/link", "changed", "symlink", len("elsewhere")),
        ("/etc/modebits", "changed", "file", 1),
        ("/etc/new", "added", "file", 5),
        ("/etc/rewritten", "changed", "file", 5),
        ("/srv", "added", "dir", os.lstat(b / "srv").st_size),
        ("/srv/data", "added", "dir", os.lstat(b / "srv" / "data").st_size),
        ("/var/old", "removed", "dir", os.lstat(a / "var" / "old").st_size),
        ("/var/old/inner", "removed", "file", 1),
    ]
    assert counts == {"added": 3, "changed": 5, "removed": 3}
    assert truncated is False


def test_identical_trees_have_no_changes(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    assert compare_trees(a, b) == ([], {"added": 0, "changed": 0, "removed": 0}, False)


def test_symlinks_are_not_followed(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    (b / "escape").symlink_to(outside)
    entries, _, _ = compare_trees(a, b)
    assert [(e.path, e.kind) for e in entries] == [("/escape", "symlink")]


def test_entries_are_capped_but_totals_count_everything(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    for i in range(5):
        (b / f"f{i}").write_text("x")
    entries, counts, truncated = compare_trees(a, b, max_entries=2)
    assert [e.path for e in entries] == ["/f0", "/f1"]
    assert counts["added"] == 5 and truncated is True


def test_a_spent_deadline_raises_timeout(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    with pytest.raises(Timeout):
        compare_trees(a, b, deadline_s=-1.0)


async def test_missing_snapshot_or_bad_id_is_refused_before_mounting(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, "node-1", 1)
    # The store's layout for a snapshot's files (NodeStore.snapshot_dir): snap_a is found there, snap_b is not.
    (store.root / "snapshots" / "sbx_1" / "snap_a").mkdir(parents=True)
    (store.root / "snapshots" / "sbx_1" / "snap_a" / "disk.img").write_bytes(b"")
    with pytest.raises(NotFound) as missing:
        await diff_snapshots(store, "sbx_1", "snap_a", "snap_b")
    assert missing.value.details["snapshot_id"] == "snap_b"
    with pytest.raises(InvalidRequest):
        await diff_snapshots(store, "sbx_1", "..", "snap_a")
    assert not (store.root / "tmp").exists()
