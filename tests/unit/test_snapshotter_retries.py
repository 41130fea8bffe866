"""The snapshotter's retry budget per promote command (services/snapshotter/main.py ``Snapshotter.handle``): an
object store error is waited out over ``STORAGE_MAX_DELIVERIES`` deliveries, except for a suspend's promotion,
whose caller waits and which fails after ``MAX_DELIVERIES`` like any other error. Fakes stand in for the JetStream
message and the promotion; the retries against a real S3 restart are in tests/faults/test_s3_restart_promotion.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from podbay_snapshotter.main import MAX_DELIVERIES, STORAGE_MAX_DELIVERIES, Snapshotter

from podbay.contracts.messages import PromoteCmd
from podbay.errors import StorageError


@dataclass
class _Meta:
    num_delivered: int


@dataclass
class _Msg:
    data: bytes
    metadata: _Meta
    outcome: list[str] = field(default_factory=list)

    async def nak(self, delay: float = 0) -> None:
        self.outcome.append("nak")

    async def ack(self) -> None:
        self.outcome.append("ack")

    async def term(self) -> None:
        self.outcome.append("term")

    async def in_progress(self) -> None:
        pass


class _Failing(Snapshotter):
    """A snapshotter whose every promotion meets an object store outage; ``failed`` records what it gave up."""

    def __init__(self) -> None:  # no servers: only handle() runs
        self.failed: list[str] = []

    async def promote_one(self, snapshot_id: str) -> Any:
        raise StorageError("the object store did not answer")

    async def fail(self, snapshot_id: str, reason: str) -> None:
        self.failed.append(snapshot_id)


def _handle(reason: str, delivery: int) -> tuple[list[str], list[str]]:
    snap = _Failing()
    cmd = PromoteCmd(snapshot_id="snap_1", sandbox_id="sbx_1", reason=reason)  # type: ignore[arg-type]
    msg = _Msg(cmd.model_dump_json().encode(), _Meta(delivery))
    asyncio.run(snap.handle(msg))
    return msg.outcome, snap.failed


@pytest.mark.parametrize("reason", ["cadence", "request"])
def test_an_object_store_outage_is_waited_out_over_more_deliveries(reason: str) -> None:
    assert STORAGE_MAX_DELIVERIES > MAX_DELIVERIES
    assert _handle(reason, MAX_DELIVERIES) == (["nak"], [])
    assert _handle(reason, STORAGE_MAX_DELIVERIES - 1) == (["nak"], [])
    assert _handle(reason, STORAGE_MAX_DELIVERIES) == (["ack"], ["snap_1"])


def test_a_suspends_promotion_fails_as_fast_as_any_other_error() -> None:
    assert _handle("suspend", MAX_DELIVERIES - 1) == (["nak"], [])
    assert _handle("suspend", MAX_DELIVERIES) == (["ack"], ["snap_1"])
