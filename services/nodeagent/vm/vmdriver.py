"""The node agent's view of the VMM: templates in the store, restore, attach, kill, detach.

A thin layer over ``vmm.QemuVmm`` that binds it to this node's store and settings, so the sandbox manager
deals in sandboxes and templates rather than QEMU arguments. Templates are built into the build cache by
``podbay template build`` (``template.prepare_template``); at start the agent copies each one's newest
snapshot into its btrfs store once (``store/templates/<name>/<key>``) so that every restore reflinks from
the same filesystem, and registers it in PostgreSQL (``templates``, ``node_templates``). Earlier keys stay in
the store: a sandbox keeps the template build it was created from (its ``template_digest``), and
``find_template`` loads such an older build when the sandbox is restored, forked or woken.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from podbay import template_state
from podbay.config import Settings

from . import confine
from ..storage.store import NodeStore
from ..build.template import MACHINE, TemplateSnapshot, guest_aslr
from .vmm import QemuVmm, VmProcess, Vmm, reflink_or_copy

__all__ = ["TemplateImage", "VmHandle", "VmDriver"]

log = logging.getLogger("podbay.nodeagent.vmdriver")

#: Advisory lock namespace ("pbtr") of a cached template's registration, keyed by the template's name.
TEMPLATE_REGISTER_LOCK_NS = 0x70627472
_TEMPLATE_FILES = ("template.json", "state", "ram", "disk.img", "vmlinuz", "initrd.img")


@dataclass(frozen=True)
class TemplateImage:
    """A template snapshot in this node's store. ``digest`` is the snapshot key (image, QEMU, accel, size)."""

    name: str
    digest: str
    snapshot: TemplateSnapshot


class VmHandle:
    """One VM of this node agent (a sandbox, warm slot or build): the VMM's :class:`vmm.VmProcess` bound to
    the VMM that owns it, so callers hold one object. Its QEMU pid, channel socket, and how to kill, detach
    from or wait for it."""

    def __init__(self, vmm: Vmm, process: VmProcess) -> None:
        self._vmm = vmm
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def channel_path(self) -> Path:
        return self.process.paths.channel

    async def kill(self) -> None:
        """SIGKILL QEMU and wait for it (bounded)."""
        await self._vmm.kill(self.process)

    async def wait_exit(self) -> int | None:
        """Wait until QEMU exits; its exit status (negative signal number) when known."""
        return await self._vmm.wait_exit(self.process)

    async def pause(self) -> None:
        """QMP ``stop``: the vCPUs stop; memory and devices stay as they are (docs/DESIGN.md §3: 1-2 ms)."""
        await self._vmm.pause(self.process)

    async def resume(self) -> None:
        """QMP ``cont``."""
        await self._vmm.resume(self.process)

    async def set_nice(self, nice: int) -> None:
        """Every QEMU thread to nice value ``nice`` (``vmm.set_nice``)."""
        await self._vmm.set_nice(self.process, nice)

    async def status(self) -> str:
        """QMP ``query-status``: ``running``, ``paused``, ``inmigrate``, ..."""
        return await self._vmm.query_status(self.process)

    async def detach(self) -> None:
        """Drop the QMP connection and leave QEMU running (a later ``attach`` picks it up)."""
        await self._vmm.detach(self.process)

    async def resize_root(self, size: int) -> None:
        """QMP ``block_resize`` of the root disk to ``size`` bytes: QEMU extends ``disk.img`` (sparse) and
        raises the device's config-change interrupt, so the running guest reads the new capacity (as the
        volume slots do after a restore, vmm.py). Raises ``VmOperationError`` when QEMU refuses (smaller)."""
        await self._vmm.execute(self.process, "block_resize", {"device": "root", "size": size})


class VmDriver:
    """Binds a :class:`vmm.Vmm` (``QemuVmm``; a fake in unit tests) to a node store; ``accel`` is the accelerator
    its templates were snapshotted under."""

    def __init__(self, settings: Settings, store: NodeStore, vmm: Vmm) -> None:
        self.settings = settings
        self.store = store
        self.vmm = vmm
        self.accel: str = settings.accel if settings.accel != "auto" else "unknown"

    @classmethod
    async def create(cls, settings: Settings, store: NodeStore) -> VmDriver:
        """Raises ``confine.ConfinementError`` at start when QEMU should be confined but cannot be (no bwrap)."""
        return cls(settings, store, QemuVmm(confinement=await asyncio.to_thread(confine.from_settings, settings)))

    def _cached_templates(self) -> dict[str, Path]:
        """The snapshot directory to use per template name in the build cache: of the builds this machine can
        load, the newest of those made with this node's settings (memory, vCPUs, the guest's ASLR), else the
        newest. The cache keeps a build per set of inputs, and a build made again is only reused, not
        rewritten, so the newest file is not always the build the settings ask for (switching
        ``PODBAY_GUEST_ASLR`` back to a value built before would otherwise keep the other build)."""
        root = self.settings.cache_dir / "templates"
        best: dict[str, tuple[tuple[bool, float], Path]] = {}
        if not root.exists():
            return {}
        for meta in root.glob("*/template.json"):
            try:
                tpl = TemplateSnapshot.load(meta.parent)
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable template %s: %s", meta.parent, exc)
                continue
            if self.settings.accel != "auto" and tpl.accel != self.settings.accel:
                continue
            if tpl.machine != MACHINE:
                continue  # booted with other devices: its device state would not load on this machine
            rank = (self._as_configured(tpl), meta.stat().st_mtime)
            if tpl.name not in best or rank > best[tpl.name][0]:
                best[tpl.name] = (rank, meta.parent)
        return {name: p for name, (_, p) in best.items()}

    def _as_configured(self, tpl: TemplateSnapshot) -> bool:
        """Whether ``tpl`` was built as this node's settings would build it now."""
        s = self.settings
        return (tpl.memory_mib == s.sandbox_memory_mib and tpl.vcpus == s.sandbox_vcpus
                and tpl.guest_aslr == guest_aslr(s, tpl.accel))

    def _import(self, name: str, src: Path) -> TemplateImage:
        tpl = TemplateSnapshot.load(src)
        dest = self.store.template_dir(name, tpl.key)
        if not (dest / "template.json").exists():
            tmp = dest.with_name(dest.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            for f in _TEMPLATE_FILES:
                reflink_or_copy(src / f, tmp / f)
            os.replace(tmp, dest)
            log.info("imported template %s (%s) into the node store", name, tpl.key[:12])
        return TemplateImage(name=name, digest=tpl.key, snapshot=TemplateSnapshot.load(dest))

    def find_template(self, name: str, digest: str) -> TemplateImage | None:
        """Build ``digest`` of template ``name`` from the store (``store/templates/<name>/<digest>``), or else
        imported from the build cache when a cached build has that key; None when neither holds it.
        Blocking file I/O (run it in a thread)."""
        dest = self.store.template_dir(name, digest)
        if (dest / "template.json").exists():
            return TemplateImage(name=name, digest=digest, snapshot=TemplateSnapshot.load(dest))
        root = self.settings.cache_dir / "templates"
        for meta in root.glob("*/template.json") if root.exists() else ():
            try:
                tpl = TemplateSnapshot.load(meta.parent)
            except (OSError, ValueError):
                continue  # _cached_templates already warned about it
            if tpl.name == name and tpl.key == digest:
                return self._import(name, meta.parent)
        return None

    async def import_templates(self, pool: asyncpg.Pool) -> dict[str, TemplateImage]:
        """Copy cached templates into the store (once per key) and upsert ``templates``; returns them by name."""
        out: dict[str, TemplateImage] = {}
        for name, src in self._cached_templates().items():
            img = await asyncio.to_thread(self._import, name, src)
            out[name] = img
            self.accel = img.snapshot.accel
            await register_cached_template(pool, name, img.digest, img.snapshot.memory_mib, img.snapshot.vcpus,
                                           img.snapshot.disk.stat().st_size)
        return out

    async def load_built_templates(self, pool: asyncpg.Pool) -> dict[str, TemplateImage]:
        """Templates built through the API (``templates.parent`` set, not deleted) whose current build is in
        this node's store (build/builder.py installs them there) and was made for this machine; returns them
        by name."""
        rows = await pool.fetch("SELECT name, digest FROM templates WHERE parent IS NOT NULL AND deleted_at IS NULL")
        out: dict[str, TemplateImage] = {}
        for r in rows:
            dest = self.store.template_dir(r["name"], r["digest"])
            if not (dest / "template.json").exists():
                continue
            snap = await asyncio.to_thread(TemplateSnapshot.load, dest)
            if snap.machine != MACHINE or (self.settings.accel != "auto" and snap.accel != self.settings.accel):
                # Snapshotted with another device set or accelerator (its FROM was rebuilt since): its device
                # state would not load here. Left out until it is built again.
                log.warning("template %s (%s) was built for machine %r/%s, not %r: build it again to use it",
                            r["name"], r["digest"][:12], snap.machine, snap.accel, MACHINE)
                continue
            out[r["name"]] = TemplateImage(name=r["name"], digest=r["digest"], snapshot=snap)
        return out

    @staticmethod
    async def register_node_templates(pool: asyncpg.Pool, node_id: str, templates: dict[str, TemplateImage]) -> None:
        """Record which templates this node holds (its ``nodes`` row must exist)."""
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM node_templates WHERE node_id=$1", node_id)
            for img in templates.values():
                await conn.execute("INSERT INTO node_templates (node_id, template, digest) VALUES ($1,$2,$3)",
                                   node_id, img.name, img.digest)

    async def restore(self, tpl: TemplateImage, vm_dir: Path, *, memory_mib: int, vcpus: int,
                      tap_fd: int | None = None) -> VmHandle:
        """Restore ``tpl``'s snapshot into ``vm_dir`` and run it (docs/DESIGN.md §3: reflink RAM + disk, incoming).
        ``tap_fd``: the sandbox's tap (network.py), inherited by QEMU; None leaves the NIC unconnected."""
        config = tpl.snapshot.vm_config(self.settings, memory_mib=memory_mib, vcpus=vcpus)
        process = await self.vmm.restore(tpl.snapshot.dir, vm_dir, config, tap_fd=tap_fd)
        return VmHandle(self.vmm, process)

    async def restore_from(self, snapshot_dir: Path, tpl: TemplateImage, vm_dir: Path, *, memory_mib: int,
                           vcpus: int, paused: bool = False, tap_fd: int | None = None, nice: int = 0) -> VmHandle:
        """Restore a sandbox's own full snapshot (``state``, ``ram``, ``disk.img``) with ``tpl``'s kernel.
        ``nice``: the nice value QEMU starts with (``VmConfig.nice``)."""
        config = tpl.snapshot.vm_config(self.settings, memory_mib=memory_mib, vcpus=vcpus)
        if nice:
            config = config.model_copy(update={"nice": nice})
        return VmHandle(self.vmm, await self.vmm.restore(snapshot_dir, vm_dir, config, paused=paused,
                                                         tap_fd=tap_fd))

    async def boot_disk(self, disk: Path, tpl: TemplateImage, vm_dir: Path, *, memory_mib: int,
                        vcpus: int, tap_fd: int | None = None) -> VmHandle:
        """Fresh boot of ``tpl``'s kernel on a reflink of ``disk`` (rollback to a disk-only snapshot)."""
        vm_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(reflink_or_copy, disk, vm_dir / "disk.img")
        config = tpl.snapshot.vm_config(self.settings, memory_mib=memory_mib, vcpus=vcpus)
        return VmHandle(self.vmm, await self.vmm.boot(config, vm_dir, tap_fd=tap_fd))

    async def snapshot_full(self, handle: VmHandle, dest: Path, *, leave_stopped: bool) -> float:
        """Memory, device state and disk into ``dest`` (docs/DESIGN.md §3); returns the ms the guest was paused."""
        res = await self.vmm.snapshot_full(handle.process, dest, leave_stopped=leave_stopped)
        return res.paused_ms

    async def attach(self, vm_dir: Path) -> VmHandle:
        """Re-attach to the QEMU still running for ``vm_dir``; raises ``VmGone`` when there is none."""
        return VmHandle(self.vmm, await self.vmm.attach(vm_dir))



async def register_cached_template(pool: asyncpg.Pool, name: str, digest: str, memory_mib: int, vcpus: int,
                                   size_bytes: int) -> None:
    """Upsert the ``templates`` row of a cached template (``name``, its ``digest``, its VM's MiB and vCPUs, its
    disk's size in bytes), as every node does at start for what its cache holds; see
    :func:`register_cached_template_in`."""
    async with pool.acquire() as conn, conn.transaction():
        await register_cached_template_in(conn, name, digest, memory_mib, vcpus, size_bytes)


async def register_cached_template_in(conn: asyncpg.Connection, name: str, digest: str, memory_mib: int,
                                      vcpus: int, size_bytes: int) -> None:
    """:func:`register_cached_template` inside the caller's transaction on ``conn``.

    Nodes starting together register the same cached template at once. ``ON CONFLICT (name)`` arbitrates only
    the name: an insert that meets another transaction's uncommitted row of that name goes on to the (owner,
    alias) index of migration 0037, waits there for the other to commit, and then fails with a unique
    violation (a second node of a fresh stack failed its start so). A lock per name, held to the end of the
    transaction, lets one registration at a time in; the next sees the committed row and updates it."""
    await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", TEMPLATE_REGISTER_LOCK_NS, name)
    await template_state.register_cached(conn, name, digest, memory_mib, vcpus, size_bytes)
