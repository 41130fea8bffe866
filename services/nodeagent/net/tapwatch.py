"""Noticing a sandbox tap that vanished under its running guest, and repairing it.

A tap is not persistent: it lives while QEMU holds its descriptor. Yet root on the host can still delete it
(``ip link del``), and an older podbay stack on the same host once did so by name. QEMU is then left with a
detached descriptor: the guest has no network, and QEMU spins on it (about 70% of a core, measured). The
microvm machine cannot take a new network backend into its NIC, so the repair is a move of the guest into a
fresh QEMU on a fresh tap of the same name and address (:meth:`SandboxManager.renew_vm`): memory, processes
and disk carry on, open TCP connections through the gateway are reset. A paused guest stays paused. If the
move fails, the sandbox is marked failed with the reason and an event, and its QEMU is stopped.

Why repair rather than fail: the guest did nothing wrong, the move costs one snapshot and one restore
(~0.3 s under TCG), and a failed sandbox would lose its running processes.

Every ``tap_check_s`` seconds each VM's tap is checked by name and ifindex, all of them from one listing of the
devices (:meth:`SandboxNetwork.taps_intact`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from podbay.service import wait_stop
from podbay.telemetry import LIFECYCLE_OPERATIONS

if TYPE_CHECKING:
    from .network import Lease
    from ..ops.sandboxes import SandboxManager
    from ..vm.vmhost import RunningVm

__all__ = ["tap_watch_loop", "check_taps"]

log = logging.getLogger("podbay.nodeagent.tapwatch")


async def check_taps(manager: SandboxManager) -> list[str]:
    """Check every VM's tap once and renew the VMs whose tap vanished; returns their sandbox ids."""
    vms = list(manager.vms.items())

    def look() -> tuple[dict[str, Lease], dict[str, bool]]:
        leases = manager.net.leased()
        return leases, manager.net.taps_intact([leases[sid].tap for sid, _ in vms if sid in leases])

    # One worker-thread hop and one device listing per check, whatever the number of VMs.
    leases, intact = await asyncio.to_thread(look)
    renewed: list[str] = []
    for sid, vm in vms:
        lease = leases.get(sid)
        if vm.stopping or lease is None:
            continue
        if intact.get(lease.tap, True):
            continue
        if manager.vms.get(sid) is not vm or vm.stopping:
            continue  # it left or moved on meanwhile (a delete, a RAM release): its tap went with it
        LIFECYCLE_OPERATIONS.labels("nodeagent", "tap_vanished", "seen").inc()
        log.warning("sandbox %s: its tap %s vanished under the running VM", sid, lease.tap)
        # Checked again under the sandbox's lock: an operation that replaced the VM (a rollback, a wake) made
        # a new tap meanwhile, and then there is nothing to repair.
        tap = lease.tap

        def still_vanished(_vm: RunningVm, tap: str = tap) -> bool:
            return not manager.net.tap_intact(tap)

        if await manager.renew_vm(sid, f"its tap {tap} vanished", still=still_vanished):
            renewed.append(sid)
    return renewed


async def tap_watch_loop(manager: SandboxManager, stop: asyncio.Event) -> None:
    """Run :func:`check_taps` every ``settings.tap_check_s`` until ``stop`` (0 turns it off)."""
    period = manager.settings.tap_check_s
    if period <= 0:
        return
    while not stop.is_set():
        if await wait_stop(stop, period):
            return
        try:
            await check_taps(manager)
        except Exception:
            log.exception("tap check failed")
