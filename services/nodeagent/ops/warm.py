"""Warm slots on this node: sandboxes restored from a template snapshot, checked and paused, waiting for a
create to claim them (docs/DESIGN.md §5, warm pools).

Why restored-and-paused rather than QEMUs pre-started with ``-incoming defer``: a deferred QEMU still has
to load the migration state and a cold guest has to answer its first channel HELLO (docs/DESIGN.md §3: ~65 ms
to running, ~160 ms until the guest answers under TCG), while a paused slot whose channel is already
connected needs one QMP ``cont`` (< 1 ms) and one guestd round trip for the clock.

Life of a slot (``warm_slots`` row, id = the id of the sandbox it becomes):

    preparing --restore, HELLO, identity, stop--> ready --claim (API, row lock)--> claimed --> running sandbox
        \\____________________________________________/ \\--VM died / failed check--> failed (discarded)

Preparing restores the template snapshot, then runs the after-restore hygiene
for the sandbox the slot will become (its id is the sandbox id): hostname, a fresh RNG seed with the CRNG
reseeded, env and access token; then one exec, and QMP ``stop``. The API claims a ready row with
``FOR UPDATE SKIP LOCKED`` in the statement that inserts the sandbox (``starting``, generation 1, this
node), then sends ``WarmClaim`` on ``podbay.warm.<node>.claim`` over its open NATS connection. Here the
claim resumes the VM, sets the guest clock (it stood still while the slot waited), and in one statement
records the sandbox ``running`` with its ``started`` event. The clock request is written before QMP
``cont``, so the guest wakes to it; the record is written while the guest wakes, in a transaction that
commits once the guest has answered, so only the commit follows the guest. Anything wrong with the slot
discards it and answers ``ok: false``; the API then falls back to a restore, so the pool never makes a
create fail. A refill task keeps ``warm_targets`` for this node, one slot at a time, within the node's
memory, with the slot's QEMU at nice ``warm_prepare_nice`` from its start until it waits and outside the
node's restore slots (so refills only take the CPU that claims, creates and running sandboxes leave), and
only after a claim's answer has left; every
``warm_interval_s`` it also checks that each waiting VM is alive and stopped (its QEMU's exit is also
noticed at once through the pidfd).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from asyncpg.pool import PoolConnectionProxy
from asyncpg.transaction import Transaction
from prometheus_client import Counter, Gauge

from podbay.contracts.events import EventType
from podbay.channel.client import GuestChannel
from podbay.contracts import subjects
from podbay.contracts.channel import ExecSpec
from podbay.contracts.messages import Resources, WarmClaim, WarmClaimReply
from podbay.contracts.states import OperationState, SandboxState, WarmSlotState
from podbay.errors import PodbayError
from podbay.lifecycle import Verb, outcome_sql, update_sql
from podbay.naming import sandbox_hostname
from podbay.outbox import new_id, sandbox_event
from podbay.telemetry import HOP_SECONDS, LIFECYCLE_OPERATION_SECONDS, LIFECYCLE_OPERATIONS
from podbay import warm_slot_state

from .heartbeat import node_capacity
from ..vm.vmdriver import TemplateImage, VmHandle

if TYPE_CHECKING:
    from collections.abc import Callable

    from .memory import MemoryWatch
    from ..vm.vmhost import VmHost

__all__ = ["WarmSlot", "WarmPool", "WARM_SLOTS", "WARM_SLOT_EVENTS", "STARTED_SQL", "slot_hostname"]

log = logging.getLogger("podbay.nodeagent.warm")

WARM_SLOTS = Gauge("podbay_warm_slots", "Warm slots on this node, by template and state.", ["template", "state"])
WARM_SLOT_EVENTS = Counter("podbay_warm_slot_events_total",
                           "Warm slot events: prepared, claimed, discarded (with why), claim_refused.",
                           ["template", "event"])

#: Discards that are no failure (a pool that shrank, a template that changed, memory pressure): their rows
#: end ``retired``, so a pool's ``failing`` count (``GET /v1/pools``) shows failures only.
RETIRED_EVENTS = frozenset({"surplus", "stale", "memory"})

#: One statement, so one round trip and one transaction: the sandbox ``starting -> running`` (the lifecycle's
#: ``started`` transition, fenced by generation and node), its operation finished, and its ``started`` event
#: in the outbox with the next seq.
STARTED_SQL = (
    "WITH s AS (" + update_sql(Verb.STARTED, [SandboxState.STARTING], sandbox="$1", generation="$2", node="$3",
                               values={"event_seq": "event_seq+1"}, returning="event_seq, updated_at") + "),"
    " o AS (" + outcome_sql(OperationState.SUCCEEDED, operation="$4", where="EXISTS (SELECT 1 FROM s)") + "),"
    " e AS (INSERT INTO outbox (event_id, subject, payload)"
    " SELECT $5, $6, jsonb_set($7::jsonb, '{data,seq}', to_jsonb(s.event_seq)) FROM s)"
    " SELECT updated_at FROM s"
)

#: Bound of the hygiene call on a claimed slot: a guest that does not answer this fast is not healthy.
CLAIM_GUEST_TIMEOUT_S = 5.0


@dataclass
class WarmSlot:
    """A prepared VM waiting paused for a claim; ``channel`` is connected and answered a ping before pausing."""

    id: str
    template: str
    digest: str
    resources: Resources
    handle: VmHandle
    channel: GuestChannel
    monitor: asyncio.Task[None] | None = field(default=None, repr=False)
    taken: bool = False


class WarmPool:
    """The warm slots of one node; ``slots`` maps slot id to ``WarmSlot`` (ready ones only)."""

    def __init__(self, host: VmHost, *, memory: Callable[[WarmPool], MemoryWatch] | None = None) -> None:
        """``memory``: makes the node's memory watch, which measures (and may release) this pool's slots, so
        is made with it; refills then follow its measurements. Without it (unit tests) refills go by the
        templates' memory sizes alone."""
        self.m = host
        self.slots: dict[str, WarmSlot] = {}
        self.preparing: dict[str, str] = {}  # slot id -> template
        self.memory: MemoryWatch | None = memory(self) if memory is not None else None
        self._kick = asyncio.Event()
        # No restore starts before this (loop time): the refill gives way to a claimed sandbox's first command.
        self._hold_until = 0.0
        self._subs: list[object] = []
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ start / stop

    async def reset(self) -> None:
        """Forget slots of an earlier run of this agent (before ``reconcile``, which kills their VMs as
        directories no sandbox claims). Claimed rows stay: their sandboxes are reconciled as creates."""
        await warm_slot_state.forget_node(self.m.pool, self.m.node_id)

    async def start(self) -> None:
        """Answer claims and kicks on this node's subjects (core NATS, over the agent's open connection)."""
        nc = self.m.bus.nc
        self._subs.append(await nc.subscribe(subjects.warm_claim(self.m.node_id), cb=self._on_claim))
        self._subs.append(await nc.subscribe(subjects.warm_kick(self.m.node_id), cb=self._on_kick))

    def kick(self) -> None:
        """Run the refill now rather than at the next interval."""
        self._kick.set()

    async def _on_kick(self, msg: object) -> None:
        self.kick()

    async def _on_claim(self, msg: object) -> None:
        # nats-py runs one subscription's callbacks one after another; claims must not wait for each other.
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: object) -> None:
        try:
            req = WarmClaim.model_validate_json(msg.data)  # type: ignore[attr-defined]  # a nats-py Msg or Subscription, typed object here
        except ValueError as exc:
            reply = WarmClaimReply(ok=False, error=f"malformed claim: {exc}")
        else:
            reply = await self.claim(req)
        try:
            await msg.respond(reply.model_dump_json().encode())  # type: ignore[attr-defined]  # a nats-py Msg or Subscription, typed object here
        except Exception as exc:  # the caller gave up; its fallback fences this sandbox by generation
            log.warning("claim answer for %s not sent: %s", getattr(reply, "error", ""), exc)
        finally:
            self.after_claim()

    async def close(self) -> None:
        """Stop answering; leave the slot VMs (the next start removes them)."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()  # type: ignore[attr-defined]  # a nats-py Msg or Subscription, typed object here
            except Exception:
                pass
        for slot in self.slots.values():
            if slot.monitor:
                slot.monitor.cancel()
            await slot.channel.close()
            await slot.handle.detach()

    # ------------------------------------------------------------------ claim (the hot path)

    async def claim(self, req: WarmClaim) -> WarmClaimReply:
        """Turn ready slot ``req.sandbox_id`` into the running sandbox the API recorded ``starting``.

        Returns ``ok`` False (and discards the slot) when the slot is gone, its VM does not continue or its
        guest does not answer the hygiene in ``CLAIM_GUEST_TIMEOUT_S``, or the row moved on meanwhile.
        """
        t0 = time.perf_counter()
        slot = self.slots.pop(req.sandbox_id, None)
        if slot is None or slot.taken:
            WARM_SLOT_EVENTS.labels("unknown", "claim_refused").inc()
            return WarmClaimReply(ok=False, error=f"warm slot {req.sandbox_id} is not ready on {self.m.node_id}")
        slot.taken = True
        if slot.monitor:
            slot.monitor.cancel()
        self._gauge()
        hops: dict[str, float] = {}
        async with self.m.lock(slot.id):
            failure: Exception | None = None
            async with self.m.pool.acquire() as conn:
                tx = conn.transaction()
                hygiene: asyncio.Task[object] | None = None
                record: asyncio.Task[datetime | None] | None = None
                try:
                    t = time.perf_counter()
                    # Identity and randomness were set when the slot was prepared; only the clock is stale. The
                    # request is written before ``cont``, so the guest wakes to it: its round trip overlaps QMP's.
                    hygiene = asyncio.create_task(asyncio.wait_for(slot.channel.after_restore(
                        time_ns=time.time_ns(),
                        hostname=req.hostname if req.hostname != slot_hostname(slot.id) else None),
                        CLAIM_GUEST_TIMEOUT_S))
                    # ``running`` and its event are written meanwhile, in a transaction committed only once the
                    # guest has answered (nobody sees them before): after the guest only the commit is left.
                    record = asyncio.create_task(self._record_started(conn, tx, slot.id, req))
                    await asyncio.sleep(0)  # let both tasks write their requests
                    await slot.handle.resume()
                    hops["qemu_cont"] = _lap(t, "warm_qemu_cont")
                    await hygiene
                    hops["guest_hygiene"] = _lap(t, "warm_guest_hygiene")
                    t = time.perf_counter()
                    updated_at = await record
                    if updated_at is None:
                        raise _Moved()
                    await tx.commit()
                    hops["db"] = _lap(t, "warm_db")
                    # Inside the lock, so a delete that follows at once finds the VM.
                    self.m.adopt(slot.id, req.generation, slot.resources, slot.handle, slot.channel)
                except BaseException as exc:
                    pending = [task for task in (hygiene, record) if task is not None]
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    if conn.is_in_transaction():
                        with contextlib.suppress(Exception):
                            await tx.rollback()
                    if not isinstance(exc, Exception):
                        raise
                    failure = exc
            if failure is not None:  # the connection is back in the pool: the discard needs one too
                why = "the sandbox moved on" if isinstance(failure, _Moved) else _reason(failure)
                log.warning("claim of warm slot %s refused: %s", slot.id, why)
                await self._discard(slot, f"claim: {why}", event="claim_refused")
                return WarmClaimReply(ok=False, error=why, hops_ms=hops)
        WARM_SLOT_EVENTS.labels(slot.template, "claimed").inc()
        LIFECYCLE_OPERATION_SECONDS.labels("nodeagent", "warm_claim", "ok").observe(time.perf_counter() - t0)
        LIFECYCLE_OPERATIONS.labels("nodeagent", "warm_claim", "ok").inc()
        return WarmClaimReply(ok=True, hops_ms=hops, updated_at=updated_at)

    async def _record_started(self, conn: PoolConnectionProxy, tx: Transaction, slot_id: str,
                              req: WarmClaim) -> datetime | None:
        """Open ``tx`` on ``conn`` and run ``STARTED_SQL`` in it (the caller commits); the row's new
        ``updated_at``, or None when the row is no longer ``starting`` at ``req.generation`` on this node."""
        await tx.start()
        event = sandbox_event(slot_id, EventType.STARTED, seq=0, state="running", node_id=self.m.node_id,
                              tenant_id=req.tenant_id, generation=req.generation, data={"warm": True})
        updated_at: datetime | None = await conn.fetchval(
            STARTED_SQL, slot_id, req.generation, self.m.node_id, req.operation_id, event.id,
            subjects.sandbox_event(slot_id, EventType.STARTED), json.loads(event.model_dump_json()))
        return updated_at

    def after_claim(self) -> None:
        """Relay the ``started`` event and refill the pool: called once the claim's answer is on its way, so
        neither competes with it for the CPU. The refill's restores wait ``warm_refill_delay_s`` more: a
        create is mostly followed at once by the sandbox's first command, and a restore beside it (its
        QMP, channel and hygiene in this agent, the new QEMU's faults) made that command ~25-28 ms instead
        of ~18-20 (measured under TCG, a pool of 2, exec right after the create against 1.5 s later). A
        pool down to less than half its target refills at once: then the next creates need slots more."""
        self.m.relay.kick()
        now = asyncio.get_running_loop().time()
        if now >= self._hold_until:  # claims within a hold do not extend it: a steady stream still refills
            self._hold_until = now + self.m.settings.warm_refill_delay_s
        self.kick()

    async def _hold_off(self, stop: asyncio.Event | None) -> None:
        """Wait until the refill may restore again (see ``after_claim``), or ``stop``."""
        loop = asyncio.get_running_loop()
        while (left := self._hold_until - loop.time()) > 0 and not (stop is not None and stop.is_set()):
            if stop is None:
                await asyncio.sleep(left)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=left)

    # ------------------------------------------------------------------ refill and health

    async def run(self, stop: asyncio.Event) -> None:
        """Refill towards this node's targets and check waiting slots, every ``warm_interval_s`` or on a kick."""
        while not stop.is_set():
            try:
                await self.refill_once(stop)
            except Exception:
                log.exception("warm pool refill failed; trying again")
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.m.settings.warm_interval_s)
            except TimeoutError:
                pass
            self._kick.clear()

    async def refill_once(self, stop: asyncio.Event | None = None) -> None:
        """One pass: discard unhealthy or surplus slots, then prepare missing ones one at a time."""
        await self.check_health()
        rows = await self.m.pool.fetch("SELECT template, target FROM warm_targets WHERE node_id=$1", self.m.node_id)
        targets = {r["template"]: int(r["target"]) for r in rows}
        for slot in list(self.slots.values()):
            tpl = self.m.templates.get(slot.template)
            if tpl is None or tpl.digest != slot.digest:
                await self._discard(slot, "the template changed", event="stale")
        for name in sorted(set(targets) | {s.template for s in self.slots.values()}):
            target = targets.get(name, 0)
            ready = [s for s in self.slots.values() if s.template == name]
            for slot in sorted(ready, key=lambda s: s.id)[: max(0, len(ready) - target)]:
                await self._discard(slot, "above target", event="surplus")
        for name in sorted(targets):
            tpl = self.m.templates.get(name)
            if tpl is None:
                continue
            while stop is None or not stop.is_set():
                # Read again before every restore (each takes about a second): a pool lowered meanwhile stops
                # the refill at once instead of after the whole pass (the next pass discards the surplus).
                target = await self._target(name)
                if self._count(name) >= target:
                    break
                if self._count(name) * 2 >= target:
                    await self._hold_off(stop)
                    if stop is not None and stop.is_set():
                        break
                    if self._count(name) >= await self._target(name):
                        break
                if not await self._has_room(tpl):
                    log.info("warm pool %s: node memory is full at %d of %d slots", name, self._count(name), target)
                    break
                if not await self.prepare(tpl):
                    break  # a failing template would spin; the next pass tries again

    async def _target(self, template: str) -> int:
        """This node's current target for ``template`` (``warm_targets``; 0 when it has none)."""
        target = await self.m.pool.fetchval("SELECT target FROM warm_targets WHERE node_id=$1 AND template=$2",
                                            self.m.node_id, template)
        return int(target or 0)

    def _count(self, template: str) -> int:
        return (sum(1 for s in self.slots.values() if s.template == template)
                + sum(1 for t in self.preparing.values() if t == template))

    async def _has_room(self, tpl: TemplateImage) -> bool:
        """True when one more slot of ``tpl`` fits: by the node's measured memory when there is a measurement
        (:meth:`MemoryWatch.fits`, the rule under which pressure releases slots first, so a refill never
        undoes a release), else by the nominal sizes of its sandboxes and slots against the node's capacity."""
        if self.memory is not None and (fits := self.memory.fits(tpl.snapshot.memory_mib)) is not None:
            return fits
        mem, _ = node_capacity(self.m.settings)
        used = await self.m.pool.fetchval(
            "SELECT coalesce((SELECT sum(memory_mib) FROM sandboxes WHERE node_id=$1"
            " AND state NOT IN ('deleted', 'failed')), 0) + coalesce((SELECT sum(memory_mib) FROM warm_slots"
            " WHERE node_id=$1 AND state IN ('preparing', 'ready')), 0)", self.m.node_id)
        return int(used) + tpl.snapshot.memory_mib <= mem

    async def prepare(self, tpl: TemplateImage) -> bool:
        """Restore one slot of ``tpl``, wait for its guest to answer, stop it, and mark it ready."""
        slot_id = new_id("sbx")
        res = Resources(memory_mib=tpl.snapshot.memory_mib, vcpus=tpl.snapshot.vcpus)
        vm_dir = self.m.store.sandbox_dir(slot_id)
        await warm_slot_state.insert(self.m.pool, slot_id, node_id=self.m.node_id, template=tpl.name,
                                     template_digest=tpl.digest, memory_mib=res.memory_mib, vcpus=res.vcpus)
        self.preparing[slot_id] = tpl.name
        self._gauge()
        handle: VmHandle | None = None
        channel: GuestChannel | None = None
        tap_fd: int | None = None
        t0 = time.perf_counter()
        try:
            # The slot's address, tap and binding are those of the sandbox it becomes (generation 1), so a
            # claim has nothing left to do for the network.
            binding, fd = await asyncio.to_thread(self.m.net.prepare, slot_id, 1)
            tap_fd = fd
            # At nice ``warm_prepare_nice`` from its first instruction, and outside the node's restore slots:
            # a refill only takes CPU that creates, claims and running sandboxes leave, and never makes a
            # create wait for a slot. Refills run one at a time (``refill_once``), so they need no slot.
            try:
                handle = await self.m.driver.restore_from(tpl.snapshot.dir, tpl, vm_dir, memory_mib=res.memory_mib,
                                                          vcpus=res.vcpus, tap_fd=tap_fd,
                                                          nice=self.m.settings.warm_prepare_nice)
            finally:
                os.close(fd)
                tap_fd = None
            channel = await GuestChannel.connect(handle.channel_path, timeout_s=self.m.settings.restore_timeout_s)
            # The slot's id is the id of the sandbox it becomes, so its identity is known now: hostname,
            # env and access token are set here, with a seed of its own (the CRNG is reseeded, so its
            # /dev/urandom already differs from every other guest restored from the template). The claim
            # then only fixes the clock, which stood still while the slot waited. Doing this (and one
            # exec) here also faults those guest paths in from the RAM file and has TCG translate them,
            # which costs ~40-130 ms each on first use under TCG (more execs here were measured and did
            # not make the first command faster).
            hygiene = await channel.after_restore(hostname=slot_hostname(slot_id), seed=os.urandom(64),
                                                  time_ns=time.time_ns(), env={"PODBAY_SANDBOX_ID": slot_id},
                                                  access_token=secrets.token_urlsafe(32),
                                                  net=self.m.guest_net(binding))
            if not hygiene.crng_reseeded:
                raise PodbayError("the guest did not reseed its CRNG")
            await channel.run(ExecSpec(argv=["true"]))
            await handle.pause()
            # Stopped now; once claimed it is a sandbox like any other, so it must not stay behind them.
            await handle.set_nice(0)
            # What a re-attach after a restart reads; a claimed slot always starts at generation 1.
            (vm_dir / "meta.json").write_text(json.dumps(
                {"sandbox_id": slot_id, "generation": 1, "memory_mib": res.memory_mib, "vcpus": res.vcpus}))
            # Listed before its row says ready: a claim may arrive as soon as that commits.
            slot = WarmSlot(slot_id, tpl.name, tpl.digest, res, handle, channel)
            self.slots[slot_id] = slot
            await warm_slot_state.mark_ready(self.m.pool, slot_id)
        except Exception as exc:
            log.warning("warm slot %s of %s not prepared: %s", slot_id, tpl.name, _reason(exc))
            self.slots.pop(slot_id, None)
            self.preparing.pop(slot_id, None)
            await self.m.teardown(handle, channel, vm_dir)
            if tap_fd is not None:
                os.close(tap_fd)
            await self.m.release_net(slot_id)
            await self._mark_failed(slot_id, f"prepare: {_reason(exc)}")
            WARM_SLOT_EVENTS.labels(tpl.name, "prepare_failed").inc()
            self._gauge()
            return False
        self.preparing.pop(slot_id, None)
        if not slot.taken:  # not claimed already in the moment since the row turned ready
            slot.monitor = asyncio.create_task(self._watch(slot), name=f"warm-{slot_id}")
        HOP_SECONDS.labels("nodeagent", "warm_prepare").observe(time.perf_counter() - t0)
        WARM_SLOT_EVENTS.labels(tpl.name, "prepared").inc()
        self._gauge()
        return True

    async def check_health(self) -> None:
        """Discard waiting slots whose QEMU is gone or not stopped (a slot must never run unclaimed), and
        slots whose row is gone or failed (the warm-pool service drops the rows of a node it lost). A
        ``claimed`` row is left alone: its claim request is on its way."""
        listed = {r["id"] for r in await self.m.pool.fetch(
            "SELECT id FROM warm_slots WHERE id = ANY($1::text[]) AND state IN ('preparing', 'ready', 'claimed')", list(self.slots))}
        for slot in list(self.slots.values()):
            if slot.id not in listed and not slot.taken and self.slots.get(slot.id) is slot:
                await self._discard(slot, "its row is gone", event="unlisted")
        for slot in list(self.slots.values()):
            try:
                status = await asyncio.wait_for(slot.handle.status(), 2.0)
            except Exception as exc:
                status = f"unreachable ({_reason(exc)})"
            if status != "paused" and not slot.taken and self.slots.get(slot.id) is slot:
                await self._discard(slot, f"health check: QEMU is {status}", event="unhealthy")

    async def _watch(self, slot: WarmSlot) -> None:
        """Notice at once when a waiting slot's QEMU exits (pidfd), so no claim can receive it."""
        code = await slot.handle.wait_exit()
        if slot.taken or self.slots.get(slot.id) is not slot:
            return
        await self._discard(slot, f"the VM exited while waiting (status {code})", event="vm_exited", watched=True)

    async def _discard(self, slot: WarmSlot, reason: str, *, event: str, watched: bool = False) -> None:
        """Take ``slot`` out of service: kill its VM, remove its files, mark its row ``failed`` (``retired``
        when nothing went wrong: ``event`` in :data:`RETIRED_EVENTS`), refill."""
        if self.slots.get(slot.id) is slot:
            del self.slots[slot.id]
        slot.taken = True
        if slot.monitor and not watched:
            slot.monitor.cancel()
        log.info("warm slot %s discarded: %s", slot.id, reason)
        # A restore of the same sandbox (the API's fallback after a late answer) may own the directory now.
        vm_dir = None if slot.id in self.m.vms else self.m.store.sandbox_dir(slot.id)
        await self.m.teardown(slot.handle, slot.channel, vm_dir)
        if vm_dir is not None:
            await self.m.release_net(slot.id)
        await self._mark_failed(slot.id, reason, state="retired" if event in RETIRED_EVENTS else "failed")
        WARM_SLOT_EVENTS.labels(slot.template, event).inc()
        self._gauge()
        self.kick()

    async def release(self, slot_id: str, reason: str) -> bool:
        """Discard the waiting slot ``slot_id`` to free its memory (retired, event ``memory``); False when it
        is no longer waiting (claimed or gone meanwhile)."""
        slot = self.slots.get(slot_id)
        if slot is None or slot.taken:
            return False
        await self._discard(slot, reason, event="memory")
        return True

    async def _mark_failed(self, slot_id: str, reason: str, *, state: str = "failed") -> None:
        # A claimed row belongs to its sandbox now (the API falls back to a restore for it).
        await warm_slot_state.end(self.m.pool, slot_id, reason, state=WarmSlotState(state))

    def _gauge(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for s in self.slots.values():
            counts[(s.template, "ready")] = counts.get((s.template, "ready"), 0) + 1
        for t in self.preparing.values():
            counts[(t, "preparing")] = counts.get((t, "preparing"), 0) + 1
        for name in self.m.templates:
            for state in ("ready", "preparing"):
                WARM_SLOTS.labels(name, state).set(counts.get((name, state), 0))


def slot_hostname(slot_id: str) -> str:
    """The hostname of the sandbox a slot becomes: the slot's id is the sandbox's."""
    return sandbox_hostname(slot_id)


class _Moved(Exception):
    """The sandbox row is no longer ``starting`` at the claimed generation on this node."""


def _lap(t: float, hop: str) -> float:
    dt = time.perf_counter() - t
    HOP_SECONDS.labels("nodeagent", hop).observe(dt)
    return round(dt * 1000, 3)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, PodbayError):
        return exc.message
    if isinstance(exc, TimeoutError):
        return "the guest did not answer in time"
    return f"{type(exc).__name__}: {exc}"
