"""Volumes on a node: ext4 filesystems in files on the node's btrfs store, put into a VM's volume slots.

A volume (table ``volumes``, API ``/v1/volumes``) lives on one node, in ``store/volumes/<volume id>.img``: a
sparse file of the volume's size with an ext4 filesystem, made by the first sandbox that attaches it here
(the scheduler binds an unbound volume to the node it places that sandbox on, so the API never waits for a
node to create one). Attachments are rows of ``sandbox_volumes`` (slot, path, read-only), written by the API
in the sandbox's create transaction; every start of the sandbox's VM on this node (create, wake, restore of
its own snapshot, restart) puts them back into the VM directory before QEMU starts:

- read-write: ``vol<slot>.img`` is a hard link to the volume's file (same inode, same btrfs), so the guest's
  writes land in the volume itself and survive the VM directory's removal;
- read-only: a reflink copy (~ms whatever the size), so no guest can change the volume's file, whatever it
  does to its device; the guest mounts it read-only.

The VMM then announces each slot's size and guestd mounts it (services/nodeagent/vm/vmm.py "Volume slots",
guestd/volumes.py). A volume deleted through the API is marked ``deleting``; :meth:`VolumeStore.sweep`
removes its file here and then its row, and the files of fork children's read-only views once their
sandbox is deleted.

Where a volume's file comes from when this node lacks it (:meth:`VolumeStore.prepare`): a volume with a
promoted snapshot (``volumes.snapshot_id``: it was suspended with its sandbox, its node was lost, or it was
restored to one) is fetched from object storage (:func:`podbay.volume_promotion.fetch_volume`); a fork
child's volume that has none yet is a reflink of the copy its parent's full snapshot took
(``volumes.origin``); any other is made empty. A file here older than
the volume's ``released_at`` (a release, or a restore to one of its snapshots through the API) is rebuilt from
the current promoted snapshot, starting from that file (only the chunks that differ are downloaded). A suspend promotes the
sandbox's read-write volumes while its guest is stopped (:meth:`VolumeStore.promote_for_suspend`), then
removes their files here and unbinds them (:meth:`VolumeStore.release_after_suspend`), so the wake may be
placed on any node, which becomes the volume's home. Errors: :class:`VolumeError` (``mkfs.ext4`` failed, no
room), and what a fetch raises (``SnapshotCorrupt``, ``StorageError``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from pathlib import Path

import asyncpg

from podbay import volume_state
from podbay.config import Settings
from podbay.contracts.channel import GuestVolume
from podbay.errors import NotFound, PodbayError
from podbay.naming import safe_component
from podbay.objstore import ObjectStore
from podbay.reflink import reflink_or_copy
from podbay.service import wait_stop
from podbay.volume_promotion import fetch_volume, snapshot_volume

from ..vm.vmm import VOLUME_SLOTS, volume_slot_name

__all__ = ["VolumeStore", "VolumeError", "make_volume_file", "sweep_loop"]

log = logging.getLogger("podbay.nodeagent.volumes")


class VolumeError(PodbayError):
    """A volume's file could not be made or attached; the message names the volume and the step."""

    code = "volume_failed"


def make_volume_file(path: Path, size_bytes: int, label: str) -> None:
    """Create ``path`` as a sparse file of ``size_bytes`` with an ext4 filesystem labelled ``label`` (at most
    16 characters). The file appears under its name only once complete. Raises :class:`VolumeError`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with open(tmp, "wb") as f:
        f.truncate(size_bytes)
    proc = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", label[:16], "-m", "0", str(tmp)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise VolumeError(f"mkfs.ext4 for {path.name} failed: {(proc.stderr or proc.stdout).strip()}")
    os.replace(tmp, path)


class VolumeStore:
    """The volumes of one node: ``root`` is ``store/volumes``; ``pool`` reads and updates their rows."""

    def __init__(self, root: Path, pool: asyncpg.Pool, node_id: str, *, objects: ObjectStore | None = None,
                 settings: Settings | None = None) -> None:
        """``objects`` and ``settings``: the node's object store and settings, for fetches and the suspend's
        promotions (both or neither; without them a volume that must come from object storage fails)."""
        self.root = root
        self.pool = pool
        self.node_id = node_id
        self.objects = objects
        self.settings = settings
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, volume_id: str) -> asyncio.Lock:
        """The volume's lock on this node: held while its file is mounted here for the volume content API
        (services/nodeagent/storage/volume_content.py) and while :meth:`attach` links it into a VM, so the two never
        overlap (an ext4 filesystem mounted twice is corrupted)."""
        return self._locks.setdefault(volume_id, asyncio.Lock())

    def path(self, volume_id: str) -> Path:
        return self.root / f"{safe_component(volume_id, 'volume id')}.img"

    async def prepare(self, sandbox_id: str) -> None:
        """Make sure each volume of the sandbox has its file here (module docstring: from a fork's copy, from
        object storage, or empty) and is bound to this node. Raises :class:`VolumeError`, ``SnapshotCorrupt``,
        ``StorageError``."""
        rows = await self.pool.fetch(
            "SELECT v.id, v.name, v.size_bytes, v.node_id, v.snapshot_id, v.origin, v.released_at FROM sandbox_volumes sv"
            " JOIN volumes v ON v.id = sv.volume_id WHERE sv.sandbox_id = $1 ORDER BY sv.slot", sandbox_id)
        for r in rows:
            await self._prepare_row(r)

    async def prepare_volume(self, volume_id: str) -> None:
        """:meth:`prepare` for one volume, without a sandbox (the volume content API): its file here, bound to
        this node. Raises ``NotFound`` when no such volume is available, and what :meth:`prepare` raises."""
        r = await self.pool.fetchrow(
            "SELECT id, name, size_bytes, node_id, snapshot_id, origin, released_at FROM volumes"
            " WHERE id = $1 AND state = 'available'", volume_id)
        if r is None:
            raise NotFound(f"volume {volume_id} was not found")
        await self._prepare_row(r)

    async def _prepare_row(self, r: asyncpg.Record) -> None:
        """One volume's part of :meth:`prepare` (``r``: its row)."""
        if r["node_id"] not in (None, self.node_id):
            raise VolumeError(f"volume {r['name']} lives on node {r['node_id']}, not here ({self.node_id})")
        src = self.path(r["id"])
        if r["released_at"] is not None and r["snapshot_id"] is not None and src.exists() and \
                src.stat().st_mtime < r["released_at"].timestamp():
            # Left here before the volume was released (this node was lost and came back) or restored to
            # one of its snapshots: its truth is that promoted snapshot now. The old file is the base of
            # the rebuild, so only the chunks that differ are downloaded.
            log.info("volume %s (%s): the file here predates its release or restore; rebuilding it from "
                     "snapshot %s", r["name"], r["id"], r["snapshot_id"])
            if self.objects is None or self.settings is None:
                raise VolumeError(f"volume {r['name']}: the node's object store is not open")
            res = await fetch_volume(self.pool, self.objects, self.settings, r["id"], src, base=src)
            log.info("volume %s (%s): rebuilt here (%d of %d chunks downloaded)", r["name"], r["id"],
                     res.chunks_downloaded, res.chunks)
        if not src.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            # A promoted snapshot is newer than a fork's copy (it is taken of the volume's own file, which
            # starts as that copy), so it wins once there is one: a copy volume suspended, restored or
            # released keeps its writes since the fork.
            if r["snapshot_id"] is not None and self.objects is not None and self.settings is not None:
                res = await fetch_volume(self.pool, self.objects, self.settings, r["id"], src)
                how = f"fetched from object storage ({res.chunks_downloaded} of {res.chunks} chunks downloaded)"
            elif r["snapshot_id"] is None and r["origin"] is not None and (self.root.parent / r["origin"]).exists():
                await asyncio.to_thread(reflink_or_copy, self.root.parent / r["origin"], src)
                how = "copied from its fork's snapshot"
            elif r["snapshot_id"] is not None or r["origin"] is not None:
                raise VolumeError(f"volume {r['name']}: its data is neither here nor reachable")
            else:
                await asyncio.to_thread(make_volume_file, src, r["size_bytes"], r["name"])
                how = "created here"
            log.info("volume %s (%s): %s, %d bytes", r["name"], r["id"], how, r["size_bytes"])
        if r["node_id"] is None:
            await volume_state.place(self.pool, r["id"], self.node_id)

    async def promote_for_suspend(self, sandbox_id: str) -> str | None:
        """Snapshot and promote each read-write volume of the sandbox (its guest is stopped, so the copy
        matches the memory snapshot). Returns an error message, or None when all are promoted."""
        if self.objects is None or self.settings is None:
            return "the node's object store is not open"
        rows = await self.pool.fetch(
            "SELECT v.id, v.name FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id"
            " WHERE sv.sandbox_id = $1 AND NOT sv.readonly AND v.node_id = $2", sandbox_id, self.node_id)
        for r in rows:
            if not self.path(r["id"]).exists():
                continue  # released by an earlier try of this suspend: its promoted snapshot stands
            try:
                await snapshot_volume(self.pool, self.objects, self.settings, r["id"], node_id=self.node_id,
                                      source=self.path(r["id"]), work_dir=self.root.parent / "volume-snapshots",
                                      reason="suspend")
            except Exception as exc:
                why = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
                return f"volume {r['name']} was not promoted: {why}"
        return None

    async def release_after_suspend(self, sandbox_id: str) -> None:
        """Remove the files of the sandbox's promoted read-write volumes here and unbind them, so its wake
        (or a later sandbox) fetches them on whichever node it is placed."""
        rows = await self.pool.fetch(
            "SELECT v.id FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id WHERE sv.sandbox_id = $1"
            " AND NOT sv.readonly AND v.node_id = $2 AND v.snapshot_id IS NOT NULL", sandbox_id, self.node_id)
        for r in rows:
            await asyncio.to_thread(self.path(r["id"]).unlink, True)
            await volume_state.release(self.pool, r["id"], self.node_id)

    async def attach(self, sandbox_id: str, vm_dir: Path) -> list[GuestVolume]:
        """Put the sandbox's attached volumes into ``vm_dir``'s slots (module docstring); returns what guestd
        is to mount. A volume bound to another node is refused (the scheduler places its sandboxes with it).
        Raises :class:`VolumeError`."""
        await self.prepare(sandbox_id)
        rows = await self.pool.fetch(
            "SELECT sv.slot, sv.path, sv.readonly, v.id, v.name FROM sandbox_volumes sv"
            " JOIN volumes v ON v.id = sv.volume_id WHERE sv.sandbox_id = $1 ORDER BY sv.slot", sandbox_id)
        out: list[GuestVolume] = []
        for r in rows:
            if r["slot"] >= VOLUME_SLOTS:
                raise VolumeError(f"volume {r['name']}: slot {r['slot']} beyond the machine's {VOLUME_SLOTS}")
            src = self.path(r["id"])
            slot_file = vm_dir / volume_slot_name(r["slot"])
            vm_dir.mkdir(parents=True, exist_ok=True)
            slot_file.unlink(missing_ok=True)
            async with self.lock(r["id"]):  # not while the volume content API has it mounted
                if r["readonly"]:
                    await asyncio.to_thread(reflink_or_copy, src, slot_file)
                else:
                    os.link(src, slot_file)
            out.append(GuestVolume(slot=r["slot"], path=r["path"], readonly=r["readonly"]))
        return out

    async def roll_back(self, sandbox_id: str, snapshot_dir: Path) -> None:
        """Put the sandbox's read-write volumes back to their copies in its full snapshot ``snapshot_dir``
        (``vol<slot>.img``, taken while the guest was stopped), asked for with the rollback. The sandbox's VM
        is stopped; each file is replaced whole (reflink to a temporary name, then rename). Raises
        :class:`VolumeError` when the snapshot holds no copy of a volume."""
        rows = await self.pool.fetch(
            "SELECT sv.slot, v.id, v.name FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id"
            " WHERE sv.sandbox_id = $1 AND NOT sv.readonly ORDER BY sv.slot", sandbox_id)
        for r in rows:
            copy = snapshot_dir / volume_slot_name(r["slot"])
            if not copy.exists():
                raise VolumeError(f"the snapshot holds no copy of volume {r['name']} (taken before volumes were "
                                  "copied, or the volume was attached later)")
        for r in rows:
            dst = self.path(r["id"])
            tmp = dst.with_name(f".{dst.name}.rollback")
            await asyncio.to_thread(reflink_or_copy, snapshot_dir / volume_slot_name(r["slot"]), tmp)
            os.replace(tmp, dst)
            log.info("volume %s (%s) rolled back with sandbox %s", r["name"], r["id"], sandbox_id)

    async def view_paths(self, sandbox_id: str) -> list[str]:
        """Guest paths of the sandbox's read-only views (a fork child's view of its parent's read-write
        volume): its memory, the parent's, has them mounted read-write, so the fork remounts them read-only."""
        rows = await self.pool.fetch(
            "SELECT sv.path FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id"
            " WHERE sv.sandbox_id = $1 AND v.state = 'view' ORDER BY sv.slot", sandbox_id)
        return [r["path"] for r in rows]

    async def sweep(self) -> int:
        """Remove the files of this node's volumes marked ``deleting`` (none attached any more), then their
        rows; returns how many. A file already gone is fine (a crash between the two steps)."""
        # A fork child's read-only view goes with its sandbox.
        await volume_state.mark_views_of_deleted_sandboxes(self.pool, self.node_id)
        rows = await self.pool.fetch(
            "SELECT id FROM volumes WHERE state = 'deleting' AND node_id = $1", self.node_id)
        for r in rows:
            await asyncio.to_thread(self.path(r["id"]).unlink, True)
            await volume_state.remove_deleted(self.pool, r["id"])
        return len(rows)


async def sweep_loop(volumes: VolumeStore, stop: asyncio.Event, period_s: float = 5.0) -> None:
    """:meth:`VolumeStore.sweep` every ``period_s`` until ``stop``; errors are logged and the loop goes on."""
    while not stop.is_set():
        if await wait_stop(stop, period_s):
            return
        try:
            if n := await volumes.sweep():
                log.info("removed %d deleted volume(s)", n)
        except Exception as exc:  # the next tick retries; a sweep must never end the agent
            log.warning("volume sweep failed: %r", exc)
