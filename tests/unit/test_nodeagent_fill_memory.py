"""services/nodeagent/computer/fill_memory.py: a sandbox's filled set is loaded from the durable record once per stay on
the node (concurrent callers share the load), merged with fills made meanwhile, not kept when the sandbox left
during the load, and not armed when the record cannot be read (the next call tries again)."""

from __future__ import annotations

import asyncio

import pytest
from podbay_nodeagent.computer.fill_memory import Filled, FillMemory

from podbay.errors import Unavailable

SBX = "sbx_000000000031"


class Record:
    """A fake of PgFillRecord: answers when ``gate`` is set, or raises ``error``."""

    def __init__(self, filled: Filled) -> None:
        self.filled = filled
        self.loads = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.error: Exception | None = None

    async def load(self, sandbox_id: str) -> Filled:
        self.loads += 1
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return Filled(set(self.filled.values), set(self.filled.selectors))


async def test_concurrent_arms_share_one_load_and_merge_with_a_fill_made_meanwhile() -> None:
    rec = Record(Filled({"old-secret"}, {"#pw"}))
    rec.gate.clear()
    mem = FillMemory(rec.load)
    waiting = [asyncio.create_task(mem.arm(SBX)) for _ in range(3)]
    await asyncio.sleep(0)
    mem.add(SBX, "new-secret", "#otp")  # a fill while the record loads
    rec.gate.set()
    await asyncio.gather(*waiting)
    assert rec.loads == 1 and mem.armed(SBX)
    assert mem.values(SBX) == {"old-secret", "new-secret"} and mem.selectors(SBX) == {"#pw", "#otp"}
    await mem.arm(SBX)
    assert rec.loads == 1


async def test_a_sandbox_that_left_during_the_load_keeps_nothing() -> None:
    rec = Record(Filled({"secret"}, {"#pw"}))
    rec.gate.clear()
    mem = FillMemory(rec.load)
    arming = asyncio.create_task(mem.arm(SBX))
    await asyncio.sleep(0)
    mem.forget(SBX)
    rec.gate.set()
    await arming
    assert mem.values(SBX) == set() and mem.selectors(SBX) is None and not mem.armed(SBX)


async def test_an_unreadable_record_arms_nothing_and_the_next_call_loads_again() -> None:
    rec = Record(Filled({"secret"}, {"#pw"}))
    rec.error = Unavailable("the store does not answer")
    mem = FillMemory(rec.load)
    with pytest.raises(Unavailable):
        await mem.arm(SBX)
    assert not mem.armed(SBX) and mem.values(SBX) == set()
    rec.error = None
    await mem.arm(SBX)
    assert rec.loads == 2 and mem.values(SBX) == {"secret"} and mem.selectors(SBX) == {"#pw"}


async def test_a_forgotten_sandbox_is_loaded_again_on_its_next_stay() -> None:
    rec = Record(Filled({"secret"}, {"#pw"}))
    mem = FillMemory(rec.load)
    await mem.arm(SBX)
    mem.forget(SBX)
    assert mem.values(SBX) == set() and not mem.armed(SBX)
    await mem.arm(SBX)
    assert rec.loads == 2 and mem.values(SBX) == {"secret"}


async def test_nothing_recorded_is_not_masked() -> None:
    mem = FillMemory(Record(Filled()).load)
    await mem.arm(SBX)
    assert mem.armed(SBX) and mem.selectors(SBX) is None and mem.values(SBX) == set()
