"""A killed stack whose data directory was deleted leaves host network state that the next stack removes
(podbay.stacknet's registry, podbay.devstack.netns.sweep_orphans), with real nftables tables, namespaces,
veths and bridges; a stack whose data directory exists keeps its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from podbay.devstack.netns import sweep_orphans
from podbay.stacknet import nft_table_of, orphaned_stacks, register_stack, stack_tag

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None,
                                reason="needs root and nftables (as the stacks themselves do)")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30)


def _has_table(table: str) -> bool:
    return _sh("nft", "list", "table", "inet", table, check=False).returncode == 0


def _has_link(name: str) -> bool:
    return _sh("ip", "link", "show", name, check=False).returncode == 0


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    live, dead = tmp_path / "live", tmp_path / "dead"
    live.mkdir()
    yield live, dead
    for d in (live, dead):  # whatever a failed assertion left
        tag = stack_tag(d)
        _sh("nft", "delete", "table", "inet", nft_table_of(tag), check=False)
        _sh("ip", "netns", "del", f"pb-{tag}-node-a", check=False)
        _sh("ip", "link", "del", f"pbv-{tag}-0", check=False)
        _sh("ip", "link", "del", f"pbb-{tag}", check=False)


def test_the_state_of_a_deleted_stack_is_swept_and_a_live_one_is_kept(tmp_path: Path,
                                                                      dirs: tuple[Path, Path]) -> None:
    live, dead = dirs
    registry = tmp_path / "registry"
    dead_tag, live_tag = stack_tag(dead), stack_tag(live)
    register_stack(live, registry=registry)
    register_stack(dead, registry=registry)
    (registry / "garbage").write_text("not a path")  # an unreadable record is left alone
    # What each stack made on the host, as the node agent and a multi-node dev stack make it.
    for tag in (live_tag, dead_tag):
        _sh("nft", "add", "table", "inet", nft_table_of(tag))
    _sh("ip", "netns", "add", f"pb-{dead_tag}-node-a")
    _sh("ip", "link", "add", f"pbb-{dead_tag}", "type", "bridge")
    _sh("ip", "link", "add", f"pbv-{dead_tag}-0", "type", "veth", "peer", "name", "eth0", "netns",
        f"pb-{dead_tag}-node-a")

    assert orphaned_stacks(registry=registry) == {dead_tag: dead.resolve()}
    assert sweep_orphans(registry=registry) == [dead_tag]

    assert not _has_table(nft_table_of(dead_tag))
    assert f"pb-{dead_tag}-node-a" not in _sh("ip", "netns", "list").stdout
    assert not _has_link(f"pbb-{dead_tag}") and not _has_link(f"pbv-{dead_tag}-0")
    assert not (registry / dead_tag).exists()
    # The live stack's table and record, and the unreadable record, are untouched; a second sweep finds nothing.
    assert _has_table(nft_table_of(live_tag))
    assert (registry / live_tag).read_text() == str(live.resolve())
    assert (registry / "garbage").exists()
    assert sweep_orphans(registry=registry) == []
