"""The node-loss decision (services/scheduler/nodeloss.py :func:`lost_nodes`): pure logic, no servers."""

from __future__ import annotations

from podbay_scheduler.nodeloss import lost_nodes


def test_a_silent_ready_node_is_lost_only_after_the_grace() -> None:
    absent: dict[str, float] = {}
    states = {"a": "ready", "b": "ready"}
    assert lost_nodes(100.0, {"a"}, states, absent, grace_s=5.0) == []
    assert absent == {"b": 100.0}
    assert lost_nodes(104.9, {"a"}, states, absent, grace_s=5.0) == []
    assert lost_nodes(105.0, {"a"}, states, absent, grace_s=5.0) == ["b"]


def test_a_node_that_comes_back_within_the_grace_starts_over() -> None:
    absent: dict[str, float] = {}
    states = {"b": "ready"}
    lost_nodes(0.0, set(), states, absent, grace_s=5.0)
    assert lost_nodes(3.0, {"b"}, states, absent, grace_s=5.0) == [] and absent == {}
    assert lost_nodes(6.0, set(), states, absent, grace_s=5.0) == []  # absent again from 6.0
    assert lost_nodes(11.0, set(), states, absent, grace_s=5.0) == ["b"]


def test_draining_nodes_are_watched_but_drained_and_lost_ones_are_not() -> None:
    absent: dict[str, float] = {}
    states = {"d": "draining", "x": "drained", "l": "lost"}
    lost_nodes(0.0, set(), states, absent, grace_s=1.0)
    assert lost_nodes(1.0, set(), states, absent, grace_s=1.0) == ["d"]
    assert set(absent) == {"d"}


def test_state_changes_and_removed_rows_forget_the_absence() -> None:
    absent: dict[str, float] = {"gone": 0.0}
    states = {"a": "ready"}
    lost_nodes(0.0, set(), states, absent, grace_s=10.0)
    assert absent == {"a": 0.0}
    lost_nodes(5.0, set(), {"a": "drained"}, absent, grace_s=10.0)
    assert absent == {}
    # Ready again (a fresh absence clock), so not lost at 12 s.
    assert lost_nodes(6.0, set(), states, absent, grace_s=10.0) == []
    assert lost_nodes(12.0, set(), states, absent, grace_s=10.0) == []
    assert lost_nodes(16.0, set(), states, absent, grace_s=10.0) == ["a"]


def test_zero_grace_declares_at_the_first_absence() -> None:
    assert lost_nodes(0.0, set(), {"a": "ready"}, {}, grace_s=0.0) == ["a"]


def test_a_node_agent_copy_is_stale_when_the_row_moved_on() -> None:
    from podbay_nodeagent.ops.fence import stale

    assert not stale("node-a", 3, "node-a", 3)
    assert stale("node-a", 3, "node-b", 5)  # rescheduled elsewhere
    assert stale("node-a", 3, None, 4)  # fenced, not yet placed
    assert stale("node-a", 3, "node-a", 4)  # placed here again at a newer generation: our copy is old
    assert stale("node-a", 3, None, None)  # the row is gone


async def test_placements_not_published_are_sent_on_the_next_pass() -> None:
    import pytest

    from podbay.contracts.messages import PlaceSandbox, Resources
    from podbay_scheduler.nodeloss import NodeLossWatcher

    class Bus:
        def __init__(self) -> None:
            self.sent: list[str] = []
            self.fail = True

        async def live_nodes(self) -> list[object]:
            return []

        async def publish_command(self, subject: str, msg: PlaceSandbox, *, msg_id: str) -> None:
            if self.fail:
                raise ConnectionError("nats is away")
            self.sent.append(msg_id)

    class Pool:
        async def fetch(self, sql: str, *args: object) -> list[object]:
            return []

    bus = Bus()
    w = NodeLossWatcher(Pool(), bus, None, grace_s=1.0, interval_s=1.0)  # type: ignore[arg-type]
    w.unsent = [PlaceSandbox(operation_id=f"op_{i}", sandbox_id=f"sbx_{i}", tenant_id="t", template="base",
                             resources=Resources(memory_mib=256, vcpus=1), wake=True) for i in range(2)]
    with pytest.raises(ConnectionError):
        await w.check()
    bus.fail = False
    await w.check()
    assert bus.sent == ["op_0", "op_1"] and w.unsent == []
