"""Snapshots, rollback and fork on the node (docs/DESIGN.md §3, §5).

Files live in ``store/snapshots/<sandbox>/<snapshot>/`` (``state``, ``ram``, ``disk.img`` for a full
snapshot; ``disk.img`` for a disk one), written into ``<snapshot>.part`` and renamed when complete, and
the ``snapshots`` row turns ``ready`` only after that, in one transaction with its event. So a crash
never lists a half snapshot; ``reconcile`` marks this node's ``creating`` rows failed and removes their
``.part`` directories.

- disk snapshot: guestd syncs and freezes the filesystems (FIFREEZE), the disk is reflinked, guestd thaws;
  the time the guest is held is measured (``paused_ms``). A paused guest is not frozen (it cannot answer);
  its disk is reflinked as it stands.
- full snapshot: write the RAM file's dirty pages back while the guest runs, then QMP ``stop``, migrate
  the device state to a file (``x-ignore-shared``: RAM stays in its file), reflink RAM and disk, ``cont``
  (a paused sandbox stays paused).
- rollback: stop the current VM, then restore the full snapshot (or boot fresh on the disk snapshot) at
  the new generation; event ``restored``.
- fork: (take a full snapshot, then) start each child from it with its own hostname, RNG seed and clock,
  and its views of the parent's read-write volumes remounted read-only; one child failing does not stop the
  others; event ``forked`` on the parent, ``started`` on each child.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podbay.contracts.events import EventType
from podbay.contracts.channel import ExecSpec
from podbay.contracts.messages import ForkCmd, Resources, RestoreCmd, SnapshotCmd
from podbay.errors import PodbayError
from podbay.extents import Extent, differing_ranges, extents_equal_files, fiemap, same_extents
from podbay.outbox import emit_sandbox_event
from podbay.telemetry import LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS
from podbay import snapshot_state
from podbay import operation_state

if TYPE_CHECKING:
    from ..vm.vmhost import RunningVm, VmHost

__all__ = ["SnapshotOps"]

log = logging.getLogger("podbay.nodeagent.snapshots")

# How long guestd keeps a filesystem-only auto-pause's freeze before thawing by itself (guest time): longer
# than the snapshot and the pause take, so the freeze lasts until the guest stops.
FS_PAUSE_FREEZE_S = 30.0
THAW_BYTES = 4096  # block 0 of the guest's disk: what a filesystem thaw rewrites (the ext4 superblock), no file data
FORK_CONCURRENCY = 2  # children restored at once; each restore is CPU-bound under TCG


def _flush(path: Path) -> None:
    """fdatasync ``path`` (a blocking write-back; run it in a thread)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _same_map(path: Path, extents: list[Extent]) -> bool:
    """Whether ``path`` has exactly the extent map ``extents`` (False when it cannot be read)."""
    try:
        return same_extents(fiemap(path), extents)
    except OSError:
        return False


def _allocated_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file():
            total += p.stat().st_blocks * 512
    return total


def _beyond_retention(rows: Sequence[Mapping[str, Any]], keep: Mapping[str, int]) -> list[str]:
    """The ids retention reclaims from ``rows`` (``id``, ``kind`` ``disk``/``full``, ``promotion``; newest
    first, only the reclaimable ones): all but the newest ``keep[kind]`` of each kind, sparing the newest
    promoted one of a kind whose kept ones include none promoted (the durable copy; see ``retain``)."""
    seen: dict[str, int] = {}
    durable: set[str] = set()  # kinds whose newest promoted snapshot is kept
    drop: list[str] = []
    for r in rows:
        kind = r["kind"]
        seen[kind] = seen.get(kind, 0) + 1
        promoted = r["promotion"] == "promoted"
        if seen[kind] <= keep[kind] or (promoted and kind not in durable):
            if promoted:
                durable.add(kind)
        else:
            drop.append(r["id"])
    return drop


class SnapshotOps:
    """Snapshot, rollback and fork handlers bound to one node's VMs (a ``VmHost``: the ``SandboxManager``)."""

    def __init__(self, host: VmHost) -> None:
        self.m = host
        #: per sandbox: (its newest frozen disk snapshot, the extent map of its live disk just after the thaw)
        self._post_thaw: dict[str, tuple[str, list[Extent]]] = {}

    async def snapshot(self, cmd: SnapshotCmd) -> None:
        """Take ``cmd.snapshot_id`` (idempotent: a ready or failed snapshot is left as it is)."""
        m = self.m
        async with m.lock(cmd.sandbox_id):
            error = await self.take(cmd.sandbox_id, cmd.generation, cmd.snapshot_id, cmd.kind)
            await m.finish_op(cmd.operation_id, error)

    async def take(self, sandbox_id: str, generation: int, snapshot_id: str, kind: str, *,
                   held_frozen: bool = False) -> str | None:
        """Take snapshot ``snapshot_id`` (its row ``creating``) of kind ``full`` or ``disk``; the caller holds the
        sandbox's lock. ``held_frozen``: the caller froze the guest's filesystems and thaws them itself (a disk
        snapshot then neither freezes nor thaws). Returns an error message (the row is then ``failed``) or
        None (``ready``)."""
        m = self.m
        t0 = time.perf_counter()
        snap = await m.pool.fetchrow("SELECT state FROM snapshots WHERE id=$1", snapshot_id)
        row = await m.pool.fetchrow("SELECT state, generation, node_id, tenant_id FROM sandboxes WHERE id=$1",
                                    sandbox_id)
        if snap is None or row is None:
            return "unknown snapshot or sandbox"
        if snap["state"] == "ready":
            return None
        if snap["state"] != "creating":
            return f"snapshot is {snap['state']}"
        if (sandbox_id in m.hibernated and row["node_id"] == m.node_id and row["generation"] == generation
                and row["state"] in ("paused", "suspending")):
            # A long-paused sandbox's RAM was released (its QEMU exited): restore it, still paused, to take
            # the snapshot from a VM as for any paused one. Its release timer lets it go again afterwards.
            try:
                await m.wake_hibernated(sandbox_id)
            except Exception as exc:
                log.exception("restoring released sandbox %s for snapshot %s failed", sandbox_id, snapshot_id)
                return await self._fail_snapshot(snapshot_id, f"the sandbox's released RAM could not be restored: {exc}")
        vm = m.vms.get(sandbox_id)
        if row["node_id"] != m.node_id or row["generation"] != generation or vm is None or \
                row["state"] not in ("running", "paused", "suspending"):
            return await self._fail_snapshot(snapshot_id, f"the sandbox is {row['state']} (generation {row['generation']})")
        final = m.store.snapshot_dir(sandbox_id, snapshot_id)
        part = final.with_name(final.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        paused = row["state"] in ("paused", "suspending")  # a suspend stopped the guest before
        try:
            if kind == "full":
                if not paused:
                    # Write the RAM file's dirty pages back while the guest still runs, so the reflink made
                    # while it is stopped has little left to flush (docs/DESIGN.md §3: ~1.9 ms per dirty MiB).
                    await asyncio.to_thread(_flush, vm.handle.process.paths.ram)
                held_ms = await m.driver.snapshot_full(vm.handle, part, leave_stopped=paused)
            else:
                held_ms = await self._disk_snapshot(vm, part, frozen=not paused and not held_frozen)
            os.replace(part, final)
            if kind == "disk" and not paused:
                await asyncio.to_thread(self._note_thaw, sandbox_id, snapshot_id, vm.handle.process.paths.disk,
                                        final / "disk.img")
        except Exception as exc:
            shutil.rmtree(part, ignore_errors=True)
            reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
            LIFECYCLE_OPERATIONS.labels("nodeagent", f"snapshot_{kind}", "failed").inc()
            return await self._fail_snapshot(snapshot_id, reason)
        size = await asyncio.to_thread(_allocated_bytes, final)
        async with m.pool.acquire() as conn, conn.transaction():
            await snapshot_state.mark_ready(conn, snapshot_id, size_bytes=size, paused_ms=held_ms)
            await emit_sandbox_event(conn, sandbox_id, EventType.SNAPSHOTTED, state=row["state"], node_id=m.node_id,
                                     tenant_id=row["tenant_id"], generation=generation,
                                     data={"snapshot_id": snapshot_id, "kind": kind, "held_ms": round(held_ms, 2)})
        m.relay.kick()
        LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", f"snapshot_{kind}", "ok").observe(time.perf_counter() - t0)
        LIFECYCLE_OPERATIONS.labels("nodeagent", f"snapshot_{kind}", "ok").inc()
        try:
            await self.retain(sandbox_id)
        except Exception:  # retention is housekeeping; the snapshot itself succeeded
            log.exception("retention for %s failed", sandbox_id)
        return None

    async def retain(self, sandbox_id: str) -> list[str]:
        """Keep the newest K disk and M full snapshots (``retain_disk_snapshots``/``retain_full_snapshots``),
        and the newest promoted one of each kind as well when none of those is promoted; reclaim the rest
        unless still referenced: the source of a fork child that is not gone yet, or the parent of a snapshot
        being taken, or any snapshot while the sandbox is being rolled back. Returns the ids reclaimed.

        Why the promoted one is kept: the M newest may all be node-local, and a node loss restores only from
        a promoted full snapshot (services/scheduler/nodeloss.py); a suspend also drops the unpromoted ones.
        Reclaiming the sandbox's only durable snapshot for newer local ones would lose it with the node."""
        m = self.m
        keep = {"disk": m.settings.retain_disk_snapshots, "full": m.settings.retain_full_snapshots}
        async with m.pool.acquire() as conn, conn.transaction():
            state = await conn.fetchval("SELECT state FROM sandboxes WHERE id=$1 FOR UPDATE", sandbox_id)
            if state == "starting":
                return []  # a rollback may be reading one of them
            rows = await conn.fetch(
                "SELECT s.id, s.kind, s.promotion FROM snapshots s WHERE s.sandbox_id=$1 AND s.state='ready'"
                " AND NOT EXISTS (SELECT 1 FROM sandboxes c WHERE c.source_snapshot_id = s.id"
                "                 AND c.state NOT IN ('deleted', 'failed'))"
                " AND NOT EXISTS (SELECT 1 FROM snapshots p WHERE p.parent_id = s.id AND p.state = 'creating')"
                " AND s.promotion <> 'promoting'"  # the snapshotter is reading its files
                " AND NOT s.pinned"  # kept until deleted itself (E2B's create_snapshot)
                " ORDER BY s.created_at DESC", sandbox_id)
            drop = _beyond_retention(rows, keep)
            if drop:
                await snapshot_state.delete(conn, drop)
        for sid in drop:
            await asyncio.to_thread(shutil.rmtree, m.store.snapshot_dir(sandbox_id, sid), True)
        if drop:
            log.info("retention reclaimed %d snapshot(s) of %s", len(drop), sandbox_id)
        return drop

    async def take_scheduled(self, sandbox_id: str, kind: str, *, snapshot_id: str | None = None,
                             held_frozen: bool = False) -> str | None:
        """Take a cadence snapshot (no API call behind it): insert its row (``snapshot_id``, or a new id), then
        take it under the lock (``held_frozen``: see :meth:`take`). Returns None, or why it was not taken."""
        from podbay.outbox import new_id

        m = self.m
        snap_id = snapshot_id or new_id("snap")
        async with m.lock(sandbox_id):
            row = await m.pool.fetchrow("SELECT tenant_id, generation, state FROM sandboxes WHERE id=$1 AND node_id=$2",
                                        sandbox_id, m.node_id)
            if row is None or row["state"] not in ("running", "paused"):
                return "not running here"
            parent = await m.pool.fetchval(
                "SELECT id FROM snapshots WHERE sandbox_id=$1 AND state='ready' ORDER BY created_at DESC LIMIT 1",
                sandbox_id)
            await snapshot_state.insert(m.pool, snap_id, tenant_id=row["tenant_id"], sandbox_id=sandbox_id,
                                        node_id=m.node_id, kind=kind, parent_id=parent, generation=row["generation"])
            return await self.take(sandbox_id, row["generation"], snap_id, kind, held_frozen=held_frozen)

    def _note_thaw(self, sandbox_id: str, snapshot_id: str, live: Path, snap: Path) -> None:
        """After a frozen disk snapshot: the guest's thaw rewrote its filesystem's superblock (ext4 marks the
        journal in use again), so the live disk already differs from the snapshot, in block 0 alone. Keep the
        live disk's extent map as this snapshot's baseline when that is the only difference, so an idle guest
        is not snapshotted again for the snapshot's own write. A difference anywhere else is a real write
        (the guest runs again): nothing is kept and the next check takes a snapshot. Blocking."""
        self._post_thaw.pop(sandbox_id, None)
        try:
            size = live.stat().st_size
            now, then = fiemap(live), fiemap(snap)
        except OSError:
            return
        if size == snap.stat().st_size and all(end <= THAW_BYTES for _, end in differing_ranges(now, then, size)):
            self._post_thaw[sandbox_id] = (snapshot_id, now)

    async def unchanged(self, sandbox_id: str, kind: str) -> bool:
        """Whether a cadence snapshot of ``kind`` would hold nothing new: the sandbox's ``disk.img`` (and, for
        ``full``, its ``ram``) still has exactly the extents of its baseline's reflink (:mod:`podbay.extents`).
        The baseline is the newest ready snapshot of that kind of the sandbox at its current generation on this
        node; without one, the template snapshot it was restored from, so a sandbox that has changed nothing
        since its start takes no first snapshot. A disk snapshot compares with disk snapshots only: a full one
        taken meanwhile is not promoted by the cadence (services/snapshotter/main.py), so the disk snapshot
        that brings the write to object storage must still be taken. False whenever it cannot be told (no VM,
        no baseline, files gone, no FIEMAP): then the snapshot is taken."""
        m = self.m
        vm = m.vms.get(sandbox_id)
        if vm is None:
            return False
        snap = await m.pool.fetchval(
            "SELECT id FROM snapshots WHERE sandbox_id=$1 AND node_id=$2 AND generation=$3 AND state='ready'"
            " AND kind = $4 ORDER BY created_at DESC LIMIT 1",
            sandbox_id, m.node_id, vm.generation, kind)
        try:
            if snap is not None:
                base = m.store.snapshot_dir(sandbox_id, snap)
            else:
                row = await m.pool.fetchrow("SELECT template, template_digest FROM sandboxes WHERE id=$1", sandbox_id)
                if row is None or not row["template"] or not row["template_digest"]:
                    return False
                base = m.store.template_dir(row["template"], row["template_digest"])
        except PodbayError:  # an id that cannot name a path
            return False
        paths = vm.handle.process.paths
        post = self._post_thaw.get(sandbox_id)
        if kind == "disk" and post is not None and post[0] == snap:
            return await asyncio.to_thread(_same_map, paths.disk, post[1])
        pairs = [(paths.disk, base / "disk.img")] + ([(paths.ram, base / "ram")] if kind == "full" else [])
        return await asyncio.to_thread(lambda: all(extents_equal_files(cur, old) for cur, old in pairs))

    async def filesystem_pause_point(self, sandbox_id: str) -> Callable[[], Awaitable[None]] | None:
        """Before the pause of a sandbox whose lease ran out: for E2B's filesystem-only auto-pause (create with
        ``autoPauseMemory: false``, kept in ``e2b_sandboxes.auto_pause_filesystem``), freeze the running
        guest's filesystems, take a disk snapshot (its last acknowledged writes are in it) and record it as
        ``cold_resume_snapshot``: the next connect boots the sandbox afresh from it (services/api/e2b/sandboxes.py),
        memory and processes dropped, as after an explicit ``pause(mode="filesystem")``.

        The freeze is *held* past the snapshot until the pause point (E2B #1104): a write in between blocks
        in the guest instead of being acknowledged and then missing from the snapshot the sandbox comes back
        from. Returns the caller's "after the pause" step: it thaws the guest when the pause did not happen
        (the sandbox still runs); a paused guest stays frozen in its memory, which the next connect drops
        (and guestd thaws by itself ``FS_PAUSE_FREEZE_S`` of guest time after the freeze, should that memory
        ever run again). None for other sandboxes, and when the snapshot fails (logged; then nothing is held,
        and the pause keeps memory: a connect resumes it)."""
        from podbay.outbox import new_id

        m = self.m
        if not await m.pool.fetchval("SELECT auto_pause_filesystem FROM e2b_sandboxes WHERE sandbox_id=$1",
                                     sandbox_id):
            return None
        vm = m.vms.get(sandbox_id)
        channel = vm.channel if vm is not None else None
        held = False
        if channel is not None:
            try:
                await channel.freeze(["/"], timeout_s=FS_PAUSE_FREEZE_S)
                held = True
            except PodbayError as exc:  # the snapshot then freezes and thaws by itself, as before
                log.warning("filesystem-only auto-pause of %s: could not hold a freeze: %s", sandbox_id, exc.message)

        async def thaw_if_running() -> None:
            if channel is None or vm is None or vm.paused_at is not None or m.vms.get(sandbox_id) is not vm:
                return  # paused (its memory is dropped at the next connect), or gone
            try:
                await channel.thaw(["/"])
            except PodbayError as exc:  # guestd's own timer thaws it
                log.warning("filesystem-only auto-pause of %s: thaw failed: %s", sandbox_id, exc.message)

        snap_id = new_id("snap")
        error = await self.take_scheduled(sandbox_id, "disk", snapshot_id=snap_id, held_frozen=held)
        if error:
            log.warning("filesystem-only auto-pause of %s: disk snapshot failed (%s); pausing with memory",
                        sandbox_id, error)
            if held:
                await thaw_if_running()
            return None
        await m.pool.execute("UPDATE e2b_sandboxes SET cold_resume_snapshot=$2 WHERE sandbox_id=$1",
                             sandbox_id, snap_id)
        return thaw_if_running if held else None

    async def _disk_snapshot(self, vm: RunningVm, dest: Path, *, frozen: bool) -> float:
        from ..vm.vmm import reflink_or_copy

        handle, channel = vm.handle, vm.channel
        t = time.perf_counter()
        if frozen and channel is not None:
            await channel.freeze(["/"], timeout_s=10.0)
            try:
                await asyncio.to_thread(reflink_or_copy, handle.process.paths.disk, dest / "disk.img")
            finally:
                await channel.thaw(["/"])
        else:
            await asyncio.to_thread(reflink_or_copy, handle.process.paths.disk, dest / "disk.img")
        return (time.perf_counter() - t) * 1000

    async def _fail_snapshot(self, snapshot_id: str, reason: str) -> str:
        await snapshot_state.fail(self.m.pool, snapshot_id, reason)
        return reason

    async def restore(self, cmd: RestoreCmd) -> None:
        """Roll back to ``cmd.snapshot_id`` at ``cmd.generation`` (fenced; idempotent once running)."""
        m = self.m
        async with m.lock(cmd.sandbox_id):
            row = await m.pool.fetchrow(
                "SELECT state, generation, node_id, tenant_id, template, template_digest, hostname, memory_mib,"
                " vcpus FROM sandboxes WHERE id=$1", cmd.sandbox_id)
            snap = await m.pool.fetchrow("SELECT kind, state FROM snapshots WHERE id=$1 AND sandbox_id=$2",
                                         cmd.snapshot_id, cmd.sandbox_id)
            if row is None or row["node_id"] != m.node_id or row["generation"] != cmd.generation:
                await m.finish_op(cmd.operation_id, f"stale generation {cmd.generation}")
                return
            if row["state"] != "starting":
                await m.finish_op(cmd.operation_id, None if row["state"] == "running" else f"sandbox is {row['state']}")
                return
            await m.stop_vm(cmd.sandbox_id)
            sdir = m.store.snapshot_dir(cmd.sandbox_id, cmd.snapshot_id)
            ok = False
            volumes_error: str | None = None
            if cmd.volumes and snap is not None and snap["kind"] == "full" and snap["state"] == "ready" and sdir.exists():
                try:  # asked for: the read-write volumes go back with it, to the snapshot's copies
                    await m.volumes.roll_back(cmd.sandbox_id, sdir)
                except PodbayError as exc:
                    volumes_error = exc.message
            if snap is None or snap["state"] != "ready" or not sdir.exists():
                await m.mark_failed(cmd.sandbox_id, cmd.generation, f"snapshot {cmd.snapshot_id} is not on this node",
                                    from_states=("starting",))
            elif volumes_error is not None:
                await m.mark_failed(cmd.sandbox_id, cmd.generation, volumes_error, from_states=("starting",))
            else:
                ok = await m.bring_up(
                    cmd.sandbox_id, cmd.generation, Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"]),
                    row["hostname"], row["tenant_id"], template=row["template"],
                    template_digest=row["template_digest"], snapshot_dir=sdir if snap["kind"] == "full" else None,
                    boot_disk=sdir / "disk.img" if snap["kind"] == "disk" else None,
                    operation_id=cmd.operation_id, event=EventType.RESTORED, kind="restore",
                    data={"snapshot_id": cmd.snapshot_id, "kind": snap["kind"]})
            await m.finish_op(cmd.operation_id, None if ok else "rollback failed; see the sandbox's failure_reason")

    async def fork(self, cmd: ForkCmd) -> None:
        """Start each child from the (new or named) full snapshot; children fail independently."""
        m = self.m
        async with m.lock(cmd.sandbox_id):
            if cmd.take_snapshot:
                err = await self.take(cmd.sandbox_id, cmd.generation, cmd.snapshot_id, "full")
                if err is not None:
                    for child in cmd.children:
                        await m.mark_failed(child.sandbox_id, 1, f"the fork's snapshot failed: {err}",
                                            from_states=("starting",))
                    await m.finish_op(cmd.operation_id, err)
                    return
            parent = await m.pool.fetchrow(
                "SELECT tenant_id, template, template_digest, memory_mib, vcpus, generation FROM sandboxes WHERE id=$1",
                cmd.sandbox_id)
        sdir = m.store.snapshot_dir(cmd.sandbox_id, cmd.snapshot_id)
        res = Resources(memory_mib=parent["memory_mib"], vcpus=parent["vcpus"])
        sem = asyncio.Semaphore(FORK_CONCURRENCY)

        async def one(child_id: str, hostname: str) -> bool:
            async with sem, m.lock(child_id):
                state: str | None = await m.pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", child_id)
                if state != "starting":
                    return state == "running"
                ok = await m.bring_up(child_id, 1, res, hostname, parent["tenant_id"], template=parent["template"],
                                      template_digest=parent["template_digest"], snapshot_dir=sdir,
                                      operation_id=cmd.operation_id, event=EventType.STARTED, kind="fork",
                                      data={"parent": cmd.sandbox_id, "snapshot_id": cmd.snapshot_id})
                if ok:
                    await self._views_readonly(child_id)
                return ok

        results = await asyncio.gather(*(one(c.sandbox_id, c.hostname) for c in cmd.children))
        async with m.pool.acquire() as conn, conn.transaction():
            await emit_sandbox_event(conn, cmd.sandbox_id, EventType.FORKED, node_id=m.node_id, tenant_id=parent["tenant_id"],
                                     generation=parent["generation"],
                                     data={"snapshot_id": cmd.snapshot_id, "children": [c.sandbox_id for c in cmd.children],
                                           "started": sum(results)})
        m.relay.kick()
        await m.finish_op(cmd.operation_id, None if any(results) else "no child started")

    async def _views_readonly(self, child_id: str) -> None:
        """Remount a fork child's views of its parent's read-write volumes read-only (its memory has them
        mounted read-write). A failure is logged: the view is the child's own file, so whatever the child
        writes there never reaches the parent's volume."""
        vm = self.m.vms.get(child_id)
        for path in await self.m.volumes.view_paths(child_id):
            try:
                if vm is None or vm.channel is None:
                    raise PodbayError("its VM is not running")
                _, err, ex = await vm.channel.run(ExecSpec(argv=["mount", "-o", "remount,ro", path], timeout_s=30))
                if ex.exit_code != 0:
                    raise PodbayError(err.decode(errors="replace").strip()[:300])
            except Exception as exc:
                log.warning("fork child %s: remounting its view at %s read-only failed: %s", child_id, path, exc)

    async def reconcile(self) -> None:
        """Fail this node's snapshots left ``creating`` by a crash and remove their partial files."""
        m = self.m
        rows = await snapshot_state.fail_interrupted(m.pool, m.node_id, "interrupted by a node agent restart")
        for r in rows:
            shutil.rmtree(m.store.snapshot_dir(r["sandbox_id"], r["id"]).with_name(r["id"] + ".part"), ignore_errors=True)
        # Their snapshot operations end now rather than when JetStream redelivers the command (whose
        # handler then finds the snapshot failed and does nothing more).
        ops = await operation_state.fail_in_flight_of(m.pool, {r["sandbox_id"] for r in rows}, "snapshot",
                                                      "interrupted", "interrupted by a node agent restart")
        for op in ops:
            await m.notify_op(op["id"], "interrupted by a node agent restart")

    async def discard(self, sandbox_id: str) -> None:
        """Remove a deleted sandbox's snapshot files and mark its snapshots deleted, except pinned promoted
        ones: they stay ready, restorable from object storage."""
        m = self.m
        self._post_thaw.pop(sandbox_id, None)
        await asyncio.to_thread(shutil.rmtree, m.store.sandbox_snapshots_dir(sandbox_id), True)
        await snapshot_state.delete_of_deleted_sandbox(m.pool, sandbox_id)
