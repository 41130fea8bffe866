"""The node agent's sandbox manager: create by restore, delete, re-attach, and notice dying VMs.

Every handler is idempotent and fenced by generation (docs/DESIGN.md §4): it reads the sandbox row first and
does nothing when the row has moved on (another generation, another node, already in the target state).
A state change and its event commit in one transaction (outbox), and only then is the command acked, so a
crash between the two makes JetStream redeliver and the handler finish or skip the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg

from podbay.bus import Bus
from podbay.channel.client import GuestChannel
from podbay.contracts.channel import ExecSpec, GuestNet
from podbay.config import ConfigError, Settings
from podbay.contracts import subjects
from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, OperationDone, Resources, SandboxOpCmd
from podbay.contracts.egress import NetBinding
from podbay.errors import NotFound, PodbayError, StaleGeneration, Unavailable
from podbay.hostca import load_guest_ca
from podbay import lifecycle
from podbay.contracts.states import OperationState
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.outbox import Relay
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS
from podbay.vmprocs import vm_processes

from .diskgrow import grow_root
from .network import SandboxNetwork
from .snapshots import SnapshotOps
from .store import NodeStore
from .vmdriver import TemplateImage, VmDriver, VmHandle
from .vmhost import HibernatedVm, RunningVm
from .volumes import VolumeStore

if TYPE_CHECKING:
    from .build.builder import TemplateBuilder
    from .migrate import MigrationOps
    from .suspend import SuspendOps

__all__ = ["SandboxManager"]

log = logging.getLogger("podbay.nodeagent.sandboxes")


class SandboxManager:
    """Owns the VMs of one node. ``vms`` maps sandbox id to ``RunningVm``."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: Bus, relay: Relay, store: NodeStore,
                 driver: VmDriver, net: SandboxNetwork) -> None:
        self.settings = settings
        self.net = net
        self.pool = pool
        self.bus = bus
        self.relay = relay
        self.store = store
        self.driver = driver
        self.vms: dict[str, RunningVm] = {}
        self.hibernated: dict[str, HibernatedVm] = {}
        self.templates: dict[str, TemplateImage] = {}
        self.volumes = VolumeStore(store.volumes_dir, pool, settings.node_id)
        # Earlier builds of a template that sandboxes still run on, by (name, digest); loaded on demand.
        self._older_templates: dict[tuple[str, str], TemplateImage] = {}
        self.ready = False
        self.command_sub: object | None = None  # the node's bound command consumer, for /readyz
        self._locks: dict[str, asyncio.Lock] = {}
        # Guests restored all at once share the cores and may all miss their HELLO timeout under TCG; a
        # bounded number at a time finish in order (creates, rollbacks, fork children, warm slots).
        self.restore_slots = asyncio.Semaphore(settings.restore_concurrency or os.cpu_count() or 1)
        self.snapshots = SnapshotOps(self)
        self.suspend_ops: SuspendOps  # set by main once the node's object store is open
        self.migrations: MigrationOps  # set by main (answers live migrations into this node)
        self.builder: TemplateBuilder  # set by main (template builds on this node)
        #: Called with a sandbox's id when it leaves this node (:meth:`release_net`), by modules above this one
        #: that keep something per sandbox in memory (credential fill's values and masks, computer_fill.py);
        #: they register here because this module may not import them. Each must be quick and not raise.
        self.on_leave: list[Callable[[str], None]] = []
        # The operator's extra CAs (GUEST_CA_FILE), read once: every guest gets them with its network.
        try:
            self.guest_ca_pem = load_guest_ca(settings.guest_ca_file)
        except ValueError as exc:
            raise ConfigError(f"PODBAY_GUEST_CA_FILE: {exc}") from exc

    @property
    def node_id(self) -> str:
        return self.settings.node_id

    def guest_net(self, binding: NetBinding) -> GuestNet:
        """What ``after_restore.net`` tells a guest: its network and sandbox CA (``SandboxNetwork.guest_net``)
        and the node's extra CAs (``GUEST_CA_FILE``), which replace the guest's earlier ones each time."""
        net = self.net.guest_net(binding)
        return net.model_copy(update={"extra_ca_pem": self.guest_ca_pem}) if self.guest_ca_pem else net

    @property
    def accel(self) -> str:
        return self.driver.accel

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def load(self) -> tuple[int, int, int, list[str]]:
        """(memory MiB, vCPUs, sandbox count, template names) for heartbeats."""
        mem = sum(v.resources.memory_mib for v in self.vms.values())
        cpu = sum(v.resources.vcpus for v in self.vms.values())
        return mem, cpu, len(self.vms), sorted(self.templates)

    async def template(self, name: str, digest: str) -> TemplateImage:
        """The build ``digest`` of template ``name``: the current one (``templates``, what new creates use) or
        an earlier build still in the node store or build cache, loaded once and cached, or a build another
        node promoted, fetched from object storage. Raises ``NotFound`` when none holds it (a sandbox's memory
        snapshot only restores on the build it came from)."""
        cur = self.templates.get(name)
        if cur is not None and cur.digest == digest:
            return cur
        img = self._older_templates.get((name, digest))
        if img is None:
            img = await asyncio.to_thread(self.driver.find_template, name, digest)
            if img is None:
                # Built on another node and promoted: fetched once into the store (template_fetch.py).
                from .template_fetch import fetch_promoted

                fetched = await fetch_promoted(self, name, digest)
                if fetched is not None:
                    return fetched
                have = f"build {cur.digest[:12]}" if cur is not None else "no build of it"
                raise NotFound(f"template {name!r} build {digest[:12]} (the sandbox's) is not on node "
                               f"{self.node_id}, which has {have}")
            log.info("template %s: using earlier build %s from the node store", name, digest[:12])
            self._older_templates[(name, digest)] = img
        return img

    def channel(self, sandbox_id: str, generation: int | None) -> GuestChannel:
        """The guest channel of a running sandbox; ``NotFound``, ``StaleGeneration`` or ``Unavailable``."""
        vm = self.vms.get(sandbox_id)
        if vm is None:
            raise NotFound(f"sandbox {sandbox_id} is not running on node {self.node_id}")
        if generation is not None and generation != vm.generation:
            raise StaleGeneration(f"sandbox {sandbox_id} is at generation {vm.generation}, not {generation}")
        if vm.stopping or vm.channel is None:
            raise Unavailable(f"sandbox {sandbox_id} is stopping or paused")
        return vm.channel

    def adopt(self, sandbox_id: str, generation: int, resources: Resources, handle: VmHandle,
              channel: GuestChannel | None, *, paused_at: float | None = None,
              net_pending: GuestNet | None = None) -> RunningVm:
        """Register a VM that runs on this node in ``vms`` and watch it (a QEMU that dies on its own marks the
        sandbox failed): the one way a VM enters the registry, whether this agent restored it, re-attached to
        it, received it by migration or took it from the warm pool. ``paused_at`` (``time.monotonic()``) when
        it is stopped; ``net_pending``: network settings its guest gets at the next resume."""
        vm = RunningVm(sandbox_id, generation, resources, handle, channel, paused_at=paused_at,
                       net_pending=net_pending)
        self.vms[sandbox_id] = vm
        vm.monitor = asyncio.create_task(self._monitor(vm), name=f"monitor-{sandbox_id}")
        return vm

    # ------------------------------------------------------------------ create

    async def create(self, cmd: CreateSandboxCmd) -> None:
        """Restore the template snapshot as sandbox ``cmd.sandbox_id`` and mark it running."""
        async with self.lock(cmd.sandbox_id):
            row = await self.pool.fetchrow(
                "SELECT state, generation, node_id, disk_mib FROM sandboxes WHERE id = $1", cmd.sandbox_id)
            if row is None or row["node_id"] != self.node_id or row["generation"] != cmd.generation:
                log.info("create %s: stale or unknown (generation %s), skipping", cmd.sandbox_id, cmd.generation)
                return
            if row["state"] != "starting":
                log.info("create %s: already %s, nothing to do", cmd.sandbox_id, row["state"])
                return
            await self._create_locked(cmd, disk_mib=row["disk_mib"])

    async def _create_locked(self, cmd: CreateSandboxCmd, *, disk_mib: int | None = None) -> None:
        # ``bring_up`` resolves the build and fails the sandbox with the reason when it is missing.
        await self.bring_up(cmd.sandbox_id, cmd.generation, cmd.resources, cmd.hostname, cmd.tenant_id,
                            template=cmd.template, template_digest=cmd.template_digest, snapshot_dir=None,
                            operation_id=cmd.operation_id, event="started", kind="create",
                            disk_bytes=disk_mib << 20 if disk_mib else None)

    async def bring_up(self, sandbox_id: str, generation: int, resources: Resources, hostname: str, tenant_id: str,
                       *, template: str, template_digest: str, snapshot_dir: Path | None, operation_id: str,
                       event: str, kind: str, boot_disk: Path | None = None, data: dict[str, object] | None = None,
                       from_state: str = "starting", disk_bytes: int | None = None) -> bool:
        """Start the sandbox's VM from ``snapshot_dir`` (a full snapshot of its own; None: the template's) or,
        with ``boot_disk``, by a fresh boot on that disk, on the template build ``template_digest`` (see
        ``template``); run the after-restore hygiene; mark it running with ``event``. Called under the sandbox's
        lock with the row in ``from_state`` at ``generation``. ``disk_bytes``: grow the root disk and its
        filesystem to this size before the sandbox counts as running (diskgrow.py). On failure the sandbox
        becomes ``failed`` with the reason. Returns True when it runs."""
        t0 = time.perf_counter()
        vm_dir = self.store.sandbox_dir(sandbox_id)
        handle: VmHandle | None = None
        channel: GuestChannel | None = None
        tap_fd: int | None = None
        try:
            tpl = await self.template(template, template_digest)
            await self.discard_vm_dir(vm_dir)  # leftovers of an earlier, interrupted attempt
            volumes = await self.volumes.attach(sandbox_id, vm_dir)  # into the slots before QEMU starts
            # Its address, tap and binding (a new CA for a new generation) exist before the guest runs.
            binding, fd = await asyncio.to_thread(self.net.prepare, sandbox_id, generation)
            tap_fd = fd
            async with self.restore_slots:
                t = time.perf_counter()
                if boot_disk is not None:
                    handle = await self.driver.boot_disk(boot_disk, tpl, vm_dir, memory_mib=resources.memory_mib,
                                                         vcpus=resources.vcpus, tap_fd=tap_fd)
                    connect_timeout = self.settings.boot_timeout_s
                else:
                    handle = await self.driver.restore_from(snapshot_dir or tpl.snapshot.dir, tpl, vm_dir,
                                                            memory_mib=resources.memory_mib, vcpus=resources.vcpus,
                                                            tap_fd=tap_fd)
                    connect_timeout = self.settings.restore_timeout_s
                os.close(fd)  # QEMU holds the tap now; it goes away with QEMU
                tap_fd = None
                HOP_SECONDS.labels("nodeagent", "qemu_restore").observe(time.perf_counter() - t)
                t = time.perf_counter()
                channel = await GuestChannel.connect(handle.channel_path, timeout_s=connect_timeout)
            hygiene = await channel.after_restore(hostname=hostname, seed=os.urandom(64), time_ns=time.time_ns(),
                                                  env={"PODBAY_SANDBOX_ID": sandbox_id},
                                                  access_token=secrets.token_urlsafe(32),
                                                  net=self.guest_net(binding), volumes=volumes)
            if not hygiene.crng_reseeded:
                # Older guests or a refused ioctl: the seed still lands at the kernel's next reseed.
                log.warning("sandbox %s: guest CRNG not reseeded; /dev/urandom follows the snapshot until "
                            "the kernel's next reseed", sandbox_id)
            HOP_SECONDS.labels("nodeagent", "guest_hygiene").observe(time.perf_counter() - t)
            if disk_bytes is not None and (grown := await grow_root(handle, channel, vm_dir / "disk.img",
                                                                    disk_bytes)) is not None:
                data = {**(data or {}), "disk_grow_ms": round(grown, 1)}  # in the started event
            (vm_dir / "meta.json").write_text(json.dumps(
                {"sandbox_id": sandbox_id, "generation": generation,
                 "memory_mib": resources.memory_mib, "vcpus": resources.vcpus}))
            t = time.perf_counter()
            async with self.pool.acquire() as conn, conn.transaction():
                updated = await lifecycle.apply(
                    conn, sandbox_id, Verb.STARTED, states=from_state, generation=generation, node=self.node_id,
                    values={"failure_reason": None},
                    operation=OperationOutcome(operation_id, OperationState.SUCCEEDED)
                    if operation_id and kind == "create" else None,
                    event=SandboxEvent(event, node_id=self.node_id, tenant_id=tenant_id, generation=generation,
                                       data={**(data or {}), "ms": round((time.perf_counter() - t0) * 1000, 1)}))
                if updated is None:
                    raise _Superseded()
            HOP_SECONDS.labels("nodeagent", "db").observe(time.perf_counter() - t)
            self.relay.kick()
            self.adopt(sandbox_id, generation, resources, handle, channel)
            LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", kind, "ok").observe(time.perf_counter() - t0)
            LIFECYCLE_OPERATIONS.labels("nodeagent", kind, "ok").inc()
            log.info("sandbox %s running after %s (%.0f ms)", sandbox_id, kind, (time.perf_counter() - t0) * 1000)
            return True
        except _Superseded:
            log.info("%s %s: superseded while starting; discarding the VM", kind, sandbox_id)
            await self.teardown(handle, channel, vm_dir)
            await self.release_net(sandbox_id)
            return False
        except Exception as exc:
            reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
            log.warning("%s %s failed: %s", kind, sandbox_id, reason)
            await self.teardown(handle, channel, vm_dir)
            await self.release_net(sandbox_id)
            LIFECYCLE_OPERATIONS.labels("nodeagent", kind, "failed").inc()
            await self.mark_failed(sandbox_id, generation, reason,
                                    operation_id=operation_id if kind == "create" else None,
                                    from_states=(from_state,))
            return False
        finally:
            if tap_fd is not None:
                os.close(tap_fd)

    # ------------------------------------------------------------------ delete

    async def delete(self, cmd: DeleteSandboxCmd) -> None:
        """Stop and remove the sandbox's VM, then mark it deleted (idempotent)."""
        async with self.lock(cmd.sandbox_id):
            row = await self.pool.fetchrow(
                "SELECT state, node_id, tenant_id, generation FROM sandboxes WHERE id = $1", cmd.sandbox_id)
            if row is None or row["state"] == "deleted" or row["node_id"] != self.node_id:
                return
            await self._sync_volumes(cmd.sandbox_id)
            await self.stop_vm(cmd.sandbox_id)
            await self.discard_vm_dir(self.store.sandbox_dir(cmd.sandbox_id))
            await self.release_net(cmd.sandbox_id)
            await self.snapshots.discard(cmd.sandbox_id)
            async with self.pool.acquire() as conn, conn.transaction():
                await lifecycle.apply(
                    conn, cmd.sandbox_id, Verb.DELETED, states=lifecycle.sources(Verb.DELETED),
                    operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED, always=True),
                    event=SandboxEvent("deleted", node_id=self.node_id, tenant_id=row["tenant_id"],
                                       generation=row["generation"]))
            self.relay.kick()
            LIFECYCLE_OPERATIONS.labels("nodeagent", "delete", "ok").inc()
            self._locks.pop(cmd.sandbox_id, None)

    async def _sync_volumes(self, sandbox_id: str) -> None:
        """Have a running guest with read-write volumes write its dirty pages back (``sync``) before its VM is
        killed: a volume outlives its sandbox (a later sandbox mounts it), and a kill drops what the guest's
        page cache held. Best effort: a guest that does not answer within 15 s is killed all the same."""
        vm = self.vms.get(sandbox_id)
        if vm is None or vm.channel is None or vm.paused_at is not None:
            return
        if not await self.pool.fetchval(
                "SELECT true FROM sandbox_volumes WHERE sandbox_id=$1 AND NOT readonly LIMIT 1", sandbox_id):
            return
        try:
            await asyncio.wait_for(vm.channel.run(ExecSpec(argv=["sync"], timeout_s=10)), 15)
        except Exception as exc:  # noqa: BLE001 - the delete goes on; the guest's unsynced writes are lost
            log.warning("sync of %s's volumes before delete failed: %s", sandbox_id, exc)

    # ------------------------------------------------------------------ pause / resume

    async def pause(self, cmd: SandboxOpCmd) -> None:
        """Pause the sandbox's vCPUs (QMP ``stop``) and record ``paused``; idempotent and fenced."""
        await self._pause_resume(cmd, pause=True)

    async def resume(self, cmd: SandboxOpCmd) -> None:
        """Resume (QMP ``cont``), correct the guest clock, record ``running``; idempotent and fenced."""
        await self._pause_resume(cmd, pause=False)

    async def hibernate(self, sandbox_id: str) -> bool:
        """Release a paused sandbox's RAM (docs/DESIGN.md §7: ≥ 1,000 paused per node): save its device state,
        move RAM and disk into ``vm_dir/hib`` (reflinks, which also write dirty pages back), and let QEMU
        exit. ``resume`` restores it from there. Returns True when it was hibernated."""
        async with self.lock(sandbox_id):
            vm = self.vms.get(sandbox_id)
            state = await self.pool.fetchval("SELECT state FROM sandboxes WHERE id=$1", sandbox_id)
            if vm is None or vm.stopping or state != "paused":
                return False
            t = time.perf_counter()
            await self._release_ram(vm)
            HOP_SECONDS.labels("nodeagent", "hibernate").observe(time.perf_counter() - t)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "hibernate", "ok").inc()
            log.info("sandbox %s paused for long: RAM released (%.0f ms)", sandbox_id, (time.perf_counter() - t) * 1000)
            return True

    async def continue_vm(self, vm: RunningVm) -> None:
        """Let a stopped VM run (QMP ``cont``), connect its channel if it has none, and give the guest the time
        and any pending network settings: its clock stood still while stopped (docs/DESIGN.md §3: no vmgenid on
        microvm; guestd fixes it). Raises what the VMM or the channel raise."""
        vm.paused_at = None
        await vm.handle.resume()
        if vm.channel is None or vm.channel.closed:
            vm.channel = await GuestChannel.connect(vm.handle.channel_path, timeout_s=10.0)
        await vm.channel.after_restore(time_ns=time.time_ns(), net=vm.net_pending)
        vm.net_pending = None

    async def _release_ram(self, vm: RunningVm) -> None:
        """Save ``vm`` (memory, devices, disk) into ``vm_dir/hib`` (reflinks, which also write dirty pages
        back) and let its QEMU go: it leaves ``vms`` for ``hibernated``. The caller holds the sandbox's lock."""
        vm_dir = self.store.sandbox_dir(vm.sandbox_id)
        part, hib = vm_dir / "hib.part", vm_dir / "hib"
        await asyncio.to_thread(shutil.rmtree, part, True)
        await self.driver.snapshot_full(vm.handle, part, leave_stopped=True)
        os.replace(part, hib)
        self.vms.pop(vm.sandbox_id, None)
        vm.stopping = True
        await self.teardown(vm.handle, vm.channel, None)
        for name in ("ram", "disk.img"):
            (vm_dir / name).unlink(missing_ok=True)  # the page cache of the live RAM file goes with it
        self.hibernated[vm.sandbox_id] = HibernatedVm(vm.sandbox_id, vm.generation, vm.resources)

    async def renew_vm(self, sandbox_id: str, why: str, *, still: Callable[[RunningVm], bool] | None = None) -> bool:
        """Move a live VM into a fresh QEMU on a fresh tap, the guest's memory, processes and disk intact: its
        state goes to ``vm_dir/hib`` (as a RAM release does), the old QEMU is killed, and a restore on a new tap
        of the same name and address takes over, running again if it ran before. Used when the host side of
        its network vanished (``tapwatch``): QEMU cannot be given a new tap backend on the microvm machine, and
        its old one spins on a dead descriptor. Returns True when renewed, False when the VM is gone or
        stopping, or when ``still(vm)``, asked once the sandbox's lock is held, says the reason is gone (another
        operation replaced the VM meanwhile). If any step fails, the sandbox is marked failed with ``why`` and
        the error (no QEMU is left behind)."""
        async with self.lock(sandbox_id):
            vm = self.vms.get(sandbox_id)
            if vm is None or vm.stopping or (still is not None and not still(vm)):
                return False
            was_running = vm.paused_at is None
            t = time.perf_counter()
            try:
                await self._release_ram(vm)
                await self.wake_hibernated(sandbox_id)
                fresh = self.vms[sandbox_id]
                if was_running:
                    await self.continue_vm(fresh)
                else:
                    fresh.paused_at = vm.paused_at
            except Exception as exc:
                reason = f"{why}; renewing its VM failed: " + (
                    exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}")
                log.error("sandbox %s: %s", sandbox_id, reason)
                LIFECYCLE_OPERATIONS.labels("nodeagent", "renew_vm", "failed").inc()
                vm.stopping = True
                await self.teardown(vm.handle, vm.channel, None)
                await self.stop_vm(sandbox_id)  # the new VM, if it came up
                await self.release_net(sandbox_id)
                await self.mark_failed(sandbox_id, vm.generation, reason)
                return False
            HOP_SECONDS.labels("nodeagent", "renew_vm").observe(time.perf_counter() - t)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "renew_vm", "ok").inc()
            log.warning("sandbox %s: %s; moved to a new VM on a new tap (%.0f ms)", sandbox_id, why,
                        (time.perf_counter() - t) * 1000)
            return True

    async def wake_hibernated(self, sandbox_id: str) -> None:
        """Restore a hibernated sandbox, still paused, into ``self.vms`` (caller holds the lock)."""
        hv = self.hibernated[sandbox_id]
        row = await self.pool.fetchrow("SELECT template, template_digest FROM sandboxes WHERE id=$1", sandbox_id)
        tpl = await self.template(row["template"], row["template_digest"])
        vm_dir = self.store.sandbox_dir(sandbox_id)
        # Its tap went with the QEMU that exited; the guest keeps its address, so it gets the same one back.
        before = await asyncio.to_thread(self.net.binding, sandbox_id)
        binding, tap_fd = await asyncio.to_thread(self.net.prepare, sandbox_id, hv.generation)
        try:
            handle = await self.driver.restore_from(vm_dir / "hib", tpl, vm_dir, memory_mib=hv.resources.memory_mib,
                                                    vcpus=hv.resources.vcpus, paused=True, tap_fd=tap_fd)
        finally:
            os.close(tap_fd)
        await asyncio.to_thread(shutil.rmtree, vm_dir / "hib", True)
        del self.hibernated[sandbox_id]
        self.adopt(sandbox_id, hv.generation, hv.resources, handle, None, paused_at=time.monotonic(),
                   net_pending=None if before == binding else self.guest_net(binding))

    async def lease_expired(self, sandbox_id: str, action: str, *, reason: str = "lease expired") -> None:
        """Apply a lease's action to an idle sandbox: pause it, or delete it (an operation of its own); a pause's
        event carries ``reason`` (``memory pressure`` when services/nodeagent/memory.py makes room)."""
        from podbay.outbox import new_id

        op_id = new_id("op")
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow("SELECT tenant_id, generation, state FROM sandboxes WHERE id=$1 FOR UPDATE",
                                      sandbox_id)
            if row is None or row["state"] != "running":
                return
            await conn.execute("INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES"
                               " ($1,$2,$3,$4,'pending')", op_id, row["tenant_id"], sandbox_id, action)
            if action == "delete":
                await lifecycle.apply(conn, sandbox_id, Verb.DELETE, states=row["state"])
        if action == "delete":
            await self.delete(DeleteSandboxCmd(operation_id=op_id, sandbox_id=sandbox_id, generation=row["generation"]))
        else:
            if reason == "lease expired":  # E2B's filesystem-only auto-pause: its disk snapshot first
                await self.snapshots.filesystem_pause_point(sandbox_id)
            await self._pause_resume(SandboxOpCmd(operation_id=op_id, sandbox_id=sandbox_id,
                                                  generation=row["generation"]), pause=True, reason=reason)

    async def _pause_resume(self, cmd: SandboxOpCmd, *, pause: bool, reason: str | None = None) -> None:
        verb, target, source = ("pause", "paused", "running") if pause else ("resume", "running", "paused")
        t0 = time.perf_counter()
        async with self.lock(cmd.sandbox_id):
            row = await self.pool.fetchrow(
                "SELECT state, generation, node_id, tenant_id FROM sandboxes WHERE id = $1", cmd.sandbox_id)
            if row is None or row["node_id"] != self.node_id or row["generation"] != cmd.generation:
                await self.finish_op(cmd.operation_id, f"stale generation {cmd.generation}")
                return
            if row["state"] == target:
                await self.finish_op(cmd.operation_id, None)  # a repeated call: already done
                return
            if not pause and cmd.sandbox_id in self.hibernated:
                try:
                    await self.wake_hibernated(cmd.sandbox_id)
                except Exception as exc:
                    reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
                    await self.finish_op(cmd.operation_id, f"could not wake the sandbox: {reason}")
                    return
            vm = self.vms.get(cmd.sandbox_id)
            if row["state"] != source or vm is None:
                await self.finish_op(cmd.operation_id, f"the sandbox is {row['state']}")
                return
            try:
                t = time.perf_counter()
                if pause:
                    await vm.handle.pause()
                    vm.paused_at = time.monotonic()
                else:
                    await self.continue_vm(vm)
                HOP_SECONDS.labels("nodeagent", f"qemu_{verb}").observe(time.perf_counter() - t)
            except Exception as exc:
                reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
                LIFECYCLE_OPERATIONS.labels("nodeagent", verb, "failed").inc()
                await self.finish_op(cmd.operation_id, reason)
                return
            async with self.pool.acquire() as conn, conn.transaction():
                await lifecycle.apply(
                    conn, cmd.sandbox_id, Verb.PAUSE if pause else Verb.RESUME, states=source,
                    generation=cmd.generation,
                    operation=OperationOutcome(cmd.operation_id, OperationState.SUCCEEDED, always=True),
                    event=SandboxEvent("paused" if pause else "resumed", reason=reason, node_id=self.node_id,
                                       tenant_id=row["tenant_id"], generation=cmd.generation,
                                       data={"operation_id": cmd.operation_id}))
            self.relay.kick()
            await self.notify_op(cmd.operation_id, None)
            LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", verb, "ok").observe(time.perf_counter() - t0)
            LIFECYCLE_OPERATIONS.labels("nodeagent", verb, "ok").inc()

    async def finish_op(self, operation_id: str, error: str | None) -> None:
        """Record an operation's outcome (``error`` None: succeeded) and send its notice."""
        if error is None:
            await self.pool.execute(
                "UPDATE operations SET state='succeeded', finished_at=now() WHERE id=$1 AND state <> 'succeeded'",
                operation_id)
        else:
            await self.pool.execute(
                "UPDATE operations SET state='failed', error_code='invalid_state', error_message=$2,"
                " finished_at=now() WHERE id=$1", operation_id, error)
        await self.notify_op(operation_id, error)

    async def notify_op(self, operation_id: str, error: str | None) -> None:
        body = OperationDone(operation_id=operation_id, state="failed" if error else "succeeded", error=error)
        try:
            await self.bus.nc.publish(subjects.operation_done(operation_id), body.model_dump_json().encode())
        except Exception as exc:  # the notice only wakes a waiting caller; the row is the truth
            log.debug("operation notice for %s not sent: %s", operation_id, exc)

    # ------------------------------------------------------------------ helpers

    async def release_net(self, sandbox_id: str) -> None:
        """The sandbox left this node (deleted, suspended, migrated away, fenced) or failed: release its
        address, tap, binding and CA files, and run the ``on_leave`` hooks. Every such path calls this; a
        hibernation (the sandbox stays paused on this node) does not."""
        for hook in self.on_leave:
            hook(sandbox_id)
        try:
            await asyncio.to_thread(self.net.release, sandbox_id)
        except Exception as exc:  # housekeeping; a restart prunes what is left
            log.warning("releasing the network of %s failed: %s", sandbox_id, exc)

    async def stop_vm(self, sandbox_id: str) -> None:
        self.hibernated.pop(sandbox_id, None)
        vm = self.vms.pop(sandbox_id, None)
        if vm is None:
            return
        vm.stopping = True
        if vm.monitor:
            vm.monitor.cancel()
        await self.teardown(vm.handle, vm.channel, None)

    async def teardown(self, handle: VmHandle | None, channel: GuestChannel | None, vm_dir: Path | None) -> None:
        if channel is not None:
            try:
                await channel.close()
            except Exception:
                pass
        if handle is not None:
            try:
                await handle.kill()
            except Exception as exc:
                log.warning("killing VM failed: %s", exc)
        if vm_dir is not None:
            await self.discard_vm_dir(vm_dir)

    async def discard_vm_dir(self, vm_dir: Path) -> None:
        """Kill what still runs for ``vm_dir`` (the QEMU in ``qemu.pid``, and any QEMU or bubblewrap naming the
        directory: a start cut short by a crash leaves QEMU running before its pidfile is written), wait until
        they are gone (so the sandbox's tap is free again), then remove the directory."""
        if not vm_dir.exists():
            return
        pids = await asyncio.to_thread(vm_processes, vm_dir)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            if not any(_pid_alive(pid) for pid in pids):
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(shutil.rmtree, vm_dir, True)

    async def mark_failed(self, sandbox_id: str, generation: int, reason: str, *, operation_id: str | None = None,
                           from_states: tuple[str, ...] = ("starting", "running", "paused")) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            # The event names the row's tenant (the default of emit_sandbox_event).
            await lifecycle.apply(
                conn, sandbox_id, Verb.FAIL, states=from_states, generation=generation, node=self.node_id,
                values={"failure_reason": reason},
                operation=OperationOutcome(operation_id, OperationState.FAILED, error_code="sandbox_failed",
                                           error_message=reason, unless_succeeded=True, always=True)
                if operation_id else None,
                event=SandboxEvent("failed", reason=reason, node_id=self.node_id, generation=generation))
        self.relay.kick()

    async def _monitor(self, vm: RunningVm) -> None:
        """Notice a QEMU that dies on its own: mark the sandbox failed with the reason, publish the event."""
        code = await vm.handle.wait_exit()
        # Collect the QMP reader's EOF now, so it is not reported as an unretrieved exception later.
        await vm.handle.detach()
        if vm.stopping or self.vms.get(vm.sandbox_id) is not vm:
            return
        async with self.lock(vm.sandbox_id):
            if vm.stopping or self.vms.get(vm.sandbox_id) is not vm:
                return
            self.vms.pop(vm.sandbox_id, None)
            if vm.channel is not None:
                try:
                    await vm.channel.close()
                except Exception:
                    pass
            # An attached (not child) QEMU's exit status cannot be read; say only what is known.
            reason = "the VM exited unexpectedly" + (f" (QEMU status {code})" if code is not None else "")
            log.warning("sandbox %s: %s", vm.sandbox_id, reason)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "vm_exit", "failed").inc()
            await self.release_net(vm.sandbox_id)
            await self.mark_failed(vm.sandbox_id, vm.generation, reason)

    async def close(self) -> None:
        """Disconnect from guests but leave VMs running: the next start re-attaches (clean upgrade path)."""
        for vm in list(self.vms.values()):
            vm.stopping = True
            if vm.monitor:
                vm.monitor.cancel()
            if vm.channel is not None:
                try:
                    await vm.channel.close()
                except Exception:
                    pass
            await vm.handle.detach()


class _Superseded(Exception):
    """The sandbox row moved on (deleted, new generation) while this node was restoring it."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still "exists"; treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
