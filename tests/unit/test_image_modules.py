"""Module dependency resolution and apt source parsing of the template image build (image.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from podbay_nodeagent.build.image import apt_mirror, parse_modules_dep, resolve_module_order

MODULES_DEP = """\
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/fs/ext4/ext4.ko.xz: kernel/fs/jbd2/jbd2.ko.xz kernel/fs/mbcache.ko.xz kernel/lib/crc16.ko.xz
kernel/fs/jbd2/jbd2.ko.xz:
kernel/fs/mbcache.ko.xz:
kernel/lib/crc16.ko.xz:
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
kernel/drivers/hid/hid-generic.ko:
"""


def test_dependencies_come_first_and_once() -> None:
    order = resolve_module_order(["virtio_blk", "virtio_mmio", "virtio_console"], MODULES_DEP)
    assert order == [
        "kernel/drivers/virtio/virtio_ring.ko",
        "kernel/drivers/virtio/virtio.ko",
        "kernel/drivers/block/virtio_blk.ko",
        "kernel/drivers/virtio/virtio_mmio.ko",
        "kernel/drivers/char/virtio_console.ko",
    ]


def test_ext4_as_a_module_pulls_its_dependencies() -> None:
    order = resolve_module_order(["ext4"], MODULES_DEP)
    assert order[-1] == "kernel/fs/ext4/ext4.ko.xz"
    assert set(order[:-1]) == {"kernel/fs/jbd2/jbd2.ko.xz", "kernel/fs/mbcache.ko.xz", "kernel/lib/crc16.ko.xz"}


def test_builtin_modules_are_skipped() -> None:
    dep = "kernel/drivers/virtio/virtio_ring.ko:\n"
    order = resolve_module_order(["virtio_ring", "ext4"], dep, builtin="kernel/fs/ext4/ext4.ko\n")
    assert order == ["kernel/drivers/virtio/virtio_ring.ko"]


def test_missing_required_module_raises() -> None:
    with pytest.raises(KeyError, match="virtio_net"):
        resolve_module_order(["virtio_net"], MODULES_DEP)


def test_optional_modules_only_when_present() -> None:
    order = resolve_module_order(["virtio_ring"], MODULES_DEP, optional=["crc32c_generic", "failover"])
    assert order == ["kernel/drivers/virtio/virtio_ring.ko", "kernel/net/core/failover.ko"]


def test_dash_and_underscore_are_the_same_module() -> None:
    assert resolve_module_order(["hid_generic"], MODULES_DEP) == ["kernel/drivers/hid/hid-generic.ko"]
    assert "hid_generic" in parse_modules_dep(MODULES_DEP)


def test_cycle_is_reported() -> None:
    dep = "a.ko: b.ko\nb.ko: a.ko\n"
    with pytest.raises(ValueError, match="cycle"):
        resolve_module_order(["a"], dep)


def test_apt_mirror_from_deb822_sources(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n"
    )
    assert apt_mirror("bookworm", [tmp_path]) == "http://mirror.example/debian"


def test_apt_mirror_from_one_line_list(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://list.example/debian bookworm main\n"
    )
    assert apt_mirror("bookworm", [tmp_path]) == "http://list.example/debian"
    with pytest.raises(ValueError):
        apt_mirror("trixie", [tmp_path])
