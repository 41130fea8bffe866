"""What credential fill remembers per sandbox (services/nodeagent/computer_fill.py: the filled values the CDP
redaction replaces, the fields screenshots mask) and when the node forgets it: when the sandbox leaves the node
(services/nodeagent/sandboxes.py ``release_net``), not while it stays, paused or with its RAM released. Against
the node-agent fakes (tests/unit/fakes_nodeagent.py); the fill itself on a real browser: tests/e2e."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI
from podbay_nodeagent.computer import Computer
from podbay_nodeagent.computer_fill import REDACTED, Filler, add_fill_route
from podbay_nodeagent.build.defaults import ExecDefaults
from podbay_nodeagent.suspend import SuspendOps

from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, PromoteCmd, Resources, SandboxOpCmd

from fakes_nodeagent import DIGEST, TEMPLATE, Node, node  # noqa: F401  # node: a fixture

SBX = "sbx_000000000021"
OTHER = "sbx_000000000022"
SECRET = "hunter2-Pa$$"
CDP = '{"id":7,"result":{"value":"' + SECRET + '"}}'


@pytest.fixture
async def filler(node: Node) -> AsyncIterator[Filler]:
    """The data plane's filler, mounted as main mounts it, with a sandbox running that had a fill."""
    computer = Computer(node.manager, ExecDefaults(node.manager))
    f = add_fill_route(FastAPI(), node.manager, computer)
    for sid in (SBX, OTHER):
        node.db.add_sandbox(sid, "starting")
        await node.manager.create(CreateSandboxCmd(
            operation_id=f"op_{sid}", sandbox_id=sid, tenant_id="tnt_1", template=TEMPLATE, template_digest=DIGEST,
            generation=1, resources=Resources(memory_mib=256, vcpus=1), hostname=sid.replace("_", "-")))
        # What a fill leaves (Filler.fill, just before it types): the value and the field's selector.
        f._filled.setdefault(sid, set()).add(SECRET)
        computer.masked.setdefault(sid, set()).add("#password")
    yield f
    await computer.http.aclose()


def _remembers(f: Filler, sandbox_id: str) -> bool:
    redact = f.redactor(sandbox_id)
    assert redact is not None
    redacted = redact(CDP) == CDP.replace(SECRET, REDACTED)
    assert redacted == (sandbox_id in f.computer.masked)  # the values and the masks go together
    return redacted


async def test_a_deleted_sandbox_s_filled_values_and_masks_are_forgotten(node: Node, filler: Filler) -> None:
    assert _remembers(filler, SBX)
    node.db.sandboxes[SBX]["state"] = "deleting"
    await node.manager.delete(DeleteSandboxCmd(operation_id="op_del", sandbox_id=SBX, generation=1))
    assert node.db.state(SBX) == "deleted"
    assert not _remembers(filler, SBX)
    assert _remembers(filler, OTHER)  # only that sandbox's


async def test_a_sandbox_whose_vm_died_is_forgotten(node: Node, filler: Filler) -> None:
    vm = node.manager.vms[SBX]
    node.vmm.crash(vm.handle.process)
    assert vm.monitor is not None
    await vm.monitor
    assert node.db.state(SBX) == "failed" and not _remembers(filler, SBX)


async def test_a_suspended_sandbox_is_forgotten(node: Node, filler: Filler) -> None:
    """Its VM is freed and its row has no node: it may wake on any node, and its delete never reaches this
    one, so values kept here would stay until the agent restarts."""
    node.db.add_snapshot("snap_s", SBX)
    node.db.sandboxes[SBX].update(state="suspending", suspended_snapshot_id="snap_s")

    def snapshotter(subject: str, cmd: object) -> None:
        if isinstance(cmd, PromoteCmd):
            node.db.snapshots[cmd.snapshot_id].update(promotion="promoted")

    node.bus.on_command = snapshotter
    await SuspendOps(node.manager, object()).suspend(SandboxOpCmd(operation_id="op_s", sandbox_id=SBX,
                                                                  generation=1))
    assert node.db.state(SBX) == "suspended" and not _remembers(filler, SBX)


async def test_a_paused_sandbox_with_its_ram_released_is_remembered(node: Node, filler: Filler) -> None:
    """It stays on this node and resumes here, its page (and the filled field) as it was."""
    await node.manager.pause(SandboxOpCmd(operation_id="op_pause", sandbox_id=SBX, generation=1))
    assert await node.manager.hibernate(SBX)
    await node.manager.resume(SandboxOpCmd(operation_id="op_resume", sandbox_id=SBX, generation=1))
    assert node.db.state(SBX) == "running" and _remembers(filler, SBX)
