"""E2B's filesystem-only auto-pause on the node (services/nodeagent/storage/snapshots.py ``filesystem_pause_point``,
sandboxes.py ``lease_expired``) against the node fakes: the guest's filesystems stay frozen from the disk
snapshot until the pause (E2B #1104: no write acknowledged in between, then missing from the snapshot the
sandbox comes back from), and are thawed when the pause does not happen. On real VMs: tests/e2e/test_e2b.py."""

from __future__ import annotations

from podbay.contracts.messages import CreateSandboxCmd, Resources, SandboxOpCmd
from podbay_nodeagent.vm.vmm import VmTimeout

from fakes_nodeagent import DIGEST, TEMPLATE, Node, node  # noqa: F401  # node: a fixture

SBX = "sbx_000000000031"


async def _running(node: Node, *, fs_pause: bool = True) -> None:
    node.db.add_sandbox(SBX, "starting")
    await node.manager.create(CreateSandboxCmd(
        operation_id="op_create", sandbox_id=SBX, tenant_id="tnt_1", template=TEMPLATE, template_digest=DIGEST,
        generation=1, resources=Resources(memory_mib=256, vcpus=1), hostname="sbx-000000000031"))
    node.db.e2b[SBX] = {"auto_pause_filesystem": fs_pause}


def _since_freeze(node: Node) -> list[str]:
    ops = node.guest.ops(SBX)
    return ops[len(ops) - 1 - ops[::-1].index("freeze"):]


async def test_the_freeze_is_held_from_the_snapshot_to_the_pause(node: Node) -> None:
    await _running(node)
    after = await node.manager.snapshots.filesystem_pause_point(SBX)
    assert after is not None
    snap = node.db.e2b[SBX]["cold_resume_snapshot"]
    assert node.db.snapshots[snap]["state"] == "ready" and node.db.snapshots[snap]["kind"] == "disk"
    assert _since_freeze(node) == ["freeze"]  # the snapshot neither froze again nor thawed
    await node.manager.pause(SandboxOpCmd(operation_id="op_pause", sandbox_id=SBX, generation=1))
    await after()
    assert node.db.state(SBX) == "paused" and node.vmm.ops(SBX)[-1] == "pause"
    assert _since_freeze(node) == ["freeze"]  # paused frozen: the next connect boots from the snapshot


async def test_a_pause_that_fails_thaws_the_guest(node: Node) -> None:
    await _running(node)
    after = await node.manager.snapshots.filesystem_pause_point(SBX)
    assert after is not None
    node.vmm.fail_next("pause", VmTimeout("stop did not answer"))
    await node.manager.pause(SandboxOpCmd(operation_id="op_pause", sandbox_id=SBX, generation=1))
    await after()
    assert node.db.state(SBX) == "running"
    assert _since_freeze(node) == ["freeze", "thaw"]


async def test_other_sandboxes_are_not_frozen(node: Node) -> None:
    await _running(node, fs_pause=False)
    assert await node.manager.snapshots.filesystem_pause_point(SBX) is None
    assert "freeze" not in node.guest.ops(SBX) and "cold_resume_snapshot" not in node.db.e2b[SBX]
