"""The node agent's warm slots (services/nodeagent/ops/warm.py): fill, claim, health, against a fake VMM, guest and
database (tests/unit/fakes_nodeagent.py). On real VMs: tests/e2e/test_warm_pool.py."""

from __future__ import annotations

import asyncio

from podbay.contracts.messages import WarmClaim
from podbay.lifecycle import Verb
from podbay_nodeagent.ops.warm import WarmPool, slot_hostname

from fakes_nodeagent import NODE, TEMPLATE, Node, node  # noqa: F401  # node: a fixture


async def _slot(node: Node) -> tuple[WarmPool, str]:
    pool = WarmPool(node.manager)
    assert await pool.prepare(node.template)
    (slot_id,) = pool.slots
    return pool, slot_id


def _claim(slot_id: str, generation: int = 1) -> WarmClaim:
    return WarmClaim(operation_id="op_c", sandbox_id=slot_id, tenant_id="tnt_1", generation=generation,
                     hostname=slot_hostname(slot_id))


async def test_prepare_restores_checks_and_stops_a_slot_at_a_low_priority(node: Node) -> None:
    pool, slot_id = await _slot(node)

    assert node.vmm.ops(slot_id) == ["restore", "pause", "set_nice:0"]
    slot = pool.slots[slot_id]
    assert slot.handle.process.config is not None
    assert slot.handle.process.config.nice == node.settings.warm_prepare_nice > 0  # restored at low priority
    assert node.vmm.status_of(slot.handle.process) == "paused"
    assert node.guest.ops(slot_id) == ["connect", "after_restore", "run:true"]
    hygiene = node.guest.channels[0].after_restores[0]
    assert hygiene["hostname"] == slot_hostname(slot_id) and hygiene["env"] == {"PODBAY_SANDBOX_ID": slot_id}
    assert node.db.warm_slots[slot_id]["state"] == "ready" and slot.monitor is not None
    assert pool.preparing == {} and node.net.open_fds() == []


async def test_a_slot_whose_guest_did_not_reseed_is_discarded(node: Node) -> None:
    node.guest.crng_reseeded = False
    pool = WarmPool(node.manager)
    assert not await pool.prepare(node.template)

    (slot_id,) = node.db.warm_slots
    assert node.vmm.ops(slot_id) == ["restore", "kill"] and node.vmm.alive() == []
    assert node.db.warm_slots[slot_id]["state"] == "failed"
    assert node.db.warm_slots[slot_id]["reason"] == "prepare: the guest did not reseed its CRNG"
    assert pool.slots == {} and pool.preparing == {} and not node.vm_dir(slot_id).exists()
    assert node.net.released == [slot_id] and node.net.open_fds() == []


async def test_a_claim_continues_the_slot_and_records_it_running(node: Node) -> None:
    pool, slot_id = await _slot(node)
    node.db.add_sandbox(slot_id, "starting")  # the API's claim inserted it
    reply = await pool.claim(_claim(slot_id))

    assert reply.ok and reply.updated_at is not None, reply.error
    assert node.vmm.ops(slot_id)[-1] == "resume"
    assert node.vmm.status_of(node.manager.vms[slot_id].handle.process) == "running"
    assert set(node.guest.channels[0].after_restores[-1]) == {"time_ns", "hostname"}
    assert node.guest.channels[0].after_restores[-1]["hostname"] is None  # the slot already has its name
    assert node.db.verbs(slot_id) == [Verb.STARTED] and node.db.state(slot_id) == "running"
    assert node.db.operations["op_c"]["state"] == "succeeded" and node.db.events == [(slot_id, "started")]
    assert node.manager.vms[slot_id].channel is node.guest.channels[0]
    assert slot_id not in pool.slots


async def test_a_claim_of_a_row_that_moved_on_discards_the_slot(node: Node) -> None:
    pool, slot_id = await _slot(node)
    node.db.add_sandbox(slot_id, "deleting")
    reply = await pool.claim(_claim(slot_id))

    assert not reply.ok and reply.error == "the sandbox moved on"
    assert [(t.verb, t.applied) for t in node.db.transitions] == [(Verb.STARTED, False)]
    assert node.db.state(slot_id) == "deleting" and slot_id not in node.manager.vms
    assert node.vmm.alive() == [] and node.db.warm_slots[slot_id]["state"] == "failed"


async def test_a_guest_that_fails_the_claim_rolls_the_start_back(node: Node) -> None:
    pool, slot_id = await _slot(node)
    node.db.add_sandbox(slot_id, "starting")
    node.guest.failures["after_restore"] = ConnectionResetError("guestd went away")
    reply = await pool.claim(_claim(slot_id))

    assert not reply.ok and "guestd went away" in (reply.error or "")
    (started,) = node.db.transitions
    assert started.applied and started.rolled_back  # written meanwhile, never committed
    assert node.db.state(slot_id) == "starting" and node.db.events == []  # the API falls back to a restore
    assert slot_id not in node.manager.vms and node.vmm.alive() == []


async def test_an_unknown_slot_is_refused(node: Node) -> None:
    reply = await WarmPool(node.manager).claim(_claim("sbx_nothere00000"))
    assert not reply.ok and reply.error == f"warm slot sbx_nothere00000 is not ready on {NODE}"


async def test_refill_fills_to_the_target_and_discards_the_surplus(node: Node) -> None:
    pool = WarmPool(node.manager)
    node.db.warm_targets[TEMPLATE] = 2
    await pool.refill_once()
    assert len(pool.slots) == 2 and all(r["state"] == "ready" for r in node.db.warm_slots.values())

    node.db.warm_targets[TEMPLATE] = 1
    await pool.refill_once()
    assert len(pool.slots) == 1
    assert sorted(r["state"] for r in node.db.warm_slots.values()) == ["ready", "retired"]
    assert len(node.vmm.alive()) == 1


async def test_after_a_claim_the_refill_restores_nothing_until_the_delay_passed(node: Node) -> None:
    """The refill gives way to a claimed sandbox's first command (``warm_refill_delay_s``): while held, a pool
    at half its target or more restores nothing, and a stop ends the wait; once the delay passed it fills."""
    pool = WarmPool(node.manager)
    node.db.warm_targets[TEMPLATE] = 1
    await pool.refill_once()
    (first,) = pool.slots
    node.db.warm_targets[TEMPLATE] = 2
    node.settings.warm_refill_delay_s = 30.0
    pool.after_claim()
    stop = asyncio.Event()
    refill = asyncio.create_task(pool.refill_once(stop))
    await asyncio.sleep(0.3)
    assert not refill.done() and list(pool.slots) == [first] and pool.preparing == {}
    stop.set()
    await asyncio.wait_for(refill, 5)
    assert list(pool.slots) == [first] and list(node.db.warm_slots) == [first]

    held_until = pool._hold_until
    pool.after_claim()  # claims within a hold do not extend it
    assert pool._hold_until == held_until
    node.settings.warm_refill_delay_s = 0.2
    pool._hold_until = 0.0
    pool.after_claim()
    await asyncio.wait_for(pool.refill_once(asyncio.Event()), 10)
    assert len(pool.slots) == 2


async def test_a_pool_below_half_its_target_refills_without_waiting(node: Node) -> None:
    pool = WarmPool(node.manager)
    node.db.warm_targets[TEMPLATE] = 2
    node.settings.warm_refill_delay_s = 30.0
    pool.after_claim()
    # Empty: the first slot comes at once; at 1 of 2 the hold applies again.
    refill = asyncio.create_task(pool.refill_once(stop := asyncio.Event()))
    await asyncio.sleep(0.3)
    assert len(pool.slots) == 1 and not refill.done()
    stop.set()
    await asyncio.wait_for(refill, 5)
    assert len(pool.slots) == 1


async def test_a_slot_vm_that_runs_or_dies_while_waiting_is_discarded(node: Node) -> None:
    pool = WarmPool(node.manager)
    node.db.warm_targets[TEMPLATE] = 2
    await pool.refill_once()
    running, dying = sorted(pool.slots)
    await pool.slots[running].handle.resume()  # a slot must never run unclaimed
    watch = pool.slots[dying].monitor
    assert watch is not None
    node.vmm.crash(pool.slots[dying].handle.process)
    await watch
    assert dying not in pool.slots and node.db.warm_slots[dying]["state"] == "failed"
    assert node.db.warm_slots[dying]["reason"].startswith("the VM exited while waiting")

    node.db.warm_targets[TEMPLATE] = 0
    await pool.check_health()
    assert pool.slots == {}
    assert node.db.warm_slots[running]["reason"] == "health check: QEMU is running"
    assert node.vmm.alive() == []
