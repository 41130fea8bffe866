"""Volume validation without servers: mount paths, sizes, the CLI/SDK mount spelling, placement with volumes."""

from __future__ import annotations

import pytest

from podbay.contracts.messages import NodeHeartbeat
from podbay.contracts.volumes import SYSTEM_DIRS, check_mount_path, parse_mount, parse_size
from podbay.errors import InvalidRequest
from podbay.sdk import _calls as calls
from podbay.sdk._volumes import create_volume_call
from podbay_scheduler.placement import NodeLoad, with_volumes


@pytest.mark.parametrize("path", ["/mnt/data", "/data", "/home/agent/repo", "/root/cache", "/srv/x", "/tmp/v",
                                  "/usrdata", "/etcetera"])
def test_allowed_paths(path: str) -> None:
    assert check_mount_path(path) is None


@pytest.mark.parametrize(("path", "why"), [
    ("mnt/data", "absolute"), ("", "absolute"), ("/", "whole system"), ("/mnt/data/", "normalised"),
    ("/mnt//data", "normalised"), ("/mnt/./data", "normalised"), ("/mnt/../etc", "normalised"),
    ("/usr/local/lib", "/usr"), ("/var/lib/x", "/var"), ("/dev", "/dev"),
])
def test_refused_paths(path: str, why: str) -> None:
    assert why in (check_mount_path(path) or "")


def test_every_system_directory_is_refused_at_and_under() -> None:
    for d in SYSTEM_DIRS:
        assert check_mount_path(d) and check_mount_path(d + "/sub")


@pytest.mark.parametrize(("text", "n"), [("10GiB", 10 << 30), ("512MiB", 512 << 20), ("1g", 10**9),
                                          ("2 TiB", 2 << 40), ("1048576", 1 << 20), ("1.5GiB", 3 << 29)])
def test_sizes(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "ten GiB", "-1GiB", "0", "10XB"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_mount_spelling() -> None:
    assert parse_mount("data:/mnt/data") == {"name": "data", "path": "/mnt/data", "readonly": False}
    assert parse_mount("m:/models:ro") == {"name": "m", "path": "/models", "readonly": True}
    assert parse_mount("m:/models:rw")["readonly"] is False
    for bad in ("data", "data:/a:rx", "a:b:c:d"):
        with pytest.raises(ValueError):
            parse_mount(bad)


def test_sdk_bodies_are_checked_before_any_round_trip() -> None:
    call = calls.create_sandbox("base", memory_mib=None, vcpus=None, metadata=None, wait=True,
                                volumes=["data:/mnt/data", {"name": "m", "path": "/models", "readonly": True}])
    assert call.json is not None and call.json["volumes"] == [
        {"name": "data", "path": "/mnt/data", "readonly": False}, {"name": "m", "path": "/models", "readonly": True}]
    plain = calls.create_sandbox("base", memory_mib=None, vcpus=None, metadata=None, wait=True)
    assert plain.json is not None and "volumes" not in plain.json  # a plain create keeps its shape
    with pytest.raises(InvalidRequest):
        calls.create_sandbox("base", memory_mib=None, vcpus=None, metadata=None, wait=True, volumes=["nopath"])
    with pytest.raises(InvalidRequest):
        calls.create_sandbox("base", memory_mib=None, vcpus=None, metadata=None, wait=True,
                             volumes=[f"v{i}:/d{i}" for i in range(5)])
    assert create_volume_call("data", "10GiB").json == {"name": "data", "size_bytes": 10 << 30}
    with pytest.raises(InvalidRequest):
        create_volume_call("data", "lots")
    with pytest.raises(InvalidRequest):
        create_volume_call("data", 1024)  # under the ext4 minimum


def _node(node_id: str) -> NodeLoad:
    hb = NodeHeartbeat.model_construct(node_id=node_id)
    return NodeLoad(heartbeat=hb, memory_used_mib=0, vcpus_used=0)


def test_a_sandbox_with_volumes_goes_to_their_node() -> None:
    nodes = [_node("a"), _node("b")]
    assert with_volumes(nodes, None) == nodes
    assert [n.node_id for n in with_volumes(nodes, "b")] == ["b"]
    assert with_volumes(nodes, "gone") == []
