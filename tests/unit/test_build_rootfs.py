"""services/nodeagent/build/rootfs.py: every operation stays inside the tree, whatever links the tree holds."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from podbay_nodeagent.build.rootfs import Root, guest_path


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """``root`` (the image) and ``outside`` (a host directory with a file), each its own folder."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "file").write_text("host\n")
    os.utime(outside, (1_500_000_000, 1_500_000_000))
    return root, outside


def _unchanged(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["file"]
    assert (outside / "file").read_text() == "host\n"
    assert outside.stat().st_mtime == 1_500_000_000


@pytest.mark.parametrize(("path", "norm"), [("etc/passwd", "/etc/passwd"), ("/a/../../b", "/b"), ("//x/./y/", "/x/y"),
                                            ("../../..", "/"), ("", "/")])
def test_guest_paths_are_normalised_below_the_root(path: str, norm: str) -> None:
    assert guest_path(path) == norm


def test_absolute_and_relative_links_resolve_inside_the_root(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    (root / "abs").symlink_to(outside)
    (root / "rel").symlink_to("../../../../" + str(outside).lstrip("/"))
    (root / "loop").symlink_to("loop")
    with Root(root) as r:
        assert r.stat("/abs/file") is None and r.stat("/rel/file") is None and r.stat("/loop/x") is None
        with pytest.raises(OSError):
            r.write_bytes("/abs/new", b"x")
        with pytest.raises(OSError):
            r.makedirs("/rel/sub")
        assert r.remove("/abs/file") is False
    _unchanged(outside)


def test_a_link_at_the_written_path_is_replaced_never_written_through(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    (root / "etc").mkdir()
    (root / "etc" / "passwd").symlink_to(outside / "file")
    with Root(root) as r:
        r.write_bytes("/etc/passwd", b"user:x:1000\n", mode=0o600, uid=0, gid=0)
        r.chown("/etc", 0, 0)
    assert not (root / "etc" / "passwd").is_symlink()
    assert (root / "etc" / "passwd").read_bytes() == b"user:x:1000\n"
    assert stat.S_IMODE((root / "etc" / "passwd").stat().st_mode) == 0o600
    _unchanged(outside)


def test_removing_a_link_to_a_directory_removes_the_link_only(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    (root / "opt").symlink_to(outside)
    (root / "d").mkdir()
    (root / "d" / "inner").symlink_to(outside)
    with Root(root) as r:
        assert r.remove("/opt") is True
        assert r.remove("/d") is True
        r.clear_dir("/")
    assert not list(root.iterdir())
    _unchanged(outside)


def test_chmod_and_chown_never_reach_a_link_target(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    (root / "l").symlink_to(outside / "file")
    before = (outside / "file").stat()
    with Root(root) as r:
        r.chmod("/l", 0o777)
        if os.geteuid() == 0:
            r.chown("/l", 4321, 4321)
    after = (outside / "file").stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)


def test_reads_take_regular_files_only_and_bounded(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    os.mkfifo(root / "fifo")
    (root / "big").write_bytes(b"x" * 100)
    (root / "link").symlink_to("/big")
    with Root(root) as r:
        with pytest.raises(OSError):
            r.read_bytes("/fifo")  # would block a plain open()
        with pytest.raises(OSError):
            r.read_bytes("/big", limit=10)
        assert r.read_bytes("/link") == b"x" * 100
        assert r.is_file("/link") and not r.is_file("/fifo")


def test_copy_in_makes_a_fresh_tree_inside_the_root(tree: tuple[Path, Path], tmp_path: Path) -> None:
    root, outside = tree
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("ours")
    (src / "skip.pyc").write_text("no")
    (root / "opt").symlink_to(outside)  # /opt resolves inside the root: to a /<outside> that is not there
    with Root(root) as r:
        with pytest.raises(OSError):
            r.copy_in(src, "/opt/podbay")
        r.copy_in(src, "/usr/podbay", ignore=lambda _d, names: [n for n in names if n.endswith(".pyc")])
    assert (root / "usr" / "podbay" / "sub" / "f").read_text() == "ours"
    assert not (root / "usr" / "podbay" / "skip.pyc").exists()
    _unchanged(outside)
