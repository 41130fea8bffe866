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
    from podbay_nodeagent.fence import stale

    assert not stale("node-a", 3, "node-a", 3)
    assert stale("node-a", 3, "node-b", 5)  # rescheduled elsewhere
    assert stale("node-a", 3, None, 4)  # fenced, not yet placed
    assert stale("node-a", 3, "node-a", 4)  # placed here again at a newer generation: our copy is old
    assert stale("node-a", 3, None, None)  # the row is gone
