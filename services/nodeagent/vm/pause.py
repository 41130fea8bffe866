"""The pause and resume operations, and the two that stop a VM's QEMU without ending its sandbox.

- ``pause`` / ``resume``: QMP ``stop`` / ``cont`` (a resume also corrects the guest clock and gives it any
  pending network settings), recorded ``paused`` / ``running``; idempotent and fenced by generation. A resume
  of a hibernated sandbox restores it first.
- ``hibernate``: a paused sandbox's RAM released (its state saved to ``vm_dir/hib``, QEMU gone).
- ``renew_vm``: a live VM moved into a fresh QEMU on a fresh tap (tapwatch.py).

Written against the registry's interface (:class:`services.nodeagent.vm.vmhost.VmHost`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable

from podbay.contracts.events import EventType
from podbay import lifecycle
from podbay.contracts.messages import SandboxOpCmd
from podbay.contracts.states import OperationState
from podbay.errors import PodbayError
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS

from .vmhost import HibernatedVm, HostOps, RunningVm

__all__ = ["PauseOps"]

log = logging.getLogger("podbay.nodeagent.pause")


class PauseOps(HostOps):
    """Pause, resume, hibernate and renew handlers bound to one node's VMs (a ``VmHost``)."""

    async def pause(self, cmd: SandboxOpCmd) -> None:
        """Pause the sandbox's vCPUs (QMP ``stop``) and record ``paused``; idempotent and fenced."""
        await self.pause_resume(cmd, pause=True)

    async def resume(self, cmd: SandboxOpCmd) -> None:
        """Resume (QMP ``cont``), correct the guest clock, record ``running``; idempotent and fenced."""
        await self.pause_resume(cmd, pause=False)

    async def hibernate(self, sandbox_id: str) -> bool:
        """Release a paused sandbox's RAM (docs/DESIGN.md §7: ≥ 1,000 paused per node): save its device state,
        move RAM and disk into ``vm_dir/hib`` (reflinks, which also write dirty pages back), and let QEMU
        exit. ``resume`` restores it from there. Returns True when it was hibernated."""
        async with self.m.lock(sandbox_id):
            vm = self.m.vms.get(sandbox_id)
            state = await self.m.pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sandbox_id)
            if vm is None or vm.stopping or state != "paused":
                return False
            t = time.perf_counter()
            await self._release_ram(vm)
            HOP_SECONDS.labels("nodeagent", "hibernate").observe(time.perf_counter() - t)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "hibernate", "ok").inc()
            log.info("sandbox %s paused for long: RAM released (%.0f ms)", sandbox_id, (time.perf_counter() - t) * 1000)
            return True

    async def _release_ram(self, vm: RunningVm) -> None:
        """Save ``vm`` (memory, devices, disk) into ``vm_dir/hib`` (reflinks, which also write dirty pages
        back) and let its QEMU go: it leaves ``vms`` for ``hibernated``. The caller holds the sandbox's lock."""
        vm_dir = self.m.store.sandbox_dir(vm.sandbox_id)
        part, hib = vm_dir / "hib.part", vm_dir / "hib"
        await asyncio.to_thread(shutil.rmtree, part, True)
        await self.m.driver.snapshot_full(vm.handle, part, leave_stopped=True)
        os.replace(part, hib)
        self.m.vms.pop(vm.sandbox_id, None)
        vm.stopping = True
        await self.m.teardown(vm.handle, vm.channel, None)
        for name in ("ram", "disk.img"):
            (vm_dir / name).unlink(missing_ok=True)  # the page cache of the live RAM file goes with it
        self.m.hibernated[vm.sandbox_id] = HibernatedVm(vm.sandbox_id, vm.generation, vm.resources)

    async def renew_vm(self, sandbox_id: str, why: str, *, still: Callable[[RunningVm], bool] | None = None) -> bool:
        """Move a live VM into a fresh QEMU on a fresh tap, the guest's memory, processes and disk intact: its
        state goes to ``vm_dir/hib`` (as a RAM release does), the old QEMU is killed, and a restore on a new tap
        of the same name and address takes over, running again if it ran before. Used when the host side of
        its network vanished (``tapwatch``): QEMU cannot be given a new tap backend on the microvm machine, and
        its old one spins on a dead descriptor. Returns True when renewed, False when the VM is gone or
        stopping, or when ``still(vm)``, asked once the sandbox's lock is held, says the reason is gone (another
        operation replaced the VM meanwhile). If any step fails, the sandbox is marked failed with ``why`` and
        the error (no QEMU is left behind)."""
        async with self.m.lock(sandbox_id):
            vm = self.m.vms.get(sandbox_id)
            if vm is None or vm.stopping or (still is not None and not still(vm)):
                return False
            was_running = vm.paused_at is None
            t = time.perf_counter()
            try:
                await self._release_ram(vm)
                await self.m.wake_hibernated(sandbox_id)
                fresh = self.m.vms[sandbox_id]
                if was_running:
                    await self.m.continue_vm(fresh)
                else:
                    fresh.paused_at = vm.paused_at
            except Exception as exc:
                reason = f"{why}; renewing its VM failed: " + (
                    exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}")
                log.error("sandbox %s: %s", sandbox_id, reason)
                LIFECYCLE_OPERATIONS.labels("nodeagent", "renew_vm", "failed").inc()
                vm.stopping = True
                await self.m.teardown(vm.handle, vm.channel, None)
                await self.m.stop_vm(sandbox_id)  # the new VM, if it came up
                await self.m.release_net(sandbox_id)
                await self.m.mark_failed(sandbox_id, vm.generation, reason)
                return False
            HOP_SECONDS.labels("nodeagent", "renew_vm").observe(time.perf_counter() - t)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "renew_vm", "ok").inc()
            log.warning("sandbox %s: %s; moved to a new VM on a new tap (%.0f ms)", sandbox_id, why,
                        (time.perf_counter() - t) * 1000)
            return True

    async def pause_resume(self, cmd: SandboxOpCmd, *, pause: bool, reason: str | None = None) -> None:
        """Pause (``pause``) or resume the sandbox and record it, fenced by ``cmd.generation``; ``reason`` goes
        into the event (``lease expired``, ``memory pressure``). The operation row gets the outcome either way."""
        verb, target, source = ("pause", "paused", "running") if pause else ("resume", "running", "paused")
        t0 = time.perf_counter()
        async with self.m.lock(cmd.sandbox_id):
            row = await self.m.pool.fetchrow(
                "SELECT state, generation, node_id, tenant_id FROM sandboxes WHERE id = $1", cmd.sandbox_id)
            if row is None or row["node_id"] != self.m.node_id or row["generation"] != cmd.generation:
                await self.m.finish_op(cmd.operation_id, f"stale generation {cmd.generation}")
                return
            if row["state"] == target:
                await self.m.finish_op(cmd.operation_id, None)  # a repeated call: already done
                return
            if not pause and cmd.sandbox_id in self.m.hibernated:
                try:
                    await self.m.wake_hibernated(cmd.sandbox_id)
                except Exception as exc:
                    reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
                    await self.m.finish_op(cmd.operation_id, f"could not wake the sandbox: {reason}")
                    return
            vm = self.m.vms.get(cmd.sandbox_id)
            if row["state"] != source or vm is None:
                await self.m.finish_op(cmd.operation_id, f"the sandbox is {row['state']}")
                return
            try:
                t = time.perf_counter()
                if pause:
                    await vm.handle.pause()
                    vm.paused_at = time.monotonic()
                else:
                    await self.m.continue_vm(vm)
                HOP_SECONDS.labels("nodeagent", f"qemu_{verb}").observe(time.perf_counter() - t)
            except Exception as exc:
                reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
                LIFECYCLE_OPERATIONS.labels("nodeagent", verb, "failed").inc()
                await self.m.finish_op(cmd.operation_id, reason)
                return
            async with self.m.pool.acquire() as conn, conn.transaction():
                await lifecycle.apply(
                    conn, cmd.sandbox_id, Verb.PAUSE if pause else Verb.RESUME, states=source,
                    generation=cmd.generation,
                    operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED, always=True),
                    event=SandboxEvent(EventType.PAUSED if pause else EventType.RESUMED, reason=reason, node_id=self.m.node_id,
                                       tenant_id=row["tenant_id"], generation=cmd.generation,
                                       data={"operation_id": cmd.operation_id}))
            self.m.relay.kick()
            await self.m.notify_op(cmd.operation_id, None)
            LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", verb, "ok").observe(time.perf_counter() - t0)
            LIFECYCLE_OPERATIONS.labels("nodeagent", verb, "ok").inc()

