"""Reconciliation of a node agent with PostgreSQL after a (re)start (docs/DESIGN.md §1 node agent, §5).

What each row's state asks of this node: re-attach to a QEMU that still runs (or keep a hibernated one
hibernated), recreate a half-created sandbox, let a redelivered command finish a rollback or fork child,
finish a delete, carry on a suspend or resume; and remove VM directories no live row claims. A VM that is
gone is marked ``failed`` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from podbay.contracts.events import EventType
from podbay.channel.client import GuestChannel
from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, Resources
from podbay.errors import GuestError, PodbayError
from podbay.outbox import emit_sandbox_event

from ..vm.vmhost import HibernatedVm

if TYPE_CHECKING:
    from .sandboxes import SandboxManager

__all__ = ["reconcile"]

log = logging.getLogger("podbay.nodeagent.reconcile")


async def reconcile(mgr: SandboxManager) -> None:
    """Bring this node in line with PostgreSQL after a (re)start (docs/DESIGN.md §1 node agent).

    running -> re-attach to the QEMU that still runs, or mark failed when it is gone;
    starting -> discard any half-created VM and create it again from the template snapshot;
    deleting -> finish the delete; a VM directory no live row claims -> killed and removed.
    """
    rows = await mgr.pool.fetch(
        "SELECT s.id, s.state, s.generation, s.tenant_id, s.template, s.template_digest, s.hostname,"
        " s.memory_mib, s.vcpus, s.disk_mib, s.source_snapshot_id, s.suspended_snapshot_id,"
        " (SELECT o.id FROM operations o WHERE o.sandbox_id = s.id ORDER BY o.created_at DESC LIMIT 1) AS op_id,"
        " (SELECT o.kind FROM operations o WHERE o.sandbox_id = s.id ORDER BY o.created_at DESC LIMIT 1)"
        " AS op_kind"
        " FROM sandboxes s WHERE s.node_id = $1 AND s.state NOT IN ('deleted', 'failed')", mgr.node_id)
    await mgr.snapshots.reconcile()
    claimed = {r["id"] for r in rows}
    # Addresses, taps and bindings of sandboxes that left the node while the agent was down go now; the
    # rest keep theirs (a re-attached VM still holds its tap; a recreated one gets its lease back).
    released = await asyncio.to_thread(mgr.net.prune, claimed)
    if released:
        log.info("released the network of %d sandbox(es) no longer on this node", len(released))
    for orphan in set(mgr.store.sandbox_ids_on_disk()) - claimed:
        log.info("removing orphaned VM directory %s", orphan)
        await mgr.discard_vm_dir(mgr.store.sandbox_dir(orphan))
    for r in rows:
        sid = r["id"]
        res = Resources(memory_mib=r["memory_mib"], vcpus=r["vcpus"])
        try:
            promoted = r["state"] == "suspending" and await mgr.pool.fetchval(
                "SELECT promotion = 'promoted' FROM snapshots WHERE id=$1", r["suspended_snapshot_id"])
            if promoted:
                pass  # the suspend only has to free what is left of the VM
            elif r["state"] in ("running", "paused", "suspending"):
                # A suspending sandbox's VM is stopped; its suspend carries on below.
                await _reattach(mgr, sid, r["generation"], r["tenant_id"], res, paused=r["state"] != "running")
            elif r["state"] == "starting" and (r["op_kind"] != "create" or r["source_snapshot_id"]):
                # A rollback or a fork child: its command is redelivered and its handler is idempotent.
                log.info("sandbox %s: waiting for its %s command to be redelivered", sid, r["op_kind"] or "fork")
            elif r["state"] == "starting":
                async with mgr.lock(sid):
                    await mgr.creates.create_locked(CreateSandboxCmd(
                        operation_id=r["op_id"] or "", sandbox_id=sid, tenant_id=r["tenant_id"],
                        template=r["template"], template_digest=r["template_digest"],
                        generation=r["generation"], resources=res, hostname=r["hostname"]),
                        disk_mib=r["disk_mib"])
            if r["state"] in ("suspending", "resuming") and r["op_id"]:
                # Finish now rather than when JetStream redelivers the command (both are idempotent).
                mgr.suspend_ops.kick(r["state"], sid, r["op_id"], r["generation"], r["suspended_snapshot_id"])
            elif r["state"] == "deleting":
                await mgr.delete(DeleteSandboxCmd(operation_id=r["op_id"] or "", sandbox_id=sid,
                                                   generation=r["generation"]))
        except Exception:
            log.exception("reconcile of %s failed", sid)

async def _reattach(mgr: SandboxManager, sandbox_id: str, generation: int, tenant_id: str, res: Resources, *,
                    paused: bool = False) -> None:
    vm_dir = mgr.store.sandbox_dir(sandbox_id)
    channel: GuestChannel | None = None
    if paused and (vm_dir / "hib" / "state").exists():
        mgr.hibernated[sandbox_id] = HibernatedVm(sandbox_id, generation, res)
        await asyncio.to_thread(mgr.net.lease, sandbox_id)
        log.info("sandbox %s stays hibernated (paused, RAM released)", sandbox_id)
        return
    pending = None
    try:
        handle = await mgr.driver.attach(vm_dir)
        # The VM holds its tap still; its binding is kept unless it was lost (then a new CA, sent to the guest).
        before = await asyncio.to_thread(mgr.net.binding, sandbox_id)
        binding = await asyncio.to_thread(mgr.net.bind, sandbox_id, generation)
        if before != binding:
            pending = mgr.guest_net(binding)
        if paused:
            # A stopped guest cannot answer; the channel is connected again on resume.
            status = await handle.status()
            if status != "paused":
                await handle.pause()
        else:
            # A crash in the middle of a full snapshot leaves QEMU stopped (``paused``/``postmigrate``):
            # the sandbox is meant to run, so let it go on before talking to the guest.
            status = await handle.status()
            if status in ("paused", "postmigrate"):
                log.info("sandbox %s was left stopped (%s) by an interrupted operation: continuing it",
                         sandbox_id, status)
                await handle.resume()
            # A slow answer on a loaded node is no lost VM: the same bound as a restore's before discarding it.
            channel = await GuestChannel.connect(handle.channel_path, timeout_s=mgr.settings.restore_timeout_s)
            await channel.ping(timeout_s=mgr.settings.restore_timeout_s)
            if pending is not None:
                await channel.after_restore(net=pending)
                pending = None
    except (PodbayError, OSError, GuestError) as exc:
        if (vm_dir / "hib" / "state").exists() and await _wake_saved(mgr, sandbox_id, generation, res):
            return
        reason = f"the VM is gone after a node agent restart ({exc})"
        log.warning("sandbox %s: %s", sandbox_id, reason)
        await mgr.discard_vm_dir(vm_dir)
        await mgr.release_net(sandbox_id)
        await mgr.mark_failed(sandbox_id, generation, reason, from_states=("running", "paused", "suspending"))
        return
    mgr.adopt(sandbox_id, generation, res, handle, channel, paused_at=time.monotonic() if paused else None,
              net_pending=pending)
    async with mgr.pool.acquire() as conn, conn.transaction():
        await emit_sandbox_event(conn, sandbox_id, EventType.REATTACHED, state="paused" if paused else "running",
                                 node_id=mgr.node_id,
                                 tenant_id=tenant_id, generation=generation)
    mgr.relay.kick()
    log.info("re-attached to sandbox %s (pid %s)", sandbox_id, handle.pid)


async def _wake_saved(mgr: SandboxManager, sandbox_id: str, generation: int, res: Resources) -> bool:
    """A running sandbox whose VM was saved to ``hib`` and killed by a move to a new VM (``renew_vm``) that a
    crash cut short: restore it from there and let it run. True when it runs again."""
    try:
        async with mgr.lock(sandbox_id):
            mgr.hibernated[sandbox_id] = HibernatedVm(sandbox_id, generation, res)
            await mgr.wake_hibernated(sandbox_id)
            await mgr.continue_vm(mgr.vms[sandbox_id])
    except Exception as exc:
        log.warning("sandbox %s: its saved VM did not come back (%s)", sandbox_id, exc)
        await mgr.stop_vm(sandbox_id)
        return False
    log.info("sandbox %s: restored from the state saved before a crash, running again", sandbox_id)
    return True
