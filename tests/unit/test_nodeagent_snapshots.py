"""The node agent's snapshots and rollbacks (services/nodeagent/storage/snapshots.py) against a fake VMM, guest and
database (tests/unit/fakes_nodeagent.py). On real VMs: tests/e2e/test_snapshots.py and the fork tests."""

from __future__ import annotations

from podbay.contracts.messages import CreateSandboxCmd, Resources, RestoreCmd, SnapshotCmd
from podbay.lifecycle import Verb
from podbay_nodeagent.storage.snapshots import _beyond_retention
from podbay_nodeagent.vm.vmm import VmTimeout

from fakes_nodeagent import DIGEST, TEMPLATE, Node, node  # noqa: F401  # node: a fixture

SBX = "sbx_000000000002"


async def _running(node: Node) -> None:
    node.db.add_sandbox(SBX, "starting")
    await node.manager.create(CreateSandboxCmd(
        operation_id="op_create", sandbox_id=SBX, tenant_id="tnt_1", template=TEMPLATE, template_digest=DIGEST,
        generation=1, resources=Resources(memory_mib=256, vcpus=1), hostname="sbx-000000000002"))
    assert node.db.state(SBX) == "running"


async def _snapshot(node: Node, snap_id: str, kind: str = "full") -> None:
    node.db.add_snapshot(snap_id, SBX, kind=kind)
    await node.manager.snapshots.snapshot(SnapshotCmd(operation_id=f"op_{snap_id}", sandbox_id=SBX, generation=1,
                                                      snapshot_id=snap_id, kind=kind))


async def test_a_full_snapshot_writes_its_files_marks_it_ready_and_the_guest_runs_on(node: Node) -> None:
    await _running(node)
    await _snapshot(node, "snap_1")

    final = node.manager.store.snapshot_dir(SBX, "snap_1")
    assert sorted(p.name for p in final.iterdir()) == ["disk.img", "ram", "state"]
    assert not final.with_name("snap_1.part").exists()
    assert node.db.snapshots["snap_1"]["state"] == "ready" and node.db.snapshots["snap_1"]["paused_ms"] == 1.0
    assert node.vmm.ops(SBX) == ["restore", "snapshot_full"]
    assert node.vmm.status_of(node.manager.vms[SBX].handle.process) == "running"
    assert node.db.events[-1] == (SBX, "snapshotted") and node.db.operations["op_snap_1"]["state"] == "succeeded"
    assert node.db.state(SBX) == "running"  # a snapshot is no state change


async def test_a_disk_snapshot_freezes_the_guest_filesystems_around_the_copy(node: Node) -> None:
    await _running(node)
    await _snapshot(node, "snap_d", kind="disk")
    assert node.guest.ops(SBX)[-2:] == ["freeze", "thaw"]
    assert "snapshot_full" not in node.vmm.ops(SBX)
    assert (node.manager.store.snapshot_dir(SBX, "snap_d") / "disk.img").exists()
    assert node.db.snapshots["snap_d"]["state"] == "ready"


async def test_a_failed_snapshot_is_marked_failed_and_leaves_no_files(node: Node) -> None:
    await _running(node)
    node.vmm.fail_next("snapshot_full", VmTimeout("snapshot did not finish within 60 s"))
    await _snapshot(node, "snap_1")

    assert node.db.snapshots["snap_1"]["state"] == "failed"
    assert node.db.snapshots["snap_1"]["error"] == "snapshot did not finish within 60 s"
    assert node.db.operations["op_snap_1"] == {"id": "op_snap_1", "state": "failed",
                                               "error_message": "snapshot did not finish within 60 s"}
    assert not (node.manager.store.root / "snapshots" / SBX / "snap_1.part").exists()
    assert node.db.state(SBX) == "running" and SBX in node.manager.vms


async def test_a_snapshot_of_a_sandbox_not_running_here_fails_without_touching_a_vm(node: Node) -> None:
    node.db.add_sandbox(SBX, "paused", node_id="node-2")
    await _snapshot(node, "snap_1")
    assert node.db.snapshots["snap_1"]["state"] == "failed" and node.vmm.calls == []


async def test_rollback_replaces_the_vm_with_a_restore_of_the_snapshot_at_the_new_generation(node: Node) -> None:
    await _running(node)
    await _snapshot(node, "snap_1")
    old = node.manager.vms[SBX].handle.process
    node.db.sandboxes[SBX].update(state="starting", generation=2)  # the API's RESTORE transition
    await node.manager.snapshots.restore(RestoreCmd(operation_id="op_rb", sandbox_id=SBX, generation=2,
                                                    snapshot_id="snap_1"))

    assert node.vmm.ops(SBX) == ["restore", "snapshot_full", "kill", "restore"]
    assert not node.vmm.is_alive(old)
    vm = node.manager.vms[SBX]
    assert vm.generation == 2 and vm.handle.process is not old and node.vmm.is_alive(vm.handle.process)
    assert node.db.state(SBX) == "running" and node.db.verbs(SBX) == [Verb.STARTED, Verb.STARTED]
    assert node.db.events[-1] == (SBX, "restored") and node.db.operations["op_rb"]["state"] == "succeeded"
    assert node.net.open_fds() == []


async def test_rollback_to_a_snapshot_that_is_not_here_fails_the_sandbox(node: Node) -> None:
    await _running(node)
    node.db.add_snapshot("snap_x", SBX, state="ready")  # its files are on another node
    node.db.sandboxes[SBX].update(state="starting", generation=2)
    await node.manager.snapshots.restore(RestoreCmd(operation_id="op_rb", sandbox_id=SBX, generation=2,
                                                    snapshot_id="snap_x"))
    assert node.db.state(SBX) == "failed" and node.vmm.alive() == [] and SBX not in node.manager.vms
    assert node.db.sandboxes[SBX]["failure_reason"] == "snapshot snap_x is not on this node"
    assert node.db.operations["op_rb"]["state"] == "failed"


async def test_retention_keeps_the_newest_full_snapshots(node: Node) -> None:
    node.settings.retain_full_snapshots = 2
    await _running(node)
    for snap_id in ("snap_1", "snap_2", "snap_3"):
        await _snapshot(node, snap_id)
    assert [s["state"] for s in node.db.snapshots.values()] == ["deleted", "ready", "ready"]
    assert not node.manager.store.snapshot_dir(SBX, "snap_1").exists()
    assert node.manager.store.snapshot_dir(SBX, "snap_3").exists()


async def test_retention_keeps_the_newest_promoted_snapshot_beside_newer_local_ones(node: Node) -> None:
    # The durable copy: a node loss restores only from a promoted full snapshot, so M newer node-local ones
    # do not make the promoted one reclaimable (they die with the node; a suspend drops them).
    node.settings.retain_full_snapshots = 2
    await _running(node)
    await _snapshot(node, "snap_1")
    node.db.snapshots["snap_1"]["promotion"] = "promoted"
    for snap_id in ("snap_2", "snap_3", "snap_4"):
        await _snapshot(node, snap_id)
    states = {i: s["state"] for i, s in node.db.snapshots.items()}
    assert states == {"snap_1": "ready", "snap_2": "deleted", "snap_3": "ready", "snap_4": "ready"}
    assert node.manager.store.snapshot_dir(SBX, "snap_1").exists()
    assert not node.manager.store.snapshot_dir(SBX, "snap_2").exists()

    # once a newer one is promoted and kept, the older promoted one is an ordinary old snapshot
    node.db.snapshots["snap_4"]["promotion"] = "promoted"
    await _snapshot(node, "snap_5")
    assert node.db.snapshots["snap_1"]["state"] == "deleted" and node.db.snapshots["snap_3"]["state"] == "deleted"
    assert [i for i, s in node.db.snapshots.items() if s["state"] == "ready"] == ["snap_4", "snap_5"]


def test_retention_spares_the_newest_promoted_one_of_each_kind_only() -> None:
    rows = [{"id": "d3", "kind": "disk", "promotion": "local"}, {"id": "f3", "kind": "full", "promotion": "local"},
            {"id": "d2", "kind": "disk", "promotion": "promoted"}, {"id": "f2", "kind": "full", "promotion": "local"},
            {"id": "d1", "kind": "disk", "promotion": "promoted"}, {"id": "f1", "kind": "full", "promotion": "failed"}]
    assert _beyond_retention(rows, {"disk": 1, "full": 1}) == ["f2", "d1", "f1"]
    assert _beyond_retention(rows, {"disk": 2, "full": 3}) == ["d1"]
