"""What credential fill remembers per sandbox (services/nodeagent/computer/computer_fill.py, .fill_memory: the filled
values the CDP redaction replaces, the fields screenshots mask), when the node forgets it (when the sandbox leaves
the node: services/nodeagent/ops/registry.py ``release_net``; not while it stays, paused or with its RAM released),
and that the node serving the sandbox next re-arms it from the durable record (a fake of it here: the SQL over
the audit rows is tests/integration/test_fill_record.py). Against the node-agent fakes
(tests/unit/fakes_nodeagent.py); the fill itself on a real browser: tests/e2e."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI
from podbay_nodeagent.computer.computer import Computer
from podbay_nodeagent.computer.computer_fill import REDACTED, Filler, add_fill_route
from podbay_nodeagent.build.defaults import ExecDefaults
from podbay_nodeagent.computer.fill_memory import Filled, FillMemory
from podbay_nodeagent.ops.suspend import SuspendOps

from podbay.contracts.messages import CreateSandboxCmd, DeleteSandboxCmd, PromoteCmd, Resources, SandboxOpCmd

from fakes_nodeagent import DIGEST, TEMPLATE, Node, node  # noqa: F401  # node: a fixture

SBX = "sbx_000000000021"
OTHER = "sbx_000000000022"
SECRET = "hunter2-Pa$$"
CDP = '{"id":7,"result":{"value":"' + SECRET + '"}}'


class Record:
    """The durable record of fills (PgFillRecord over the audit rows, in the node agent), with its loads."""

    def __init__(self) -> None:
        self.fills: dict[str, Filled] = {}
        self.loads: list[str] = []

    async def load(self, sandbox_id: str) -> Filled:
        self.loads.append(sandbox_id)
        got = self.fills.get(sandbox_id, Filled())
        return Filled(set(got.values), set(got.selectors))


def _mount(node: Node, record: Record) -> Filler:
    """The data plane's filler as main mounts it, its memory loading from ``record`` (a restart mounts anew)."""
    computer = Computer(node.manager, ExecDefaults(node.manager))
    computer.fills = FillMemory(record.load)
    return add_fill_route(FastAPI(), node.manager, computer)


@pytest.fixture
def record() -> Record:
    return Record()


@pytest.fixture
async def filler(node: Node, record: Record) -> AsyncIterator[Filler]:
    """The data plane's filler, mounted as main mounts it, with a sandbox running that had a fill."""
    f = _mount(node, record)
    for sid in (SBX, OTHER):
        node.db.add_sandbox(sid, "starting")
        await node.manager.create(CreateSandboxCmd(
            operation_id=f"op_{sid}", sandbox_id=sid, tenant_id="tnt_1", template=TEMPLATE, template_digest=DIGEST,
            generation=1, resources=Resources(memory_mib=256, vcpus=1), hostname=sid.replace("_", "-")))
        # What a fill leaves (Filler.fill, just before it types): its allow row, and the value and the field's
        # selector in the node's memory.
        record.fills[sid] = Filled({SECRET}, {"#password"})
        f.fills.add(sid, SECRET, "#password")
    yield f
    await f.computer.http.aclose()


def _remembers(f: Filler, sandbox_id: str) -> bool:
    """Whether the node holds the sandbox's filled set in memory now (without arming it from the record)."""
    held = SECRET in f.fills.values(sandbox_id)
    assert held == (f.fills.selectors(sandbox_id) is not None)  # the values and the masks go together
    return held


async def _redacts_and_masks(f: Filler, sandbox_id: str) -> bool:
    """What the CDP proxy and a screenshot would do with the sandbox now (they arm first)."""
    redacted = (await f.redactor(sandbox_id))(CDP) == CDP.replace(SECRET, REDACTED)
    assert redacted == (f.fills.selectors(sandbox_id) == {"#password"})
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


async def test_a_woken_sandbox_is_redacted_and_masked_again_from_the_record(node: Node, filler: Filler,
                                                                           record: Record) -> None:
    """After a suspend the node forgot the value; the page still holds it after the wake (restored with the
    snapshot), so the first CDP connection or screenshot re-arms both from the record."""
    await test_a_suspended_sandbox_is_forgotten(node, filler)
    assert await _redacts_and_masks(filler, SBX)
    assert record.loads == [SBX]
    assert await _redacts_and_masks(filler, SBX) and record.loads == [SBX]  # once per stay on the node


async def test_after_a_node_agent_restart_the_record_re_arms_both(node: Node, filler: Filler,
                                                                  record: Record) -> None:
    restarted = _mount(node, record)  # an empty memory, the same record
    assert not _remembers(restarted, SBX)
    assert await _redacts_and_masks(restarted, SBX) and await _redacts_and_masks(restarted, OTHER)
    await restarted.computer.http.aclose()


async def test_a_sandbox_never_filled_redacts_nothing_and_is_not_masked(node: Node, filler: Filler,
                                                                        record: Record) -> None:
    del record.fills[OTHER]
    filler.forget(OTHER)
    assert not await _redacts_and_masks(filler, OTHER) and filler.fills.selectors(OTHER) is None
