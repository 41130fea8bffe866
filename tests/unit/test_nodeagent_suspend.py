"""The node agent's suspend and wake (services/nodeagent/ops/suspend.py) against a fake VMM, guest and database
(tests/unit/fakes_nodeagent.py); the object store's fetch is replaced by one that writes the snapshot's files
(or finds them corrupt). On real VMs and a real object store: tests/e2e/test_suspend.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from podbay.contracts import subjects
from podbay.contracts.messages import CreateSandboxCmd, PromoteCmd, Resources, SandboxOpCmd, WakeCmd
from podbay.errors import SnapshotCorrupt
from podbay.lifecycle import Verb
from podbay_nodeagent.ops import suspend as suspend_module
from podbay_nodeagent.ops.suspend import SuspendOps

from fakes_nodeagent import DIGEST, NODE, TEMPLATE, Node, node  # noqa: F401  # node: a fixture

SBX = "sbx_000000000003"


async def _suspending(node: Node, promotion: str) -> SuspendOps:
    """A running sandbox the API has just marked ``suspending``; the snapshotter answers with ``promotion``."""
    node.db.add_sandbox(SBX, "starting")
    await node.manager.create(CreateSandboxCmd(
        operation_id="op_create", sandbox_id=SBX, tenant_id="tnt_1", template=TEMPLATE, template_digest=DIGEST,
        generation=1, resources=Resources(memory_mib=256, vcpus=1), hostname="sbx-000000000003"))
    node.db.add_snapshot("snap_s", SBX)
    node.db.sandboxes[SBX].update(state="suspending", suspended_snapshot_id="snap_s")

    def snapshotter(subject: str, cmd: Any) -> None:
        if isinstance(cmd, PromoteCmd):
            node.db.snapshots[cmd.snapshot_id].update(promotion=promotion, promotion_error="bucket unreachable")

    node.bus.on_command = snapshotter
    return SuspendOps(node.manager, object())


async def test_suspend_stops_snapshots_promotes_then_frees_the_vm(node: Node) -> None:
    ops = await _suspending(node, "promoted")
    process = node.manager.vms[SBX].handle.process
    await ops.suspend(SandboxOpCmd(operation_id="op_s", sandbox_id=SBX, generation=1))

    assert node.vmm.ops(SBX) == ["restore", "pause", "snapshot_full", "kill"]
    assert [(s, c.snapshot_id) for s, c in node.bus.commands] == [(subjects.snapshotter_promote(NODE), "snap_s")]
    assert not node.vmm.is_alive(process) and SBX not in node.manager.vms
    assert not node.vm_dir(SBX).exists() and node.net.released == [SBX]
    assert ("release_after_suspend", SBX) in node.volumes.calls
    assert node.db.verbs(SBX) == [Verb.STARTED, Verb.SUSPENDED]
    row = node.db.sandboxes[SBX]
    assert row["state"] == "suspended" and row["node_id"] is None
    assert node.db.snapshots["snap_s"]["state"] == "ready"  # promoted: it stays, restorable from S3
    assert node.db.operations["op_s"]["state"] == "succeeded" and node.db.events[-1] == (SBX, "suspended")


async def test_a_failed_promotion_puts_the_sandbox_back_to_paused_with_its_vm(node: Node) -> None:
    ops = await _suspending(node, "failed")
    await ops.suspend(SandboxOpCmd(operation_id="op_s", sandbox_id=SBX, generation=1))

    vm = node.manager.vms[SBX]
    assert node.vmm.is_alive(vm.handle.process) and vm.paused_at is not None
    assert node.vmm.ops(SBX) == ["restore", "pause", "snapshot_full"]
    assert node.db.verbs(SBX) == [Verb.STARTED, Verb.SUSPEND_FAILED]
    assert node.db.state(SBX) == "paused" and node.db.sandboxes[SBX]["suspended_snapshot_id"] is None
    assert node.db.operations["op_s"] == {"id": "op_s", "state": "failed",
                                          "error_message": "promotion failed: bucket unreachable"}


async def test_a_failed_suspend_snapshot_is_not_promoted(node: Node) -> None:
    ops = await _suspending(node, "promoted")
    node.vmm.fail_next("snapshot_full")
    await ops.suspend(SandboxOpCmd(operation_id="op_s", sandbox_id=SBX, generation=1))
    assert node.bus.commands == [] and node.db.state(SBX) == "paused" and SBX in node.manager.vms
    assert node.db.operations["op_s"]["error_message"] == "the full snapshot failed: fake snapshot_full failed"


def _fetch(corrupt: set[str]) -> Any:
    async def fetch(pool: Any, store: Any, settings: Any, snap_id: str, dest: Path, **kw: Any) -> None:
        if snap_id in corrupt:
            raise SnapshotCorrupt(f"chunk 3 of {snap_id} does not match its SHA-256")
        dest.mkdir(parents=True)
        for name in ("state", "ram", "disk.img"):
            (dest / name).write_bytes(b"fetched")
    return fetch


def _resuming(node: Node, monkeypatch: pytest.MonkeyPatch, corrupt: set[str]) -> SuspendOps:
    """A suspended sandbox the scheduler placed here at generation 2 to wake it."""
    node.db.add_sandbox(SBX, "resuming", generation=2, suspended_snapshot_id="snap_s")
    node.db.add_snapshot("snap_s", SBX, state="ready", promotion="promoted", node_id=None)
    monkeypatch.setattr(suspend_module, "fetch", _fetch(corrupt))
    return SuspendOps(node.manager, object())


async def test_wake_fetches_restores_and_records_resumed(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _resuming(node, monkeypatch, corrupt=set())
    await ops.wake(WakeCmd(operation_id="op_w", sandbox_id=SBX, generation=2, snapshot_id="snap_s"))

    assert node.vmm.ops(SBX) == ["restore"] and node.guest.ops(SBX) == ["connect", "after_restore"]
    assert node.manager.vms[SBX].generation == 2
    assert node.db.verbs(SBX) == [Verb.STARTED] and node.db.state(SBX) == "running"
    assert node.db.events == [(SBX, "resumed")] and node.db.sandboxes[SBX]["suspended_snapshot_id"] is None
    assert node.db.snapshots["snap_s"]["node_id"] == NODE and ("prepare", SBX) in node.volumes.calls
    assert node.db.operations["op_w"]["state"] == "succeeded"


async def test_a_corrupt_snapshot_puts_the_sandbox_back_to_suspended(node: Node,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _resuming(node, monkeypatch, corrupt={"snap_s"})
    await ops.wake(WakeCmd(operation_id="op_w", sandbox_id=SBX, generation=2, snapshot_id="snap_s"))

    assert node.vmm.calls == [] and SBX not in node.manager.vms
    assert node.db.verbs(SBX) == [Verb.WAKE_FAILED]
    row = node.db.sandboxes[SBX]
    assert row["state"] == "suspended" and row["node_id"] is None and row["suspended_snapshot_id"] == "snap_s"
    assert node.db.operations["op_w"]["state"] == "failed"
    assert "does not match its SHA-256" in node.db.operations["op_w"]["error_message"]
    assert not (node.manager.store.root / "snapshots" / SBX).exists()
