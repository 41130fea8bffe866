"""A small loop-mounted btrfs filesystem for tests that need reflinks and extent maps (root, btrfs-progs)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def btrfs_dir(tmp: Path, size_mib: int = 256) -> Iterator[Path]:
    """A directory on a fresh btrfs filesystem of ``size_mib`` MiB (a sparse image under ``tmp``), unmounted
    afterwards. Skips the test where it cannot be made (not root, no mkfs.btrfs, no loop devices)."""
    image, mnt = tmp / "fs.btrfs", tmp / "mnt"
    if shutil.which("mkfs.btrfs") is None:
        pytest.skip("mkfs.btrfs is not installed")
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    mnt.mkdir()
    if subprocess.run(["mkfs.btrfs", "-q", str(image)], capture_output=True).returncode != 0:
        pytest.skip("mkfs.btrfs failed")
    if subprocess.run(["mount", "-o", "loop,noatime", str(image), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot loop-mount a btrfs image here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
