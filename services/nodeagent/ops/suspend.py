"""Suspend to object storage and wake on this node (docs/DESIGN.md §5; docs/ARCHITECTURE.md "Suspend and resume").

Suspend (``podbay.cmd.node.<node>.suspend``, sandbox ``suspending``, its snapshot row ``creating``):

1. stop the guest's vCPUs (a hibernated sandbox is restored paused first), so nothing it does after the
   snapshot is lost; take the full snapshot (``suspend.snapshotted``);
2. ask this node's snapshotter to promote it and wait until the row says ``promoted`` or ``failed``
   (``suspend.promoted``);
3. snapshot and promote its read-write volumes while the guest is still stopped (their own snapshots,
   services/nodeagent/storage/volumes.py), so each matches the memory snapshot;
4. only then kill the VM, remove its directory, the sandbox's local snapshot files and its promoted
   volumes' files (the volumes are unbound: the wake fetches them wherever it is placed), and in one
   transaction set ``suspended`` (no node), finish the operation and emit ``suspended``.

A failed snapshot or promotion puts the sandbox back to ``paused`` (its VM intact) with the error on the
operation. Every step is idempotent, so a redelivered command after a crash finishes the work.

Wake (``podbay.cmd.node.<node>.wake``, sandbox ``resuming`` placed here at a new generation): fetch the
promoted snapshot (chunks the template's snapshot already has are reflinked, chunks of other sandboxes'
promoted snapshots on this node are copied, neither is downloaded; every
downloaded chunk is checked against its SHA-256), restore it, run the after-restore hygiene, set
``running`` with the event ``resumed``. A corrupt or missing object puts the sandbox back to ``suspended``
with the error (``snapshot_corrupt``) on the operation; only with ``fallback`` is the newest older intact
promoted full snapshot restored instead. The sandbox's volumes are made present first (fetched from
object storage when this node lacks them); a failure there also puts it back to ``suspended``. A disk
snapshot (no memory; a new sandbox started from an E2B filesystem-only snapshot) is booted afresh on its
fetched disk instead of restored, as a rollback to a disk snapshot is.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from podbay.contracts.events import EventType
from podbay.contracts import subjects
from podbay.contracts.messages import PromoteCmd, Resources, SandboxOpCmd, WakeCmd
from podbay.errors import NotFound, PodbayError, SnapshotCorrupt
from podbay.faults import fault_point
from podbay.objstore import ObjectStore
from podbay import lifecycle
from podbay.contracts.states import OperationState, SandboxState
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.chunks import Manifest
from podbay.promotion import fetch, local_chunks
from podbay.telemetry import LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS
from podbay import snapshot_state

if TYPE_CHECKING:
    from ..vm.vmhost import VmHost

__all__ = ["SuspendOps"]

log = logging.getLogger("podbay.nodeagent.suspend")

PROMOTION_POLL_S = 0.25
LOCAL_SOURCES = 8  # other sandboxes' snapshots on this node searched for chunks before downloading


class SuspendOps:
    """Suspend and wake handlers bound to one node's VMs (a ``VmHost``: the ``SandboxManager``) and the node's
    object store."""

    def __init__(self, host: VmHost, store: ObjectStore) -> None:
        self.m = host
        self.store = store
        self._tasks: set[asyncio.Task[None]] = set()

    def kick(self, state: str, sandbox_id: str, operation_id: str, generation: int, snapshot_id: str | None) -> None:
        """After a restart: carry on an interrupted suspend or wake in the background."""
        if state == "suspending":
            coro = self.suspend(SandboxOpCmd(operation_id=operation_id, sandbox_id=sandbox_id, generation=generation))
        elif snapshot_id is not None:
            coro = self.wake(WakeCmd(operation_id=operation_id, sandbox_id=sandbox_id, generation=generation,
                                     snapshot_id=snapshot_id))
        else:
            return
        task = asyncio.create_task(coro, name=f"{state}-{sandbox_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ suspend

    async def suspend(self, cmd: SandboxOpCmd) -> None:
        """Snapshot, promote, then free the sandbox (module docstring); idempotent and fenced."""
        m = self.m
        t0 = time.perf_counter()
        async with m.lock(cmd.sandbox_id):
            row = await m.pool.fetchrow(
                "SELECT state, generation, node_id, tenant_id, suspended_snapshot_id FROM sandboxes WHERE id=$1",
                cmd.sandbox_id)
            if row is None or row["node_id"] != m.node_id or row["generation"] != cmd.generation:
                if row is not None and row["state"] == "suspended":
                    await m.finish_op(cmd.operation_id, None)  # a redelivery after it was done
                    return
                await m.finish_op(cmd.operation_id, f"stale generation {cmd.generation}")
                return
            snap_id = row["suspended_snapshot_id"]
            if row["state"] != "suspending" or snap_id is None:
                await m.finish_op(cmd.operation_id, f"the sandbox is {row['state']}")
                return
            snap = await m.pool.fetchrow("SELECT state, promotion FROM snapshots WHERE id=$1", snap_id)
            if snap["promotion"] != "promoted":
                error = await self._snapshot_and_promote(cmd, snap_id, snap["state"])
                if error is not None:
                    await self._back_to_paused(cmd, row["tenant_id"], error)
                    LIFECYCLE_OPERATIONS.labels("nodeagent", "suspend", "failed").inc()
                    return
            error = await m.volumes.promote_for_suspend(cmd.sandbox_id)
            if error is not None:
                await self._back_to_paused(cmd, row["tenant_id"], error)
                LIFECYCLE_OPERATIONS.labels("nodeagent", "suspend", "failed").inc()
                return
            fault_point("suspend.promoted")
            await self._free(cmd, row["tenant_id"], snap_id)
            LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", "suspend", "ok").observe(time.perf_counter() - t0)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "suspend", "ok").inc()

    async def _snapshot_and_promote(self, cmd: SandboxOpCmd, snap_id: str, snap_state: str) -> str | None:
        m = self.m
        if snap_state == "creating":
            if cmd.sandbox_id in m.hibernated:
                await m.wake_hibernated(cmd.sandbox_id)
            vm = m.vms.get(cmd.sandbox_id)
            if vm is None:
                return "the sandbox's VM is not running on this node"
            if vm.paused_at is None:
                await vm.handle.pause()
                vm.paused_at = time.monotonic()
            error = await m.snapshots.take(cmd.sandbox_id, cmd.generation, snap_id, "full")
            if error is not None:
                return f"the full snapshot failed: {error}"
            fault_point("suspend.snapshotted")
        elif snap_state != "ready":
            return f"the suspend snapshot is {snap_state}"
        return await self._await_promotion(cmd.sandbox_id, snap_id)

    async def _await_promotion(self, sandbox_id: str, snap_id: str) -> str | None:
        """Ask the snapshotter to promote ``snap_id`` and wait (``suspend_timeout_s``); an error or None."""
        m = self.m
        await m.bus.publish_command(subjects.snapshotter_promote(m.node_id),
                                    PromoteCmd(snapshot_id=snap_id, sandbox_id=sandbox_id, reason="suspend"),
                                    msg_id=f"promote.{snap_id}")
        deadline = time.monotonic() + m.settings.suspend_timeout_s
        while time.monotonic() < deadline:
            r = await m.pool.fetchrow("SELECT promotion, promotion_error FROM snapshots WHERE id=$1", snap_id)
            if r["promotion"] == "promoted":
                return None
            if r["promotion"] == "failed":
                return f"promotion failed: {r['promotion_error']}"
            await asyncio.sleep(PROMOTION_POLL_S)
        return f"promotion did not finish within {m.settings.suspend_timeout_s:.0f} s"

    async def _free(self, cmd: SandboxOpCmd, tenant_id: str, snap_id: str) -> None:
        """Kill the VM, remove its files and the local snapshots, record ``suspended`` (idempotent)."""
        m = self.m
        await m.stop_vm(cmd.sandbox_id)
        await m.discard_vm_dir(m.store.sandbox_dir(cmd.sandbox_id))
        await m.volumes.release_after_suspend(cmd.sandbox_id)
        await m.release_net(cmd.sandbox_id)
        await asyncio.to_thread(shutil.rmtree, m.store.sandbox_snapshots_dir(cmd.sandbox_id), True)
        async with m.pool.acquire() as conn, conn.transaction():
            # Local-only snapshots went with the node's files; promoted ones stay restorable from S3.
            await snapshot_state.delete_local_of_sandbox(conn, cmd.sandbox_id)
            await lifecycle.apply(
                conn, cmd.sandbox_id, Verb.SUSPENDED, states=SandboxState.SUSPENDING, generation=cmd.generation,
                set_node=None, operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED, always=True),
                event=SandboxEvent(EventType.SUSPENDED, node_id=m.node_id, tenant_id=tenant_id, generation=cmd.generation,
                                   data={"snapshot_id": snap_id, "operation_id": cmd.operation_id}))
        m.relay.kick()
        await m.notify_op(cmd.operation_id, None)
        log.info("sandbox %s suspended to snapshot %s", cmd.sandbox_id, snap_id)

    async def _back_to_paused(self, cmd: SandboxOpCmd, tenant_id: str, error: str) -> None:
        m = self.m
        log.warning("suspend of %s failed: %s; it stays paused", cmd.sandbox_id, error)
        async with m.pool.acquire() as conn, conn.transaction():
            await lifecycle.apply(
                conn, cmd.sandbox_id, Verb.SUSPEND_FAILED, states=SandboxState.SUSPENDING, generation=cmd.generation,
                values={"suspended_snapshot_id": None},
                operation=OperationOutcome(cmd.operation_id, OperationState.FAILED, error_code="suspend_failed",
                                           error_message=error, always=True),
                event=SandboxEvent(EventType.PAUSED, reason=f"suspend failed: {error}", node_id=m.node_id,
                                   tenant_id=tenant_id, generation=cmd.generation,
                                   data={"operation_id": cmd.operation_id}))
        m.relay.kick()
        await m.notify_op(cmd.operation_id, error)

    # ------------------------------------------------------------------ wake

    async def wake(self, cmd: WakeCmd) -> None:
        """Fetch, verify and restore a suspended sandbox placed on this node (module docstring)."""
        m = self.m
        t0 = time.perf_counter()
        async with m.lock(cmd.sandbox_id):
            row = await m.pool.fetchrow(
                "SELECT state, generation, node_id, tenant_id, template, template_digest, hostname, memory_mib, vcpus"
                " FROM sandboxes WHERE id=$1", cmd.sandbox_id)
            if row is None or row["node_id"] != m.node_id or row["generation"] != cmd.generation:
                log.info("wake %s: stale or unknown (generation %s), skipping", cmd.sandbox_id, cmd.generation)
                return
            if row["state"] == "running":
                await m.finish_op(cmd.operation_id, None)
                return
            if row["state"] != "resuming":
                await m.finish_op(cmd.operation_id, f"the sandbox is {row['state']}")
                return
            candidates = [cmd.snapshot_id]
            if cmd.fallback:
                candidates += [r["id"] for r in await m.pool.fetch(
                    "SELECT id FROM snapshots WHERE sandbox_id=$1 AND kind='full' AND promotion='promoted'"
                    " AND state='ready' AND id <> $2 ORDER BY created_at DESC", cmd.sandbox_id, cmd.snapshot_id)]
            try:
                base: Path | None = (await m.template(row["template"], row["template_digest"])).snapshot.dir
            except NotFound:
                base = None  # every chunk comes from the object store; bring_up then fails with the reason
            local = await self._local_chunks(cmd.sandbox_id)
            chosen: str | None = None
            errors: list[str] = []
            for snap_id in candidates:
                try:
                    await fetch(m.pool, self.store, m.settings, snap_id, m.store.snapshot_dir(cmd.sandbox_id, snap_id),
                                base_dir=base, local=local)
                    chosen = snap_id
                    break
                except SnapshotCorrupt as exc:
                    log.warning("wake %s: snapshot %s is corrupt: %s", cmd.sandbox_id, snap_id, exc.message)
                    errors.append(f"snapshot {snap_id}: {exc.message}")
                except PodbayError as exc:
                    await self._back_to_suspended(cmd, row["tenant_id"], exc.code, exc.message)
                    return
            if chosen is None:
                await self._back_to_suspended(cmd, row["tenant_id"], "snapshot_corrupt", "; ".join(errors))
                return
            try:
                await m.volumes.prepare(cmd.sandbox_id)
            except Exception as exc:
                code = exc.code if isinstance(exc, PodbayError) else "volume_failed"
                why = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
                await self._back_to_suspended(cmd, row["tenant_id"], code, f"volumes: {why}")
                return
            fault_point("resume.fetched")
            kind = await snapshot_state.move_to_node(m.pool, chosen, m.node_id)
            sdir = m.store.snapshot_dir(cmd.sandbox_id, chosen)
            ok = await m.bring_up(
                cmd.sandbox_id, cmd.generation, Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"]),
                row["hostname"], row["tenant_id"], template=row["template"], template_digest=row["template_digest"],
                snapshot_dir=sdir if kind == "full" else None,
                boot_disk=sdir / "disk.img" if kind == "disk" else None, operation_id=cmd.operation_id,
                event=EventType.RESUMED, kind="resume", from_state="resuming",
                data={"snapshot_id": chosen, "fallback": chosen != cmd.snapshot_id, "snapshot_kind": kind,
                      "operation_id": cmd.operation_id})
            if ok:
                await lifecycle.forget_suspended_snapshot(m.pool, cmd.sandbox_id)
            await m.finish_op(cmd.operation_id, None if ok else "the restore failed; see the sandbox's failure_reason")
            LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", "wake", "ok" if ok else "failed").observe(
                time.perf_counter() - t0)

    async def _local_chunks(self, sandbox_id: str) -> dict[str, tuple[Path, int, int]]:
        """Chunks of other sandboxes' promoted snapshots whose files are on this node (newest first, a few)."""
        m = self.m
        rows = await m.pool.fetch(
            "SELECT id, sandbox_id, manifest FROM snapshots WHERE node_id=$1 AND promotion='promoted'"
            " AND state='ready' AND sandbox_id <> $2 ORDER BY promoted_at DESC LIMIT $3",
            m.node_id, sandbox_id, LOCAL_SOURCES)
        sources = [(Manifest.model_validate(r["manifest"]), m.store.snapshot_dir(r["sandbox_id"], r["id"])) for r in rows]
        return await asyncio.to_thread(local_chunks, [(mf, d) for mf, d in sources if d.exists()])

    async def _back_to_suspended(self, cmd: WakeCmd, tenant_id: str, code: str, error: str) -> None:
        m = self.m
        await asyncio.to_thread(shutil.rmtree, m.store.sandbox_snapshots_dir(cmd.sandbox_id), True)
        async with m.pool.acquire() as conn, conn.transaction():
            await lifecycle.apply(
                conn, cmd.sandbox_id, Verb.WAKE_FAILED, states=SandboxState.RESUMING, generation=cmd.generation,
                set_node=None,
                operation=OperationOutcome(cmd.operation_id, OperationState.FAILED, error_code=code,
                                           error_message=error[:4000], always=True),
                event=SandboxEvent(EventType.SUSPENDED, reason=f"resume failed: {error[:500]}", node_id=m.node_id,
                                   tenant_id=tenant_id, generation=cmd.generation,
                                   data={"operation_id": cmd.operation_id, "error_code": code}))
        m.relay.kick()
        await m.notify_op(cmd.operation_id, error)
        LIFECYCLE_OPERATIONS.labels("nodeagent", "wake", "failed").inc()
