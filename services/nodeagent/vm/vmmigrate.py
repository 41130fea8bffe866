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

Pre-copy (copying RAM while the guest runs) needs every guest store to mark its page dirty. Under TCG, QEMU
before 9.0 does not: the fast path of ``cpu_physical_memory_sync_dirty_bitmap`` clears the dirty bits of
aligned ranges without resetting the TCG TLB's dirty state, so stores through a cached TLB entry are lost
(upstream commit 03bfc2188f, "physmem: Fix migration dirty bitmap coherency with TCG memory access", QEMU
9.0). Seen here as destination guests dying of slab corruption or a jump to 0 seconds after the switch
(``tests/e2e/test_vm_live_migration.py`` sweeps a buffer and catches the lost stores). Such a QEMU migrates a
running guest stop-and-copy for its RAM instead (:func:`precopy_safe`): QEMU sends no RAM page before block
migration's bulk pass over the disk ends (``qemu_savevm_state_iterate`` moves to the next section only once
one reports its stage complete), so the guest keeps running through the disk's bulk pass (block dirty
tracking is the block layer's and sound), is stopped just before it ends, and is resumed on the destination
by :func:`arrive`. The downtime is the disk's tail, the RAM and the device state. KVM tracks dirty pages in
the kernel and always pre-copies.

Completion is awaited through QMP ``MIGRATION`` events (the ``events`` capability), not by polling, bounded by
a timeout. A failed or timed-out outgoing migration is cancelled and the source guest resumes (it was never
given up); the caller tears the destination down.

Everything here goes through the public :class:`vmm.Vmm` interface (QMP commands, handing QEMU a socket,
QMP events), so the unit tests drive it with a fake. Errors are the VMM driver's (``vmm.VmOperationError``,
``VmTimeout``, ``VmGone``, ``VmStartError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .vmm import VmConfig, Vmm, VmmError, VmOperationError, VmPaths, VmProcess, VmTimeout

__all__ = ["MigrationStats", "start_incoming", "accept_incoming", "wait_incoming", "arrive", "migrate_out",
           "resume_source", "precopy_safe", "stop_before_ram"]

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
    precopy: bool = Field(True, description="RAM was copied while the guest ran; False: the guest was stopped "
                                            "before its RAM moved (see precopy_safe), the downtime runs from "
                                            "that stop to the end of the stream.")


# First QEMU whose TCG marks every store dirty during a migration (upstream commit 03bfc2188f).
_TCG_PRECOPY_FIXED = (9, 0)
# Stop-and-copy of RAM: how often the disk's bulk pass is watched, and how close to its end the guest stops
# (a floor, and the time the pass needs at its measured rate): far enough that the pass cannot end, and RAM
# start to move, between two looks.
_WATCH_S = 0.02
_STOP_AHEAD_BYTES = 64 * 2**20
_STOP_AHEAD_S = 0.25


async def precopy_safe(vmm: Vmm, vm: VmProcess) -> bool:
    """True when ``vm``'s QEMU tracks every guest store while RAM is copied: KVM always, TCG from QEMU 9.0
    (QMP ``query-version``; see the module docstring)."""
    if vm.config is not None and vm.config.accel == "kvm":
        return True
    ver = await vmm.execute(vm, "query-version")
    q = ver.get("qemu", {}) if isinstance(ver, dict) else {}
    return (int(q.get("major", 0)), int(q.get("minor", 0))) >= _TCG_PRECOPY_FIXED


async def _caps(vmm: Vmm, vm: VmProcess, caps: dict[str, bool]) -> None:
    await vmm.execute(vm, "migrate-set-capabilities",
                      {"capabilities": [{"capability": k, "state": v} for k, v in caps.items()]})


async def _give_socket(vmm: Vmm, vm: VmProcess, sock: socket.socket, name: str) -> None:
    """Hand ``sock`` to QEMU as monitor fd ``name``; the caller may close its copy afterwards."""
    await vmm.give_fd(vm, sock.fileno(), name)


async def start_incoming(vmm: Vmm, config: VmConfig, vm_dir: Path, *, disk_size: int,
                         tap_fd: int | None = None) -> VmProcess:
    """Start a QEMU in ``vm_dir`` waiting for a live migration: a sparse ``disk.img`` of ``disk_size`` bytes
    (the source's size; block migration writes into it), fresh RAM file, ``tap_fd`` as the NIC. Raises
    ``VmStartError`` (the directory is left for the caller to remove)."""
    paths = VmPaths(vm_dir)
    paths.dir.mkdir(parents=True, exist_ok=True)
    paths.ram.unlink(missing_ok=True)
    with open(paths.disk, "wb") as f:
        f.truncate(disk_size)
    vm = await vmm.start_incoming(config, paths, tap_fd=tap_fd)
    try:
        await _caps(vmm, vm, {"x-ignore-shared": False, "events": True})
        return vm
    except BaseException:
        await vmm.kill(vm)
        raise


async def accept_incoming(vmm: Vmm, vm: VmProcess, sock: socket.socket) -> None:
    """Give the accepted connection to the waiting QEMU and start reading the stream (returns at once)."""
    await _give_socket(vmm, vm, sock, "migin")
    await vmm.execute(vm, "migrate-incoming", {"uri": "fd:migin"})


async def _wait_end(vmm: Vmm, vm: VmProcess, listener: AsyncIterable[Mapping[str, Any]], timeout_s: float, what: str) -> dict[str, Any]:
    """Wait for a terminal ``MIGRATION`` event (or QEMU's exit), then return ``query-migrate``."""
    async def events() -> None:
        async for ev in listener:
            if ev.get("data", {}).get("status") in _END_STATES:
                return

    waiter = asyncio.ensure_future(events())
    exited = asyncio.ensure_future(vmm.wait_exit(vm))
    try:
        # The listener was registered before the migrate command, so the terminal event cannot be missed. No
        # query-migrate before it: on a QEMU that itself arrived by migration it can still report that
        # earlier, completed incoming migration.
        done, _ = await asyncio.wait({waiter, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise VmTimeout(f"{what} migration did not finish within {timeout_s} s", details={"op": what})
        if exited in done:
            raise VmOperationError(f"QEMU exited during the {what} migration")
        info = await vmm.execute(vm, "query-migrate")
        return info if isinstance(info, dict) else {}
    finally:
        waiter.cancel()
        exited.cancel()
        with contextlib.suppress(BaseException):
            await waiter


async def wait_incoming(vmm: Vmm, vm: VmProcess, listener: AsyncIterable[Mapping[str, Any]], timeout_s: float) -> str:
    """Wait until the incoming stream ends; returns QEMU's run state (``running`` or ``paused``). Raises
    ``VmOperationError`` when the migration failed, ``VmTimeout`` past ``timeout_s``. ``listener`` is a
    ``vmm.events(vm, "MIGRATION")`` entered before ``accept_incoming`` (so no event is missed)."""
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


async def arrive(vmm: Vmm, vm: VmProcess, state: str, was_running: bool) -> str:
    """Finish an arrival: a guest that ran on the source but arrived ``paused`` (stop-and-copy, see
    :func:`precopy_safe`) is resumed here. Returns the guest's run state now."""
    if state == "paused" and was_running:
        await vmm.resume(vm)
        return "running"
    return state


async def stop_before_ram(vmm: Vmm, vm: VmProcess) -> float | None:
    """Watch an outgoing migration (``query-migrate``) and stop the guest before its first RAM page is sent,
    letting most of the disk's bulk pass run with the guest running. Returns the ``time.monotonic()`` of the
    stop, or None when the migration ended first (the caller's wait reports how)."""
    last: tuple[float, int] | None = None
    while True:
        info = await vmm.execute(vm, "query-migrate")
        if not isinstance(info, dict) or info.get("status") in _END_STATES:
            return None
        ram, disk = info.get("ram") or {}, info.get("disk") or {}
        now, sent = time.monotonic(), int(disk.get("transferred", 0))
        rate = (sent - last[1]) / (now - last[0]) if last and now > last[0] else 0.0
        last = (now, sent)
        ram_started = int(ram.get("normal", 0)) + int(ram.get("duplicate", 0)) > 0
        if (info.get("status") == "active" and
                (ram_started or int(disk.get("remaining", 0)) <= max(_STOP_AHEAD_BYTES, rate * _STOP_AHEAD_S))):
            if ram_started:
                log.warning("%s: RAM started to move before the guest was stopped; stores in that window may "
                            "be lost (QEMU before 9.0 under TCG)", vm.dir)
            await vmm.pause(vm)
            return time.monotonic()
        await asyncio.sleep(_WATCH_S)


async def migrate_out(vmm: Vmm, vm: VmProcess, sock: socket.socket, *, timeout_s: float,
                      max_downtime_ms: int = 50, bandwidth_mib_s: int = 1024) -> MigrationStats:
    """Live-migrate ``vm`` (running or paused) over the connected ``sock``; returns QEMU's figures.

    A running guest on a QEMU that is not :func:`precopy_safe` is stopped before its RAM moves and arrives
    paused (the destination resumes it, :func:`arrive`); its ``downtime_ms`` is measured here from the stop
    to the end of the stream.

    ``max_downtime_ms`` bounds the stop-and-copy phase QEMU aims for (``downtime-limit``);
    ``bandwidth_mib_s`` is the stream's cap (``max-bandwidth``; QEMU's default of 128 MiB/s made the bulk
    phase over a 2 GiB disk take tens of seconds). On failure or
    timeout the migration is cancelled, ``x-ignore-shared`` restored and a guest that was running resumes;
    then ``VmOperationError``/``VmTimeout`` is raised. On success the source is ``postmigrate`` (stopped);
    the caller kills it once the destination confirmed, or calls :func:`resume_source`.
    """
    was_running = (await vmm.query_status(vm)) == "running"
    precopy = not was_running or await precopy_safe(vmm, vm)
    await _caps(vmm, vm, _LIVE_CAPS)
    await vmm.execute(vm, "migrate-set-parameters",
                   {"downtime-limit": max_downtime_ms, "max-bandwidth": bandwidth_mib_s * 2**20})
    t0 = time.monotonic()
    stopped_at: float | None = None
    watch: asyncio.Future[float | None] | None = None
    try:
        with vmm.events(vm, "MIGRATION") as listener:
            await _give_socket(vmm, vm, sock, "migout")
            await vmm.execute(vm, "migrate", {"uri": "fd:migout"})
            if not precopy:
                watch = asyncio.ensure_future(stop_before_ram(vmm, vm))
            info = await _wait_end(vmm, vm, listener, timeout_s, "outgoing")
            if watch is not None:
                stopped_at = await watch
        if info.get("status") != "completed":
            raise VmOperationError(f"outgoing migration {info.get('status')}: {info.get('error-desc', '')}")
    except BaseException:
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
        await resume_source(vmm, vm, was_running)
        raise
    ram = info.get("ram") or {}
    disk = info.get("disk") or {}
    elapsed_ms = (time.monotonic() - t0) * 1000
    if not was_running:
        downtime_ms = 0.0
    elif precopy:
        downtime_ms = float(info.get("downtime", 0))
    else:
        downtime_ms = round((time.monotonic() - (stopped_at or t0)) * 1000, 1)
    stats = MigrationStats(total_ms=float(info.get("total-time") or elapsed_ms), downtime_ms=downtime_ms,
                           ram_bytes=int(ram.get("transferred", 0)), disk_bytes=int(disk.get("transferred", 0)),
                           was_running=was_running, precopy=precopy)
    log.info("migrated %s (%s): total %.0f ms, downtime %.1f ms, RAM %d B, disk %d B", vm.dir,
             "pre-copy" if precopy else "stop-and-copy", stats.total_ms, stats.downtime_ms, stats.ram_bytes,
             stats.disk_bytes)
    return stats


async def resume_source(vmm: Vmm, vm: VmProcess, was_running: bool) -> None:
    """Undo an outgoing migration on the source: cancel it, restore the snapshot capabilities, ``cont`` a
    guest that was running. Best effort (a dead QEMU is the caller's ``VmGone`` later)."""
    with contextlib.suppress(VmmError):
        await vmm.execute(vm, "migrate_cancel")
    with contextlib.suppress(VmmError):
        await _caps(vmm, vm, {"x-ignore-shared": True, "block": False})
    if was_running and vmm.is_alive(vm):
        with contextlib.suppress(VmmError):
            if (await vmm.query_status(vm)) != "running":
                await vmm.execute(vm, "cont")


def disk_size(vm_dir: Path) -> int:
    """Size in bytes of ``vm_dir/disk.img`` (what the destination's sparse disk must match)."""
    return os.stat(VmPaths(vm_dir).disk).st_size
