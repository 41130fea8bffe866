"""The node's VM registry: the VMs this agent runs, and the one way a VM enters, leaves and is watched.

:class:`VmRegistry` implements :class:`services.nodeagent.vm.vmhost.VmHost`, the interface the operation modules
(create.py, pause.py, delete.py, snapshots.py, suspend.py, migrate.py, warm.py) are written against. It holds
the node's shared parts (settings, pool, bus, relay, store, VMM driver, network, volumes, templates), the
per-sandbox locks, and the registry proper: ``vms`` and ``hibernated``. A VM enters through :meth:`adopt`
(or :meth:`bring_up`, which starts one from a snapshot and adopts it), is watched by a monitor task (a QEMU
that dies on its own fails its sandbox), and leaves through :meth:`stop_vm`, :meth:`teardown` and
:meth:`discard_vm_dir`. This module imports no operation module; they are wired on top of it
(services/nodeagent/ops/sandboxes.py).

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

from podbay.contracts.events import EventType
from podbay import lifecycle
from podbay.bus import Bus
from podbay.channel.client import GuestChannel
from podbay.config import ConfigError, Settings
from podbay.contracts import subjects
from podbay.contracts.channel import GuestNet
from podbay.contracts.egress import NetBinding
from podbay.contracts.messages import OperationDone, Resources
from podbay.contracts.states import OperationState
from podbay.errors import NotFound, PodbayError, StaleGeneration, Unavailable
from podbay.hostca import load_guest_ca
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay.outbox import Relay
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS
from podbay.vmprocs import vm_processes
from podbay import operation_state

from ..storage.diskgrow import grow_root
from ..net.network import SandboxNetwork
from ..storage.store import NodeStore
from ..vm.vmdriver import TemplateImage, VmDriver, VmHandle
from ..vm.vmhost import HibernatedVm, RunningVm, Snapshots
from ..storage.volumes import VolumeStore

if TYPE_CHECKING:
    from podbay.objstore import ObjectStore

__all__ = ["VmRegistry"]

log = logging.getLogger("podbay.nodeagent.registry")


class VmRegistry:
    """Owns the VMs of one node (``vms``: sandbox id to ``RunningVm``; ``hibernated``: to ``HibernatedVm``) and
    the node's shared parts; implements ``VmHost`` once the layer above sets ``snapshots``."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: Bus, relay: Relay, store: NodeStore,
                 driver: VmDriver, net: SandboxNetwork, *, objects: ObjectStore | None = None,
                 templates: dict[str, TemplateImage] | None = None) -> None:
        """``objects``: the node's object store (promoted template builds and volumes are fetched from it; a
        registry made without one, in tests, fetches nothing). ``templates``: the node's templates by name, as
        imported and loaded at start (kept, not copied: builds add to it)."""
        self.settings = settings
        self.net = net
        self.pool = pool
        self.bus = bus
        self.relay = relay
        self.store = store
        self.driver = driver
        self.vms: dict[str, RunningVm] = {}
        self.hibernated: dict[str, HibernatedVm] = {}
        self.templates: dict[str, TemplateImage] = templates if templates is not None else {}
        self.volumes = VolumeStore(store.volumes_dir, pool, settings.node_id, objects=objects,
                                   settings=settings if objects is not None else None)
        # Earlier builds of a template that sandboxes still run on, by (name, digest); loaded on demand.
        self._older_templates: dict[tuple[str, str], TemplateImage] = {}
        self.ready = False
        self.command_sub: object | None = None  # the node's bound command consumer, for /readyz
        self._locks: dict[str, asyncio.Lock] = {}
        # Guests restored all at once share the cores and may all miss their HELLO timeout under TCG; a
        # bounded number at a time finish in order (creates, rollbacks, fork children, warm slots).
        self.restore_slots = asyncio.Semaphore(settings.restore_concurrency or os.cpu_count() or 1)
        #: the node's snapshot handlers (snapshots.py), set by the module that wires the operations on top of
        #: this one (sandboxes.py): a delete discards a sandbox's snapshots and a suspend takes one through it
        self.snapshots: Snapshots
        #: the node's object store (promoted template builds are fetched from it)
        self.objects: ObjectStore
        if objects is not None:
            self.objects = objects
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

    def forget_lock(self, sandbox_id: str) -> None:
        """Drop the lock of a sandbox that is gone from this node for good (deleted)."""
        self._locks.pop(sandbox_id, None)

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
                from ..build.template_fetch import fetch_promoted

                fetched = await fetch_promoted(self, name, digest)
                if fetched is not None:
                    return fetched
                have = f"build {cur.digest[:12]}" if cur is not None else "no build of it"
                raise NotFound(f"template {name!r} build {digest[:12]} (the sandbox's) is not on node "
                               f"{self.node_id}, which has {have}")
            log.info("template %s: using earlier build %s from the node store", name, digest[:12])
            self._older_templates[(name, digest)] = img
        return img

    def forget_template_build(self, name: str, digest: str) -> None:
        """Drop the cached earlier build ``digest`` of ``name`` (its files were removed from the node store)."""
        self._older_templates.pop((name, digest), None)

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

    async def bring_up(self, sandbox_id: str, generation: int, resources: Resources, hostname: str, tenant_id: str,
                       *, template: str, template_digest: str, snapshot_dir: Path | None, operation_id: str,
                       event: EventType, kind: str, boot_disk: Path | None = None, data: dict[str, object] | None = None,
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

    async def continue_vm(self, vm: RunningVm) -> None:
        """Let a stopped VM run (QMP ``cont``), connect its channel if it has none, and give the guest the time
        and any pending network settings: its clock stood still while stopped (docs/DESIGN.md §3: no vmgenid on
        microvm; guestd fixes it). Raises what the VMM or the channel raise."""
        vm.paused_at = None
        await vm.handle.resume()
        if vm.channel is None or vm.channel.closed:
            # A guest just restored translates its code anew under TCG: on a loaded node its HELLO takes as long
            # as a restore's does (the soak saw 10 s run out at a load average of 22).
            vm.channel = await GuestChannel.connect(vm.handle.channel_path, timeout_s=self.settings.restore_timeout_s)
        await vm.channel.after_restore(time_ns=time.time_ns(), net=vm.net_pending)
        vm.net_pending = None

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

    async def finish_op(self, operation_id: str, error: str | None) -> None:
        """Record an operation's outcome (``error`` None: succeeded) and send its notice."""
        if error is None:
            await operation_state.succeed(self.pool, operation_id)
        else:
            await operation_state.fail(self.pool, operation_id, "invalid_state", error)
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
                event=SandboxEvent(EventType.FAILED, reason=reason, node_id=self.node_id, generation=generation))
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
