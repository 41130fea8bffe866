"""guestd's ``move`` and ``watch`` operations, run on this host over a socket and driven by the real
GuestChannel (the fixtures of test_guestd), plus the pure scan/diff logic of ``watch``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from podbay.channel.client import GuestChannel
from podbay.contracts.channel import WatchEvent
from podbay.errors import InvalidRequest, NotFound
from podbay_guestd.ops_watch import diff, scan
from test_guestd import ch, guestd_socket  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="guestd tests switch users and need root")


# -- move ----------------------------------------------------------------------------------------


async def test_move_renames_and_answers_the_destination(ch: GuestChannel, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"abc")
    st = await ch.move(str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert (st.path, st.name, st.type, st.size) == (str(tmp_path / "b.txt"), "b.txt", "file", 3)
    assert not (tmp_path / "a.txt").exists()
    assert (tmp_path / "b.txt").read_bytes() == b"abc"


async def test_move_moves_directories_with_their_contents(ch: GuestChannel, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    st = await ch.move(str(tmp_path / "d"), str(tmp_path / "e"))
    assert st.type == "dir"
    assert (tmp_path / "e" / "f").read_text() == "x"


async def test_move_errors(ch: GuestChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        await ch.move(str(tmp_path / "missing"), str(tmp_path / "x"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotFound):
        await ch.move(str(tmp_path / "f"), str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "d").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "g").write_text("y")
    with pytest.raises(InvalidRequest):
        await ch.move(str(tmp_path / "d"), str(tmp_path / "full"))
    with pytest.raises(InvalidRequest):
        await ch.move("relative", str(tmp_path / "x"))


# -- watch ---------------------------------------------------------------------------------------


async def _collect(it: object, want: set[tuple[str, str]], limit_s: float = 20.0) -> list[WatchEvent]:
    """Events from ``it`` until every (name, type) in ``want`` was seen."""
    got: list[WatchEvent] = []

    async def run() -> None:
        async for ev in it:  # type: ignore[attr-defined]
            got.append(ev)
            if want <= {(e.name, e.type) for e in got}:
                return

    await asyncio.wait_for(run(), limit_s)
    return got


async def test_watch_reports_create_write_chmod_remove(ch: GuestChannel, tmp_path: Path) -> None:
    (tmp_path / "old").write_text("1")
    async with ch.watch(str(tmp_path), interval_s=0.02) as w:
        await w.started()
        (tmp_path / "new").write_text("hello")
        got = await _collect(w, {("new", "create"), ("new", "write")})
        created = next(e for e in got if e.name == "new" and e.type == "create")
        assert created.stat is not None and created.stat.size == 5 and created.stat.type == "file"
        (tmp_path / "old").write_text("22")
        await _collect(w, {("old", "write")})
        os.chmod(tmp_path / "old", 0o600)
        await _collect(w, {("old", "chmod")})
        (tmp_path / "old").unlink()
        removed = await _collect(w, {("old", "remove")})
        assert [e.stat for e in removed if e.name == "old" and e.type == "remove"] == [None]


async def test_watch_hides_podbay_temp_files_of_atomic_writes(ch: GuestChannel, tmp_path: Path) -> None:
    async with ch.watch(str(tmp_path), interval_s=0.02) as w:
        await w.started()
        await ch.write_file(str(tmp_path / "t.txt"), b"data")
        got = await _collect(w, {("t.txt", "create")})
        (tmp_path / "marker").write_text("m")
        got += await _collect(w, {("marker", "create")})
    assert not [e for e in got if e.name.endswith(".podbay-tmp")]


async def test_watch_recursive_sees_nested_changes(ch: GuestChannel, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    async with ch.watch(str(tmp_path), recursive=True, interval_s=0.02) as w:
        await w.started()
        (tmp_path / "sub" / "deep.txt").write_text("x")
        await _collect(w, {("sub/deep.txt", "create")})


async def test_watch_ends_when_the_directory_goes_away(ch: GuestChannel, tmp_path: Path) -> None:
    d = tmp_path / "gone"
    d.mkdir()
    async with ch.watch(str(d), interval_s=0.02) as w:
        await w.started()
        d.rmdir()
        events = await asyncio.wait_for(_drain(w), 20)
    assert events == []


async def _drain(w: object) -> list[WatchEvent]:
    return [ev async for ev in w]  # type: ignore[attr-defined]


async def test_watch_errors(ch: GuestChannel, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        async with ch.watch(str(tmp_path / "missing")) as w:
            await w.started()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidRequest):
        async with ch.watch(str(tmp_path / "file")) as w:
            await w.started()


async def test_closing_a_watch_leaves_the_channel_usable(ch: GuestChannel, tmp_path: Path) -> None:
    for _ in range(3):
        async with ch.watch(str(tmp_path), interval_s=0.02) as w:
            await w.started()
    assert (await ch.ping())["pid"] > 0


# -- scan and diff (pure) ------------------------------------------------------------------------


def test_diff_orders_removals_first_and_classifies_changes(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("a")
    (tmp_path / "mode").write_text("a")
    (tmp_path / "drop").write_text("a")
    (tmp_path / "dir").mkdir()
    before = scan(str(tmp_path), recursive=False)
    (tmp_path / "drop").unlink()
    (tmp_path / "keep").write_text("abc")
    os.chmod(tmp_path / "mode", 0o600)
    (tmp_path / "empty").touch()
    (tmp_path / "dir" / "inner").write_text("x")  # not recursive: the directory's mtime is no event
    after = scan(str(tmp_path), recursive=False)
    assert diff(before, after) == [("drop", "remove"), ("empty", "create"), ("keep", "write"), ("mode", "chmod")]


def test_scan_is_recursive_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").write_text("x")
    (tmp_path / ".x.podbay-tmp").write_text("t")
    assert set(scan(str(tmp_path), recursive=False)) == {"a"}
    assert set(scan(str(tmp_path), recursive=True)) == {"a", "a/b"}


async def test_mkdir_with_user_owns_the_directories_it_creates(ch: GuestChannel, tmp_path: Path) -> None:
    st = await ch.mkdir(str(tmp_path / "a" / "b"), user="nobody")
    nobody = __import__("pwd").getpwnam("nobody")
    assert (st.uid, st.gid) == (nobody.pw_uid, nobody.pw_gid)
    assert (tmp_path / "a").stat().st_uid == nobody.pw_uid
    assert tmp_path.stat().st_uid != nobody.pw_uid  # existing parents keep their owner


# -- inotify (the watch's source wherever the kernel has it) -----------------------------------------


async def test_watch_pairs_renames_and_follows_new_subdirectories(ch: GuestChannel, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    async with ch.watch(str(tmp_path), recursive=True) as w:
        await w.started()
        os.rename(tmp_path / "a.txt", tmp_path / "b.txt")
        got = await _collect(w, {("a.txt", "rename"), ("b.txt", "create")})
        kinds = [(e.name, e.type) for e in got]
        assert kinds.index(("a.txt", "rename")) < kinds.index(("b.txt", "create"))
        assert ("a.txt", "remove") not in kinds
        # A directory made after the watch started is followed at once, its first file included.
        (tmp_path / "new" / "deeper").mkdir(parents=True)
        (tmp_path / "new" / "deeper" / "f.txt").write_text("f")
        await _collect(w, {("new", "create"), ("new/deeper/f.txt", "create")})
        (tmp_path / "new" / "deeper" / "g.txt").write_text("g")
        await _collect(w, {("new/deeper/g.txt", "create"), ("new/deeper/g.txt", "write")})


async def test_watch_reports_a_file_created_and_removed_between_reads(ch: GuestChannel, tmp_path: Path) -> None:
    async with ch.watch(str(tmp_path)) as w:
        await w.started()
        (tmp_path / "brief").write_text("x")
        (tmp_path / "brief").unlink()
        got = await _collect(w, {("brief", "create"), ("brief", "remove")})
    assert [e.type for e in got if e.name == "brief"][0] == "create"
