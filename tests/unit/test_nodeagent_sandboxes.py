"""The node agent's create, pause and resume, delete and VM registry (services/nodeagent/ops/create.py, pause.py,
delete.py and registry.py, through sandboxes.py's ``SandboxManager`` that wires them) against a fake VMM, a fake
guest and a fake database (tests/unit/fakes_nodeagent.py). The same operations on real VMs:
tests/e2e/test_sandbox_api.py, test_lease.py, test_vm_death.py."""

from __future__ import annotations

from podbay.contracts.subjects import operation_done
from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, Resources, SandboxOpCmd
from podbay.lifecycle import Verb
from podbay_nodeagent.vm.vmm import VmOperationError

from fakes_nodeagent import DIGEST, NODE, TEMPLATE, Node, node, settle  # noqa: F401  # node: a fixture

SBX = "sbx_000000000001"


def _create(generation: int = 1) -> CreateSandboxCmd:
    return CreateSandboxCmd(operation_id="op_create", sandbox_id=SBX, tenant_id="tnt_1", template=TEMPLATE,
                            template_digest=DIGEST, generation=generation,
                            resources=Resources(memory_mib=256, vcpus=1), hostname="sbx-000000000001")


def _op(op_id: str, generation: int = 1) -> SandboxOpCmd:
    return SandboxOpCmd(operation_id=op_id, sandbox_id=SBX, generation=generation)


async def _running(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting")
    await node.manager.create(_create())
    assert node.db.state(SBX) == "running"


# ------------------------------------------------------------------------------------------------- create


async def test_create_restores_the_template_runs_the_hygiene_and_records_started(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting")
    await node.manager.create(_create())

    assert node.vmm.ops(SBX) == ["restore"]
    assert node.guest.ops(SBX) == ["connect", "after_restore"]
    hygiene = node.guest.channels[0].after_restores[0]
    assert hygiene["hostname"] == "sbx-000000000001" and hygiene["env"] == {"PODBAY_SANDBOX_ID": SBX}
    assert len(hygiene["seed"]) == 64 and hygiene["net"].address == "10.77.0.2"
    assert node.db.verbs(SBX) == [Verb.STARTED] and node.db.state(SBX) == "running"
    assert node.db.operations["op_create"]["state"] == "succeeded"
    assert node.db.events == [(SBX, "started")]
    vm = node.manager.vms[SBX]
    assert vm.generation == 1 and vm.channel is node.guest.channels[0] and vm.monitor is not None
    assert node.relay.kicks == 1
    assert node.net.open_fds() == []  # QEMU holds the tap; the agent's copy is closed
    assert (node.vm_dir(SBX) / "meta.json").exists()


async def test_create_of_a_stale_generation_or_another_state_does_nothing(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting", generation=2)
    await node.manager.create(_create(generation=1))
    node.db.sandboxes[SBX].update(generation=1, state="running")
    await node.manager.create(_create(generation=1))
    assert node.vmm.calls == [] and node.db.transitions == [] and SBX not in node.manager.vms


async def test_a_failing_restore_fails_the_sandbox_and_leaves_nothing_behind(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting")
    node.vmm.fail_next("restore")
    await node.manager.create(_create())

    assert node.db.verbs(SBX) == [Verb.FAIL] and node.db.state(SBX) == "failed"
    assert "fake restore failed" in node.db.sandboxes[SBX]["failure_reason"]
    assert node.db.operations["op_create"]["state"] == "failed"
    assert SBX not in node.manager.vms and not node.vm_dir(SBX).exists()
    assert node.net.released == [SBX] and node.net.open_fds() == []


async def test_a_guest_that_does_not_answer_is_killed_and_the_sandbox_failed(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting")
    node.guest.failures["after_restore"] = TimeoutError("no HELLO")
    await node.manager.create(_create())

    assert node.vmm.ops(SBX) == ["restore", "kill"]
    assert node.guest.ops(SBX) == ["connect", "after_restore", "close"]
    assert node.vmm.alive() == [] and node.db.state(SBX) == "failed"
    assert SBX not in node.manager.vms and node.net.released == [SBX]


async def test_a_sandbox_deleted_while_it_started_is_discarded_not_failed(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting")
    node.guest.on_connect = lambda: node.db.sandboxes[SBX].update(state="deleting")  # the API's delete lands
    await node.manager.create(_create())

    assert [(t.verb, t.applied) for t in node.db.transitions] == [(Verb.STARTED, False)]
    assert node.db.state(SBX) == "deleting"  # not failed: the delete owns it now
    assert node.vmm.alive() == [] and SBX not in node.manager.vms and not node.vm_dir(SBX).exists()


# ----------------------------------------------------------------------------------------- pause / resume


async def test_pause_stops_the_vcpus_and_resume_continues_and_fixes_the_clock(node: Node) -> None:
    await _running(node)
    await node.manager.pause(_op("op_pause"))
    vm = node.manager.vms[SBX]
    assert node.vmm.status_of(vm.handle.process) == "paused" and vm.paused_at is not None
    assert node.db.state(SBX) == "paused" and node.db.operations["op_pause"]["state"] == "succeeded"

    await node.manager.resume(_op("op_resume"))
    assert node.vmm.ops(SBX) == ["restore", "pause", "resume"]
    assert node.guest.ops(SBX)[-1] == "after_restore"
    assert set(node.guest.channels[0].after_restores[-1]) == {"time_ns", "net"}  # only the clock
    assert node.vmm.status_of(vm.handle.process) == "running" and vm.paused_at is None
    assert node.db.verbs(SBX) == [Verb.STARTED, Verb.PAUSE, Verb.RESUME]
    assert [e for _, e in node.db.events] == ["started", "paused", "resumed"]
    assert [s for s, _ in node.bus.nc.published] == [operation_done("op_pause"), operation_done("op_resume")]


async def test_a_repeated_pause_is_done_without_touching_the_vm(node: Node) -> None:
    await _running(node)
    await node.manager.pause(_op("op_1"))
    await node.manager.pause(_op("op_2"))
    assert node.vmm.ops(SBX).count("pause") == 1
    assert node.db.operations["op_2"]["state"] == "succeeded"


async def test_a_pause_the_vmm_refuses_fails_the_operation_and_keeps_the_sandbox_running(node: Node) -> None:
    await _running(node)
    node.vmm.fail_next("pause", VmOperationError("QMP refused stop"))
    await node.manager.pause(_op("op_pause"))
    assert node.db.state(SBX) == "running" and node.db.verbs(SBX) == [Verb.STARTED]
    assert node.db.operations["op_pause"] == {"id": "op_pause", "state": "failed",
                                              "error_message": "QMP refused stop"}
    assert node.manager.vms[SBX].paused_at is None


async def test_a_pause_of_a_stale_generation_is_refused(node: Node) -> None:
    await _running(node)
    await node.manager.pause(_op("op_pause", generation=2))
    assert node.db.state(SBX) == "running" and "pause" not in node.vmm.ops(SBX)
    assert node.db.operations["op_pause"]["error_message"] == "stale generation 2"


async def test_a_hibernated_sandbox_is_restored_paused_then_continued_on_resume(node: Node) -> None:
    await _running(node)
    await node.manager.pause(_op("op_pause"))
    assert await node.manager.hibernate(SBX)
    await settle()
    assert SBX in node.manager.hibernated and SBX not in node.manager.vms
    assert node.vmm.ops(SBX) == ["restore", "pause", "snapshot_full", "kill", "detach"]  # detach: its monitor
    assert node.db.state(SBX) == "paused"  # the exit of a QEMU let go is no failure
    assert (node.vm_dir(SBX) / "hib" / "state").exists()

    await node.manager.resume(_op("op_resume"))
    assert node.vmm.ops(SBX)[5:] == ["restore_paused", "resume"]
    assert node.guest.ops(SBX)[-2:] == ["connect", "after_restore"]  # a new channel to the new QEMU
    assert SBX not in node.manager.hibernated and node.db.state(SBX) == "running"
    assert not (node.vm_dir(SBX) / "hib").exists() and node.net.open_fds() == []


async def test_the_resume_of_a_hibernated_sandbox_waits_for_its_guest_as_long_as_a_restore(node: Node) -> None:
    # A just-restored guest on a loaded node can take longer than 10 s to say HELLO (seen in the soak).
    node.settings.restore_timeout_s = 47.0
    await _running(node)
    await node.manager.pause(_op("op_pause"))
    assert await node.manager.hibernate(SBX)
    await settle()
    await node.manager.resume(_op("op_resume"))
    assert node.db.state(SBX) == "running"
    assert node.guest.connect_timeouts[-1] == 47.0


# ------------------------------------------------------------------------------------------------- delete


async def test_delete_kills_the_vm_removes_its_files_and_records_deleted(node: Node) -> None:
    await _running(node)
    node.db.sandboxes[SBX]["state"] = "deleting"  # the API's DELETE transition
    await node.manager.delete(DeleteSandboxCmd(operation_id="op_del", sandbox_id=SBX, generation=1))

    assert node.vmm.ops(SBX)[-1] == "kill" and node.vmm.alive() == []
    assert node.guest.ops(SBX)[-1] == "close"
    assert SBX not in node.manager.vms and not node.vm_dir(SBX).exists()
    assert node.db.verbs(SBX) == [Verb.STARTED, Verb.DELETED] and node.db.state(SBX) == "deleted"
    assert node.db.operations["op_del"]["state"] == "succeeded" and node.net.released == [SBX]


async def test_delete_of_a_sandbox_already_deleted_or_elsewhere_does_nothing(node: Node) -> None:
    node.db.add_sandbox(SBX, "deleting", node_id="node-2")
    await node.manager.delete(DeleteSandboxCmd(operation_id="op_del", sandbox_id=SBX, generation=1))
    assert node.db.transitions == [] and node.net.released == []


# ----------------------------------------------------------------------------------------------- registry


async def test_a_vm_that_exits_on_its_own_is_unregistered_and_its_sandbox_failed(node: Node) -> None:
    await _running(node)
    vm = node.manager.vms[SBX]
    node.vmm.crash(vm.handle.process, code=-11)
    assert vm.monitor is not None
    await vm.monitor

    assert SBX not in node.manager.vms and node.db.state(SBX) == "failed"
    assert node.db.sandboxes[SBX]["failure_reason"] == "the VM exited unexpectedly (QEMU status -11)"
    assert node.guest.ops(SBX)[-1] == "close" and node.net.released == [SBX]
    assert node.vmm.ops(SBX)[-1] == "detach"


async def test_a_vm_stopped_by_the_agent_is_not_reported_as_failed(node: Node) -> None:
    await _running(node)
    vm = node.manager.vms[SBX]
    await node.manager.stop_vm(SBX)
    await settle()
    assert vm.stopping and vm.monitor is not None and vm.monitor.cancelled()
    assert node.db.state(SBX) == "running" and node.db.verbs(SBX) == [Verb.STARTED]
    assert node.vmm.alive() == []


async def test_adopt_registers_and_watches_an_attached_vm(node: Node) -> None:
    node.db.add_sandbox(SBX, "running")
    process = await node.vmm.restore(node.template.snapshot.dir, node.vm_dir(SBX), None)
    handle = await node.manager.driver.attach(node.vm_dir(SBX))
    assert handle.process is process
    vm = node.manager.adopt(SBX, 1, Resources(memory_mib=256, vcpus=1), handle, None, paused_at=1.0)
    assert node.manager.vms[SBX] is vm and vm.paused_at == 1.0
    assert node.manager.load() == (256, 1, 1, [TEMPLATE])
    node.vmm.crash(process)
    assert vm.monitor is not None
    await vm.monitor
    assert SBX not in node.manager.vms and node.db.verbs(SBX) == [Verb.FAIL]


async def test_teardown_and_discard_kill_close_and_remove(node: Node) -> None:
    node.db.add_sandbox(SBX, "running")
    handle = await node.manager.driver.restore(node.template, node.vm_dir(SBX), memory_mib=256, vcpus=1)
    channel = await node.guest.connect(handle.channel_path)
    await node.manager.teardown(handle, channel, node.vm_dir(SBX))
    assert node.vmm.ops(SBX) == ["restore", "kill"] and channel.closed and not node.vm_dir(SBX).exists()


async def test_the_guest_channel_is_refused_for_a_stale_generation_or_a_paused_vm(node: Node) -> None:
    import pytest

    from podbay.errors import NotFound, StaleGeneration, Unavailable

    with pytest.raises(NotFound):
        node.manager.channel(SBX, None)
    await _running(node)
    assert node.manager.channel(SBX, 1) is node.guest.channels[0]
    with pytest.raises(StaleGeneration):
        node.manager.channel(SBX, 2)
    node.manager.vms[SBX].stopping = True
    with pytest.raises(Unavailable):
        node.manager.channel(SBX, 1)
    assert NODE == node.manager.node_id
