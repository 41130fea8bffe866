"""Node-local storage on btrfs (docs/DESIGN.md §2, §3): template copies and per-sandbox VM directories.

The store lives at ``DATA_DIR/nodes/<node>/store``. When that directory is not on btrfs, the node agent
creates a sparse loop-backed btrfs file (``DATA_DIR/nodes/<node>/store.btrfs``, ``node_store_size_gib``)
and mounts it there, and says so; a restart finds it mounted (or mounts it again). Reflinks
(``cp --reflink=always``, ~2.5 ms whatever the size) make every sandbox's disk and RAM files copies that
cost nothing until written.

Layout::

    store/templates/<name>/<digest>/{template.json, state, ram, disk.img, vmlinuz, initrd.img}
    store/sandboxes/<sandbox id>/{disk.img, ram, vol0.img..vol3.img, run/qmp.sock, run/channel.sock, console.log,
                                  qemu.pid, meta.json}
    store/volumes/<volume id>.img          (ext4 in a sparse file; volumes.py)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from podbay.naming import safe_component

__all__ = ["NodeStore", "StoreError", "fs_type", "ensure_btrfs"]

log = logging.getLogger("podbay.nodeagent.store")


class StoreError(Exception):
    """The node store could not be prepared; the message names the step and the command's output."""


def fs_type(path: Path) -> str:
    """The filesystem type of ``path`` (e.g. ``btrfs``, ``ext4``, ``overlay``), from ``stat -f``."""
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _run(step: str, argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise StoreError(f"{step} failed ({' '.join(argv)}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0


def ensure_btrfs(mount_dir: Path, image: Path, size_gib: int) -> bool:
    """Make ``mount_dir`` a btrfs filesystem; returns True when a loop-backed file was (re)used.

    Raises ``StoreError`` when btrfs-progs is missing or mounting fails (e.g. no loop devices).
    """
    mount_dir.mkdir(parents=True, exist_ok=True)
    if fs_type(mount_dir) == "btrfs":
        return _is_mountpoint(mount_dir) and image.exists()
    if shutil.which("mkfs.btrfs") is None:
        raise StoreError("mkfs.btrfs not found: install Debian btrfs-progs (scripts/setup.sh does)")
    if not image.exists():
        log.info("data directory is not on btrfs: creating a %d GiB loop-backed btrfs file at %s", size_gib, image)
        with open(image, "wb") as f:
            f.truncate(size_gib << 30)
        _run("mkfs.btrfs", ["mkfs.btrfs", "-q", "-L", "podbay", str(image)])
    else:
        log.info("mounting the loop-backed btrfs file %s", image)
    _run("mount", ["mount", "-o", "loop,noatime", str(image), str(mount_dir)])
    if fs_type(mount_dir) != "btrfs":
        raise StoreError(f"{mount_dir} is not btrfs after mounting {image}")
    return True


class NodeStore:
    """Paths of one node's store; ``prepare()`` makes sure it is on btrfs."""

    def __init__(self, data_dir: Path, node_id: str, size_gib: int) -> None:
        self.node_dir = data_dir / "nodes" / safe_component(node_id, "node id")
        self.root = self.node_dir / "store"
        self.image = self.node_dir / "store.btrfs"
        self.size_gib = size_gib
        self.loop_backed = False

    def prepare(self) -> None:
        """Mount or create the btrfs store and its top-level folders. Raises ``StoreError``."""
        self.node_dir.mkdir(parents=True, exist_ok=True)
        self.loop_backed = ensure_btrfs(self.root, self.image, self.size_gib)
        # Only root walks the store: a confined QEMU's user must not reach other VMs or templates even if it
        # left its mount namespace; it gets its own VM directory by a bind mount (confine.py).
        os.chmod(self.root, 0o700)
        self.templates_dir.mkdir(exist_ok=True)
        self.sandboxes_dir.mkdir(exist_ok=True)
        self.volumes_dir.mkdir(exist_ok=True)

    @property
    def templates_dir(self) -> Path:
        return self.root / "templates"

    @property
    def sandboxes_dir(self) -> Path:
        return self.root / "sandboxes"

    @property
    def volumes_dir(self) -> Path:
        return self.root / "volumes"

    @property
    def snapshots_dir(self) -> Path:
        """``<root>/snapshots``: a folder per sandbox, a folder per snapshot in it (services/nodeagent/storage/snapshots.py)."""
        return self.root / "snapshots"

    # Ids and names arrive in messages (checked there: podbay.naming.SafeId); each is checked again where it
    # becomes a path, so a value that skipped a contract raises UnsafeName instead of leaving the store.

    def sandbox_snapshots_dir(self, sandbox_id: str) -> Path:
        """``<root>/snapshots/<sandbox>``: every snapshot of ``sandbox_id`` on this node."""
        return self.snapshots_dir / safe_component(sandbox_id, "sandbox id")

    def snapshot_dir(self, sandbox_id: str, snapshot_id: str) -> Path:
        """Where snapshot ``snapshot_id`` of ``sandbox_id`` keeps its files on this node."""
        return self.sandbox_snapshots_dir(sandbox_id) / safe_component(snapshot_id, "snapshot id")

    def template_dir(self, name: str, digest: str) -> Path:
        return self.templates_dir / safe_component(name, "template name") / safe_component(digest, "template digest")

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / safe_component(sandbox_id, "sandbox id")

    def build_dir(self, build_id: str) -> Path:
        """``<root>/builds/<build>``: a template build's builder VM; its context is beside it (``.ctx``)."""
        return self.root / "builds" / safe_component(build_id, "build id")

    def sandbox_ids_on_disk(self) -> list[str]:
        return sorted(p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()) if self.sandboxes_dir.exists() else []
