"""A build's resources (services/nodeagent/build/resources.py, podbay.contracts.templates.BuildResources):
bounds, defaults from the FROM template, which builds boot, their cache keys, the offline growth of an ext4
disk, the SDK's form fields and E2B's checks of ``cpuCount``/``memoryMB``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from podbay.contracts.templates import BuildResources, BuildSpec, FromRef
from podbay.errors import InvalidRequest, Unprocessable
from podbay.sdk import _calls as calls
from podbay_api.e2b.templates import check_resources
from podbay_nodeagent.build.layers import layer_key
from podbay_nodeagent.build.resources import MIB, Resources, grow_disk, leftover_vm_dirs, resize_key, resolve
from podbay_nodeagent.build.template import MACHINE, TemplateSnapshot
from podbay.dockerfile import parse_dockerfile


def _parent(tmp_path: Path, disk_mib: int = 2048, memory_mib: int = 256, vcpus: int = 1) -> TemplateSnapshot:
    d = tmp_path / "base"
    d.mkdir()
    with (d / "disk.img").open("wb") as f:
        f.truncate(disk_mib * MIB)  # sparse
    return TemplateSnapshot(
        name="base", key="k" * 64, dir=d, kernel=d / "vmlinuz", initrd=d / "initrd.img", state=d / "state",
        ram=d / "ram", disk=d / "disk.img", memory_mib=memory_mib, vcpus=vcpus, tsc_khz=1, image_digest="img",
        qemu_version="7.2", accel="tcg", boot_s=1.0, paused_ms=1.0, created_at="2026-01-01T00:00:00Z",
        machine=MACHINE)


@pytest.mark.parametrize("field,value", [("memory_mib", 127), ("memory_mib", 16385), ("vcpus", 0), ("vcpus", 17),
                                         ("disk_mib", 511), ("disk_mib", (256 << 10) + 1), ("memory_mib", "lots")])
def test_out_of_bounds_resources_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        BuildResources.model_validate({field: value})


def test_a_spec_without_resources_keeps_the_parents() -> None:
    spec = BuildSpec.model_validate({"base": {"kind": "template", "ref": "base"}})
    assert spec.resources == BuildResources()
    assert BuildSpec(base=FromRef(kind="template", ref="base"),
                     resources=BuildResources(memory_mib=1024)).resources.memory_mib == 1024


def test_absent_or_equal_resources_restore_the_parent_and_others_boot(tmp_path: Path) -> None:
    parent = _parent(tmp_path)
    same = Resources(memory_mib=256, vcpus=1, disk_bytes=2048 * MIB, boot=False)
    assert resolve(parent, BuildResources()) == same
    assert resolve(parent, BuildResources(memory_mib=256, vcpus=1, disk_mib=2048)) == same
    assert resolve(parent, BuildResources(memory_mib=1024)) == Resources(1024, 1, 2048 * MIB, True)
    assert resolve(parent, BuildResources(vcpus=2)) == Resources(256, 2, 2048 * MIB, True)
    assert resolve(parent, BuildResources(disk_mib=4096)) == Resources(256, 1, 4096 * MIB, True)


def test_a_disk_smaller_than_the_parents_is_a_422_naming_its_size(tmp_path: Path) -> None:
    with pytest.raises(Unprocessable) as info:
        resolve(_parent(tmp_path), BuildResources(disk_mib=1024))
    assert info.value.http_status == 422 and info.value.code == "validation_error"
    assert info.value.details == {"disk_mib": 1024, "from_disk_mib": 2048}


def test_resources_change_every_layer_key_after_them() -> None:
    step = parse_dockerfile("FROM podbay/base\nRUN make\n").steps[0]
    a = resize_key("p" * 64, Resources(1024, 1, 2048 * MIB, True))
    assert a != resize_key("p" * 64, Resources(1024, 2, 2048 * MIB, True))
    assert a != resize_key("p" * 64, Resources(512, 1, 2048 * MIB, True))
    assert a != resize_key("p" * 64, Resources(1024, 1, 4096 * MIB, True))
    assert a != resize_key("q" * 64, Resources(1024, 1, 2048 * MIB, True))
    assert a == resize_key("p" * 64, Resources(1024, 1, 2048 * MIB, True))
    assert layer_key(a, step) != layer_key("p" * 64, step)


def _blocks(img: Path) -> int:
    out = subprocess.run(["dumpe2fs", "-h", str(img)], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return int(fields["Block count"]) * int(fields["Block size"])


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None or shutil.which("resize2fs") is None,
                    reason="e2fsprogs is not installed")
def test_grow_disk_extends_the_image_and_its_ext4_filesystem(tmp_path: Path) -> None:
    img = tmp_path / "disk.img"
    with img.open("wb") as f:
        f.truncate(64 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    (tmp_path / "data").write_text("kept\n")
    subprocess.run(["debugfs", "-w", "-R", f"write {tmp_path / 'data'} data", str(img)], check=True,
                   capture_output=True)
    assert _blocks(img) == 64 * MIB
    grow_disk(img, 96 * MIB)
    assert img.stat().st_size == 96 * MIB and _blocks(img) == 96 * MIB
    out = subprocess.run(["debugfs", "-R", "cat data", str(img)], capture_output=True, text=True, check=True)
    assert out.stdout == "kept\n"
    grow_disk(img, 80 * MIB)  # never shrinks
    assert img.stat().st_size == 96 * MIB


def test_sdk_sends_resources_only_when_given() -> None:
    call = calls.build_template_call("web", "FROM podbay/base\n", b"", memory_mib=1024, vcpus=2, disk_mib=4096)
    assert call.data is not None
    assert {k: call.data[k] for k in ("memory_mib", "vcpus", "disk_mib")} == {
        "memory_mib": "1024", "vcpus": "2", "disk_mib": "4096"}
    plain = calls.build_template_call("web", "FROM podbay/base\n", b"")
    assert plain.data is not None and not {"memory_mib", "vcpus", "disk_mib"} & set(plain.data)


@pytest.mark.parametrize("cpu,mem,message", [
    (0, None, "CPU count must be at least 1"), (17, None, "at most 16"), (None, 64, "at least 128 MiB"),
    (None, 1025, "even number"), (None, 32768, "at most 16384"),
])
def test_e2b_resources_e2b_refuses_are_400(cpu: int | None, mem: int | None, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_resources(cpu, mem)
    assert info.value.http_status == 400 and message in info.value.message


def test_e2b_resources_it_accepts() -> None:
    check_resources(None, None)
    check_resources(2, 1024)
    check_resources(1, 128)


def test_an_agent_start_finds_builder_vms_and_resized_roots_boots(tmp_path: Path) -> None:
    builds = tmp_path / "builds"
    assert leftover_vm_dirs(builds) == []
    for d in ("bld_1", "bld_1.ctx", ".tmp-web-ab12cd34/vm", "rabcdef0123"):
        (builds / d).mkdir(parents=True)
    (builds / "rabcdef0123.img").write_bytes(b"")
    assert leftover_vm_dirs(builds) == [builds / ".tmp-web-ab12cd34" / "vm", builds / "bld_1",
                                        builds / "rabcdef0123"]
