"""A node agent resolves a sandbox's template by (name, digest): the current build or an earlier one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from podbay.config import Settings
from podbay.errors import NotFound
from podbay_nodeagent.net.network import SandboxNetwork
from podbay_nodeagent.ops.sandboxes import SandboxManager
from podbay_nodeagent.storage.store import NodeStore
from podbay_nodeagent.build.template import MACHINE, TemplateSnapshot
from podbay_nodeagent.vm.vmdriver import VmDriver
from podbay_nodeagent.vm.vmm import QemuVmm

_FILES = ("state", "ram", "disk.img", "vmlinuz", "initrd.img")


def _write_build(directory: Path, key: str, machine: str = MACHINE, *, aslr: bool = False, memory_mib: int = 256) -> None:
    directory.mkdir(parents=True)
    for name in _FILES:
        (directory / name).write_bytes(key.encode())
    tpl = TemplateSnapshot(
        name="base", key=key, dir=directory, kernel=directory / "vmlinuz", initrd=directory / "initrd.img",
        state=directory / "state", ram=directory / "ram", disk=directory / "disk.img", memory_mib=memory_mib, vcpus=1,
        tsc_khz=1, image_digest="img", qemu_version="8.2", accel="tcg", boot_s=1.0, paused_ms=1.0,
        created_at="2026-01-01T00:00:00Z", machine=machine, guest_aslr=aslr)
    (directory / "template.json").write_text(tpl.model_dump_json())


def _manager(tmp_path: Path) -> SandboxManager:
    settings = Settings(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", accel="tcg",
                        sandbox_memory_mib=256, sandbox_vcpus=1)
    store = NodeStore(settings.data_dir, settings.node_id, 1)
    driver = VmDriver(settings, store, QemuVmm())
    return SandboxManager(settings, None, None, None, store, driver, SandboxNetwork(settings))  # type: ignore[arg-type]


def test_an_earlier_build_in_the_store_is_loaded_once_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _write_build(m.store.template_dir("base", "a" * 64), "a" * 64)
    _write_build(tmp_path / "cache" / "templates" / "base-bbbb", "b" * 64)
    m.templates = {"base": m.driver._import("base", tmp_path / "cache" / "templates" / "base-bbbb")}

    async def go() -> None:
        assert (await m.template("base", "b" * 64)) is m.templates["base"]
        older = await m.template("base", "a" * 64)
        assert older.digest == "a" * 64 and older.snapshot.dir == m.store.template_dir("base", "a" * 64)
        assert (await m.template("base", "a" * 64)) is older  # cached
        with pytest.raises(NotFound) as err:
            await m.template("base", "c" * 64)
        assert "cccccccccccc" in err.value.message and "bbbbbbbbbbbb" in err.value.message

    asyncio.run(go())


def test_a_build_only_in_the_build_cache_is_imported_into_the_store_on_demand(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _write_build(tmp_path / "cache" / "templates" / "base-dddd", "d" * 64)
    img = asyncio.run(m.template("base", "d" * 64))
    assert img.snapshot.dir == m.store.template_dir("base", "d" * 64)
    assert (img.snapshot.dir / "ram").read_bytes() == b"d" * 64


def test_a_cached_build_for_another_device_set_is_never_imported(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _write_build(tmp_path / "cache" / "templates" / "base-eeee", "e" * 64)
    # Newer, but booted without the NIC (an older agent sharing the cache): its device state cannot load.
    _write_build(tmp_path / "cache" / "templates" / "base-ffff", "f" * 64, machine="")
    newer = (tmp_path / "cache" / "templates" / "base-eeee" / "template.json").stat().st_mtime + 60
    os.utime(tmp_path / "cache" / "templates" / "base-ffff" / "template.json", (newer, newer))
    assert m.driver._cached_templates() == {"base": tmp_path / "cache" / "templates" / "base-eeee"}


def _make_newer(path: Path, than: Path) -> None:
    t = (than / "template.json").stat().st_mtime + 60
    os.utime(path / "template.json", (t, t))


def test_the_cached_build_made_with_the_node_s_settings_wins_over_a_newer_other_one(tmp_path: Path) -> None:
    """Under TCG with ``guest_aslr`` auto the node wants the ASLR-off build, 256 MiB, 1 vCPU: a newer build with
    ASLR on or another memory size is passed over; with none as configured, the newest is taken."""
    m = _manager(tmp_path)
    cache = tmp_path / "cache" / "templates"
    _write_build(cache / "base-off", "1" * 64, aslr=False)
    _write_build(cache / "base-on", "2" * 64, aslr=True)
    _write_build(cache / "base-big", "3" * 64, memory_mib=512)
    _make_newer(cache / "base-on", cache / "base-off")
    _make_newer(cache / "base-big", cache / "base-off")
    assert m.driver._cached_templates() == {"base": cache / "base-off"}
    m.settings.guest_aslr = "on"
    assert m.driver._cached_templates() == {"base": cache / "base-on"}
    m.settings.sandbox_memory_mib = 1024  # nothing as configured: the newest loadable build
    _make_newer(cache / "base-big", cache / "base-on")
    assert m.driver._cached_templates() == {"base": cache / "base-big"}
