"""A duty-cycle budget for background work (snapshot cadence on the node agent, promotion cadence on the
snapshotter): it uses at most a share of one core on average and yields to foreground work.

Work of ``w`` seconds (wall time, so CPU and IO alike) is followed by ``w / share - w`` seconds without
background work; before each item :meth:`Budget.turn` also waits while ``busy()`` says foreground work is
waiting, for ``max_defer_s`` at most, so background work is late but never starved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["Budget"]

POLL_S = 0.2


def _never() -> bool:
    return False


class Budget:
    """Pacing to ``share`` of one core (0, or 1 and above: no pacing); ``clock``: monotonic seconds."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.clock = clock
        self.free_at = 0.0

    def charge(self, seconds: float) -> None:
        """Account ``seconds`` of work just done: the next may start ``seconds / share - seconds`` later."""
        if 0 < self.share < 1 and seconds > 0:
            self.free_at = max(self.free_at, self.clock()) + seconds * (1 / self.share - 1)

    def wait_s(self) -> float:
        """Seconds until the next work may start (0: now)."""
        return max(0.0, self.free_at - self.clock())

    async def turn(self, stop: asyncio.Event, busy: Callable[[], bool] = _never, max_defer_s: float = 30.0) -> bool:
        """Wait until the budget allows work and ``busy()`` is false (that for ``max_defer_s`` seconds at most).
        Returns False when ``stop`` was set meanwhile."""
        deferred = 0.0
        while not stop.is_set():
            wait = self.wait_s()
            if wait <= 0 and (deferred >= max_defer_s or not busy()):
                return True
            if wait <= 0:
                deferred += POLL_S
            try:
                await asyncio.wait_for(stop.wait(), timeout=min(wait, 5.0) if wait > 0 else POLL_S)
            except TimeoutError:
                pass
        return False
