"""The destination side of a live migration (services/nodeagent/vm/migrate.py): prepare and a source that gives
up, against a fake VMM, guest and database (tests/unit/fakes_nodeagent.py). The stream itself is QEMU's: the
whole migration runs on real VMs in tests/e2e/test_vm_live_migration.py and test_drain.py."""

from __future__ import annotations

from podbay.contracts.messages import MigrateFinish, MigratePrepare, Resources
from podbay_nodeagent.vm.migrate import MigrationOps

from fakes_nodeagent import DIGEST, TEMPLATE, Node, node  # noqa: F401  # node: a fixture

SBX = "sbx_000000000004"


def _prepare(generation: int = 3) -> MigratePrepare:
    return MigratePrepare(operation_id="op_m", sandbox_id=SBX, tenant_id="tnt_1", source_node="node-2",
                          generation=generation, template=TEMPLATE, template_digest=DIGEST,
                          resources=Resources(memory_mib=256, vcpus=1), hostname="sbx-000000000004",
                          disk_size=1 << 20)


async def test_prepare_starts_a_waiting_vm_and_a_give_up_tears_it_down(node: Node) -> None:
    node.db.add_sandbox(SBX, "running", generation=3, node_id="node-2")
    ops = MigrationOps(node.manager)
    reply = await ops.prepare(_prepare())

    assert reply.ok and reply.port and reply.token and len(reply.token) == 64, reply.error
    assert node.vmm.ops(SBX) == ["start_incoming", "execute:migrate-set-capabilities"]
    assert (node.vm_dir(SBX) / "disk.img").stat().st_size == 1 << 20  # sparse, the source's size
    assert node.net.bindings[SBX].generation == 4 and node.net.open_fds() == []

    finish = await ops.finish(MigrateFinish(operation_id="op_m", sandbox_id=SBX, generation=3, ok=False))
    assert not finish.committed and finish.error == "the source gave up"
    assert node.vmm.alive() == [] and not node.vm_dir(SBX).exists() and node.net.released == [SBX]
    assert node.db.transitions == [] and SBX not in node.manager.vms


async def test_a_prepare_whose_vm_does_not_start_leaves_nothing_behind(node: Node) -> None:
    node.db.add_sandbox(SBX, "running", generation=3, node_id="node-2")
    node.vmm.fail_next("start_incoming")
    reply = await MigrationOps(node.manager).prepare(_prepare())
    assert not reply.ok and reply.error == "fake start_incoming failed"
    assert node.vmm.alive() == [] and not node.vm_dir(SBX).exists()
    assert node.net.released == [SBX] and node.net.open_fds() == []


async def test_a_prepare_for_a_sandbox_that_moved_on_is_refused(node: Node) -> None:
    node.db.add_sandbox(SBX, "running", generation=4, node_id="node-2")
    reply = await MigrationOps(node.manager).prepare(_prepare(generation=3))
    assert not reply.ok and node.vmm.calls == [] and node.net.bindings == {}
    finish = await MigrationOps(node.manager).finish(MigrateFinish(operation_id="op_m", sandbox_id=SBX,
                                                                   generation=3, ok=True))
    assert not finish.committed and finish.error == "no migration of this sandbox is waiting here"
