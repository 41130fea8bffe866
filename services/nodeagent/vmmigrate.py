"""QEMU live migration over a socket the node agent opened (drain, issue 8).

QEMU runs confined in its own network namespace (``confine.py``) and cannot open TCP itself, so the node
agents connect to each other and hand the connected socket to QEMU with QMP ``getfd`` (SCM_RIGHTS); the
source runs ``migrate uri=fd:NAME``, the destination ``migrate-incoming uri=fd:NAME``.

What moves in the one stream:

- RAM: copied (``x-ignore-shared`` is turned off for this migration: the RAM file is node-local, unlike a
  snapshot's reflink), pre-copied while the guest runs, so the guest is stopped only for the last dirty
  pages and the device state (QEMU's ``downtime``).
- disk: the ``block`` capability copies ``disk.img`` in the same stream (bulk while running, then the dirty
  blocks); ``zero-blocks`` sends all-zero blocks as a flag instead of their bytes. The destination's disk is a
  sparse file of the same size. Measured against drive-mirror to an NBD export, block migration needs no
  second channel (the NBD server would need its own socket into the confined QEMU) and the template disk is
  mostly zeros, so it was chosen.

The destination QEMU starts with ``-incoming defer`` and without ``-S``: when the stream ends it runs the guest
itself if the source was running (QEMU's global state), so no node-agent round trip adds to the downtime; a
paused source arrives paused.

Completion is awaited through QMP ``MIGRATION`` events (the ``events`` capability), not by polling, bounded by
a timeout. A failed or timed-out outgoing migration is cancelled and the source guest resumes (it was never
given up); the caller tears the destination down.

Errors are the VMM driver's (``vmm.VmOperationError``, ``VmTimeout``, ``VmGone``, ``VmStartError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .vmm import (
    QemuVmm,
    VmConfig,
    VmHandle,
    VmmError,
    VmOperationError,
    VmPaths,
    VmTimeout,
    _send_scm_rights,
)

__all__ = ["MigrationStats", "start_incoming", "accept_incoming", "wait_incoming", "migrate_out", "resume_source"]

log = logging.getLogger("podbay.nodeagent.vmmigrate")

_LIVE_CAPS = {"x-ignore-shared": False, "block": True, "zero-blocks": True, "events": True}
_END_STATES = ("completed", "failed", "cancelled")


class MigrationStats(BaseModel):
    """What ``query-migrate`` reported for a finished outgoing migration."""

    total_ms: float = Field(description="QEMU's total-time: migrate command to completion, ms.")
    downtime_ms: float = Field(description="QEMU's downtime: guest stopped on the source until the end of the "
                                           "stream, ms (0 when the guest was paused anyway).")
    ram_bytes: int = Field(0, description="RAM bytes sent.")
    disk_bytes: int = Field(0, description="Disk bytes sent (block migration); QEMU 7.2 stops reporting it once "
                                           "the migration completed, so it is usually 0.")
    was_running: bool = True


async def _caps(vmm: QemuVmm, vm: VmHandle, caps: dict[str, bool]) -> None:
    await vmm._qmp(vm, "migrate-set-capabilities",  # noqa: SLF001
                   {"capabilities": [{"capability": k, "state": v} for k, v in caps.items()]})


async def _give_socket(vmm: QemuVmm, vm: VmHandle, sock: socket.socket, name: str) -> None:
    """Hand ``sock`` to QEMU as monitor fd ``name``; the caller may close its copy afterwards."""
    _send_scm_rights(vm.qmp, sock.fileno())
    await vmm._qmp(vm, "getfd", {"fdname": name})  # noqa: SLF001


async def start_incoming(vmm: QemuVmm, config: VmConfig, vm_dir: Path, *, disk_size: int,
                         tap_fd: int | None = None) -> VmHandle:
    """Start a QEMU in ``vm_dir`` waiting for a live migration: a sparse ``disk.img`` of ``disk_size`` bytes
    (the source's size; block migration writes into it), fresh RAM file, ``tap_fd`` as the NIC. Raises
    ``VmStartError`` (the directory is left for the caller to remove)."""
    paths = VmPaths(vm_dir)
    paths.dir.mkdir(parents=True, exist_ok=True)
    paths.ram.unlink(missing_ok=True)
    with open(paths.disk, "wb") as f:
        f.truncate(disk_size)
    popen, pid = await vmm._spawn(config, paths, incoming=True, tap_fd=tap_fd, autostart=True)  # noqa: SLF001
    vm: VmHandle | None = None
    try:
        vm = await vmm._connect(paths, pid, popen, config, 5.0)  # noqa: SLF001
        vmm._lock(paths)  # noqa: SLF001
        await _caps(vmm, vm, {"x-ignore-shared": False, "events": True})
        return vm
    except BaseException:
        await vmm._abort_start(vm, popen, pid)  # noqa: SLF001
        raise


async def accept_incoming(vmm: QemuVmm, vm: VmHandle, sock: socket.socket) -> None:
    """Give the accepted connection to the waiting QEMU and start reading the stream (returns at once)."""
    await _give_socket(vmm, vm, sock, "migin")
    await vmm._qmp(vm, "migrate-incoming", {"uri": "fd:migin"})  # noqa: SLF001


async def _wait_end(vmm: QemuVmm, vm: VmHandle, listener: Any, timeout_s: float, what: str) -> dict[str, Any]:
    """Wait for a terminal ``MIGRATION`` event (or QEMU's exit), then return ``query-migrate``."""
    async def events() -> None:
        async for ev in listener:
            if ev.get("data", {}).get("status") in _END_STATES:
                return

    waiter = asyncio.ensure_future(events())
    exited = asyncio.ensure_future(vm._exited.wait())  # noqa: SLF001
    try:
        # The listener was registered before the migrate command, so the terminal event cannot be missed. No
        # query-migrate before it: on a QEMU that itself arrived by migration it can still report that
        # earlier, completed incoming migration.
        done, _ = await asyncio.wait({waiter, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise VmTimeout(f"{what} migration did not finish within {timeout_s} s", details={"op": what})
        if exited in done:
            raise VmOperationError(f"QEMU exited during the {what} migration")
        info = await vmm._qmp(vm, "query-migrate")  # noqa: SLF001
        return info if isinstance(info, dict) else {}
    finally:
        waiter.cancel()
        exited.cancel()
        with contextlib.suppress(BaseException):
            await waiter


async def wait_incoming(vmm: QemuVmm, vm: VmHandle, listener: Any, timeout_s: float) -> str:
    """Wait until the incoming stream ends; returns QEMU's run state (``running`` or ``paused``). Raises
    ``VmOperationError`` when the migration failed, ``VmTimeout`` past ``timeout_s``. ``listener`` is a
    ``vm.qmp.listener("MIGRATION")`` entered before ``accept_incoming`` (so no event is missed)."""
    info = await _wait_end(vmm, vm, listener, timeout_s, "incoming")
    if info.get("status") != "completed":
        raise VmOperationError(f"incoming migration {info.get('status')}: {info.get('error-desc', '')}")
    # autostart: the guest starts right after the last section; give the run state a moment to settle.
    for _ in range(100):
        status = await vmm.query_status(vm)
        if status != "inmigrate":
            return status
        await asyncio.sleep(0.01)
    return await vmm.query_status(vm)


async def migrate_out(vmm: QemuVmm, vm: VmHandle, sock: socket.socket, *, timeout_s: float,
                      max_downtime_ms: int = 50, bandwidth_mib_s: int = 1024) -> MigrationStats:
    """Live-migrate ``vm`` (running or paused) over the connected ``sock``; returns QEMU's figures.

    ``max_downtime_ms`` bounds the stop-and-copy phase QEMU aims for (``downtime-limit``);
    ``bandwidth_mib_s`` is the stream's cap (``max-bandwidth``; QEMU's default of 128 MiB/s made the bulk
    phase over a 2 GiB disk take tens of seconds). On failure or
    timeout the migration is cancelled, ``x-ignore-shared`` restored and a guest that was running resumes;
    then ``VmOperationError``/``VmTimeout`` is raised. On success the source is ``postmigrate`` (stopped);
    the caller kills it once the destination confirmed, or calls :func:`resume_source`.
    """
    was_running = (await vmm.query_status(vm)) == "running"
    await _caps(vmm, vm, _LIVE_CAPS)
    await vmm._qmp(vm, "migrate-set-parameters",  # noqa: SLF001
                   {"downtime-limit": max_downtime_ms, "max-bandwidth": bandwidth_mib_s * 2**20})
    t0 = time.monotonic()
    try:
        with vm.qmp.listener("MIGRATION") as listener:
            await _give_socket(vmm, vm, sock, "migout")
            await vmm._qmp(vm, "migrate", {"uri": "fd:migout"})  # noqa: SLF001
            info = await _wait_end(vmm, vm, listener, timeout_s, "outgoing")
        if info.get("status") != "completed":
            raise VmOperationError(f"outgoing migration {info.get('status')}: {info.get('error-desc', '')}")
    except BaseException:
        await resume_source(vmm, vm, was_running)
        raise
    ram = info.get("ram") or {}
    disk = info.get("disk") or {}
    stats = MigrationStats(total_ms=float(info.get("total-time") or (time.monotonic() - t0) * 1000),
                           downtime_ms=float(info.get("downtime", 0)) if was_running else 0.0,
                           ram_bytes=int(ram.get("transferred", 0)), disk_bytes=int(disk.get("transferred", 0)),
                           was_running=was_running)
    log.info("migrated %s: total %.0f ms, downtime %.1f ms, RAM %d B, disk %d B", vm.dir, stats.total_ms,
             stats.downtime_ms, stats.ram_bytes, stats.disk_bytes)
    return stats


async def resume_source(vmm: QemuVmm, vm: VmHandle, was_running: bool) -> None:
    """Undo an outgoing migration on the source: cancel it, restore the snapshot capabilities, ``cont`` a
    guest that was running. Best effort (a dead QEMU is the caller's ``VmGone`` later)."""
    with contextlib.suppress(VmmError):
        await vmm._qmp(vm, "migrate_cancel")  # noqa: SLF001
    with contextlib.suppress(VmmError):
        await _caps(vmm, vm, {"x-ignore-shared": True, "block": False})
    if was_running and vmm.is_alive(vm):
        with contextlib.suppress(VmmError):
            if (await vmm.query_status(vm)) != "running":
                await vmm._qmp(vm, "cont")  # noqa: SLF001


def disk_size(vm_dir: Path) -> int:
    """Size in bytes of ``vm_dir/disk.img`` (what the destination's sparse disk must match)."""
    return os.stat(VmPaths(vm_dir).disk).st_size
