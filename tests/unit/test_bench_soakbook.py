"""The soak's books (tests/bench/_soakbook.py): which vanished snapshot counts as lost, the operation mix, and
the error kinds."""

from __future__ import annotations

import random

import pytest

from tests.bench._soakbook import DEFAULT_MIX, OPS, Snap, error_key, parse_mix, pick_op, snapshot_losses

KEEP = {"disk": 2, "full": 1}


def _snap(kind: str, minute: int, promotion: str | None = None) -> Snap:
    return Snap(kind, f"2026-12-01T20:{minute:02d}:00+00:00", promotion)


def test_a_snapshot_that_vanished_unexplained_is_lost() -> None:
    known = {"a": _snap("disk", 1), "b": _snap("disk", 2)}
    lost, retired, dropped = snapshot_losses(known, {"b": known["b"]}, KEEP, suspended=False)
    assert (lost, retired, dropped) == (["a"], 0, 0)


def test_retention_explains_a_snapshot_with_enough_newer_ones_of_its_kind() -> None:
    known = {"a": _snap("disk", 1)}
    # Two newer disk snapshots (K = 2): retention took "a". A newer full one does not count for a disk one.
    listed = {"b": _snap("disk", 2), "c": _snap("disk", 3), "f": _snap("full", 4)}
    assert snapshot_losses(known, listed, KEEP, suspended=False) == ([], 1, 0)
    assert snapshot_losses(known, {"b": _snap("disk", 2), "f": _snap("full", 4)}, KEEP, suspended=False)[0] == ["a"]


def test_a_suspend_explains_only_unpromoted_snapshots() -> None:
    known = {"local": _snap("disk", 1), "s3": _snap("full", 2, "promoted")}
    assert snapshot_losses(known, {}, KEEP, suspended=True) == (["s3"], 0, 1)
    assert snapshot_losses(known, {}, KEEP, suspended=False) == (["local", "s3"], 0, 0)


def test_retention_before_a_suspend_is_explained_by_the_newer_ones_the_suspend_dropped() -> None:
    # The soak saw this: retention reclaimed a promoted full snapshot ("old") once M newer ones existed, then
    # a suspend dropped those newer, unpromoted ones before the next listing, which shows only the suspend's.
    known = {"old": _snap("full", 1, "promoted"), "n1": _snap("full", 2), "n2": _snap("full", 3)}
    listed = {"susp": _snap("full", 9, "promoted")}
    lost, retired, dropped = snapshot_losses(known, listed, {"disk": 2, "full": 2}, suspended=True)
    assert lost == []
    assert retired + dropped == 3
    # Without the newer ones ever seen, the promoted one is still lost.
    assert snapshot_losses({"old": known["old"]}, listed, {"disk": 2, "full": 2}, suspended=True)[0] == ["old"]


def test_the_mix_draws_only_operations_the_state_allows() -> None:
    mix, rng = parse_mix(DEFAULT_MIX), random.Random(1)
    for state in ("running", "paused", "suspended"):
        drawn = {pick_op(state, mix, rng) for _ in range(500)}
        assert drawn == {op for op, states in OPS.items() if state in states}
    assert pick_op("deleting", mix, rng) is None
    assert pick_op("paused", parse_mix("exec=1"), rng) is None


@pytest.mark.parametrize("text", ["exec", "sleep=3", "exec=-1", "resume=5,resume_s3=5"])
def test_a_bad_mix_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_mix(text)


def test_error_kinds_name_the_operation_the_status_and_the_code() -> None:
    assert error_key("pause", 409, "invalid_state") == "pause_409_invalid_state"
    assert error_key("exec", "noanswer", "ReadTimeout") == "exec_noanswer_ReadTimeout"
    assert error_key("create", 500, None) == "create_500_none"
