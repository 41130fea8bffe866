"""A create's ``disk_mib`` (issue 17): the API's bounds (services/api/services/sandbox_service.check_disk_mib), the
request shape the SDK sends, and the node's growth steps (services/nodeagent/storage/diskgrow.py) against tiny fakes
of the VM handle and guest channel (the real resize runs in tests/e2e/test_sandbox_disk.py)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
import pytest
from pydantic import ValidationError

from podbay.config import Settings
from podbay.contracts.api import SandboxCreate
from podbay.contracts.channel import ExecExit, ExecSpec
from podbay.errors import Unprocessable
from podbay.sdk import _calls as calls
from podbay_api.app import create_app
from podbay_api.services.sandbox_service import InvalidDiskSize, check_disk_mib
from podbay_nodeagent.storage.diskgrow import GROW_SCRIPT, DiskGrowError, grow_root

MIB = 1 << 20


def test_disk_mib_at_least_the_templates_and_at_most_the_limit() -> None:
    check_disk_mib(2048, 2048 * MIB, 4096)  # the template's own size
    check_disk_mib(4096, 2048 * MIB, 4096)  # the limit itself
    check_disk_mib(100, None, 4096)  # template size unknown here: the node checks
    with pytest.raises(InvalidDiskSize) as small:
        check_disk_mib(2047, 2048 * MIB, 4096)
    assert small.value.http_status == 422 and small.value.code == "invalid_disk_size"
    assert small.value.details == {"disk_mib": 2047, "template_disk_mib": 2048}
    with pytest.raises(InvalidDiskSize) as big:
        check_disk_mib(4097, 2048 * MIB, 4096)
    assert big.value.details == {"disk_mib": 4097, "max_disk_mib": 4096}
    assert isinstance(big.value, Unprocessable)
    with pytest.raises(InvalidDiskSize):  # a template disk of a partial MiB rounds up
        check_disk_mib(2048, 2048 * MIB + 1, 4096)


def test_request_field_bounds_and_sdk_body() -> None:
    with pytest.raises(ValidationError):
        SandboxCreate(template="base", disk_mib=0)
    assert SandboxCreate(template="base").disk_mib is None
    body = calls.create_sandbox("base", memory_mib=None, vcpus=None, metadata=None, wait=True, disk_mib=3000).json
    assert body == {"template": "base", "disk_mib": 3000, "metadata": {}}
    body = calls.create_sandbox("base", memory_mib=None, vcpus=None, metadata=None, wait=True).json
    assert "disk_mib" not in body


class _Handle:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def resize_root(self, size: int) -> None:
        self.sizes.append(size)


class _Channel:
    def __init__(self, exit_code: int, output: bytes = b"") -> None:
        self.exit_code, self.output = exit_code, output
        self.specs: list[ExecSpec] = []

    async def run(self, spec: ExecSpec) -> tuple[bytes, bytes, ExecExit]:
        self.specs.append(spec)
        return self.output, b"", ExecExit(exit_code=self.exit_code, pid=1)


def _disk(tmp_path: Path, size: int) -> Path:
    disk = tmp_path / "disk.img"
    with disk.open("wb") as f:
        f.truncate(size)
    return disk


def test_grow_root_resizes_the_device_then_the_filesystem_as_root(tmp_path: Path) -> None:
    disk, handle, ch = _disk(tmp_path, 64 * MIB), _Handle(), _Channel(0)
    ms = asyncio.run(grow_root(handle, ch, disk, 128 * MIB))  # type: ignore[arg-type]
    assert ms is not None and handle.sizes == [128 * MIB]
    (spec,) = ch.specs
    assert spec.user == "root" and spec.argv == ["/bin/sh", "-c", GROW_SCRIPT, "grow", str(128 * MIB // 512)]


def test_grow_root_nothing_when_already_that_size_and_never_shrinks(tmp_path: Path) -> None:
    disk, handle, ch = _disk(tmp_path, 64 * MIB), _Handle(), _Channel(0)
    assert asyncio.run(grow_root(handle, ch, disk, 64 * MIB)) is None  # type: ignore[arg-type]
    with pytest.raises(DiskGrowError):
        asyncio.run(grow_root(handle, ch, disk, 32 * MIB))  # type: ignore[arg-type]
    assert handle.sizes == [] and ch.specs == []


def test_grow_root_failure_carries_the_guests_output(tmp_path: Path) -> None:
    disk, handle, ch = _disk(tmp_path, 64 * MIB), _Handle(), _Channel(127, b"sh: resize2fs: not found\n")
    with pytest.raises(DiskGrowError) as err:
        asyncio.run(grow_root(handle, ch, disk, 128 * MIB))  # type: ignore[arg-type]
    assert "resize2fs: not found" in err.value.message and err.value.details["exit_code"] == 127


def test_grow_script_waits_for_the_new_capacity_then_resizes() -> None:
    # The script is POSIX sh: check its syntax with the host's sh (it runs in guests with busybox too).
    out = subprocess.run(["sh", "-n", "-c", GROW_SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "/sys/block/vda/size" in GROW_SCRIPT and "resize2fs /dev/vda" in GROW_SCRIPT


def test_the_create_route_documents_invalid_disk_size() -> None:
    # The API's OpenAPI document (docs/openapi.json) is what client generators read: a create's 422
    # invalid_disk_size must be there, in the error shape the API answers with.
    responses = create_app(Settings()).openapi()["paths"]["/v1/sandboxes"]["post"]["responses"]
    assert "invalid_disk_size" in responses["422"]["description"]
    assert responses["422"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert {"400", "404", "409", "503"} <= set(responses)
