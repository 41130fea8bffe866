"""Rate limits shared by every process of a service, counted in PostgreSQL (docs/ARCHITECTURE.md, "Ports").

A :class:`SharedRateLimiter` admits at most ``budget`` calls per key in each window of ``window_s`` whole
seconds of PostgreSQL's clock (windows aligned to the epoch), however many processes (API replicas) share the
database. For a rate of ``r`` per second the window is 1 s and the budget ``floor(r)``; below 1 per second
the window is ``ceil(1 / r)`` seconds with a budget of ``max(1, floor(r * window_s))``.

The count is one row per key and window in the UNLOGGED table ``rate_windows`` (a counter that may be lost
with a crash of PostgreSQL, like the window itself). A process does not ask per call: it reserves ``batch``
admissions with one UPSERT (granted: what is left of the window's budget, up to ``batch``), spends them
locally, and asks again when they run out; once a reservation comes back short the window's budget is gone,
and the process refuses that key without asking until the window ends. So a call costs a dict lookup, and a
busy key costs each process about ``budget / batch`` statements per window however much is refused.

What batching costs: admissions a process reserved and did not spend lapse with the window, so a key's
traffic spread over ``N`` processes may be refused up to ``(N - 1) * (batch - 1)`` admissions before the
budget is spent; more than ``budget`` is never admitted in a window. Windows follow the clock, so a client
can get two budgets in a short span across a window's boundary.

Rows of windows that ended over a minute ago are deleted by each process at most once a minute.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import asyncpg

from .errors import Unavailable

__all__ = ["SharedRateLimiter", "window_of"]

# One statement: the window of PostgreSQL's clock now, and a reservation in it. `granted` is computed in SET
# from the row's old `used` (SET expressions see the old row), so RETURNING gives what this call got.
_RESERVE = """
WITH w AS (SELECT extract(epoch FROM clock_timestamp())::float8 AS now_s, $3::bigint AS len),
     s AS (SELECT now_s, (floor(now_s / len) * len)::bigint AS start, len FROM w)
INSERT INTO rate_windows AS r (key, window_start, ends_at, used, granted)
SELECT $1::text, s.start, s.start + s.len, LEAST($2::int, $4::int), LEAST($2::int, $4::int) FROM s
ON CONFLICT (key, window_start) DO UPDATE
   SET used = LEAST(r.used + $2::int, $4::int), granted = LEAST(r.used + $2::int, $4::int) - r.used
RETURNING r.granted, r.ends_at - (SELECT now_s FROM s) AS left_s
"""
_SWEEP = "DELETE FROM rate_windows WHERE ends_at < extract(epoch FROM now()) - 60"


def window_of(rate_per_s: float) -> tuple[int, int]:
    """``(window_s, budget)`` for ``rate_per_s`` (> 0): ``(1, floor(rate))`` from 1 per second up, else
    ``(ceil(1 / rate), max(1, floor(rate * window_s)))``."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive, not {rate_per_s}")
    window_s = 1 if rate_per_s >= 1 else math.ceil(1 / rate_per_s)
    return window_s, max(1, math.floor(rate_per_s * window_s))


@dataclass
class _Local:
    tokens: int  # reserved and not yet spent
    until: float  # time.monotonic() at which the window of those tokens ends
    exhausted: bool  # the shared budget of that window is gone: refuse without asking until `until`


class SharedRateLimiter:
    """At most ``budget`` calls per key in each ``window_s``-second window across every process on ``pool``'s
    database (see the module docstring; :meth:`per_second` makes one from a rate). ``batch`` defaults to a
    tenth of the budget (1 to 64). Raises ValueError for a budget or window under 1, or a batch out of
    ``1..budget``."""

    def __init__(self, pool: asyncpg.Pool, *, budget: int, window_s: int, batch: int | None = None) -> None:
        if budget < 1 or window_s < 1:
            raise ValueError(f"budget and window must be at least 1, not {budget} and {window_s}")
        self.pool = pool
        self.window_s, self.budget = window_s, budget
        self.batch = batch if batch is not None else max(1, min(64, self.budget // 10))
        if not 1 <= self.batch <= self.budget:
            raise ValueError(f"batch must be from 1 to the budget {self.budget}, not {self.batch}")
        self._local: dict[str, _Local] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._swept = time.monotonic()

    @classmethod
    def per_second(cls, pool: asyncpg.Pool, rate_per_s: float) -> SharedRateLimiter:
        """A limiter of ``rate_per_s`` calls per second per key (windows: :func:`window_of`)."""
        window_s, budget = window_of(rate_per_s)
        return cls(pool, budget=budget, window_s=window_s)

    async def allow(self, key: str) -> bool:
        """Whether one more call for ``key`` fits in its window's budget (and takes it).

        Raises :class:`~podbay.errors.Unavailable` when PostgreSQL cannot be asked."""
        if (got := self._take(key)) is not None:
            return got
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # one reservation in flight per key and process; the others wait for its tokens
            if (got := self._take(key)) is not None:
                return got
            await self._reserve(key)
            return bool(self._take(key))

    def _take(self, key: str) -> bool | None:
        """True: a local token was spent; False: the window's budget is gone; None: ask PostgreSQL."""
        local = self._local.get(key)
        if local is None or time.monotonic() >= local.until:
            return None
        if local.tokens > 0:
            local.tokens -= 1
            return True
        return False if local.exhausted else None

    async def _reserve(self, key: str) -> None:
        now = time.monotonic()
        try:
            async with self.pool.acquire() as conn:
                if now - self._swept > 60:
                    self._swept = now
                    await conn.execute(_SWEEP)
                    self._local = {k: v for k, v in self._local.items() if v.until > now}
                    self._locks = {k: v for k, v in self._locks.items() if k in self._local or v.locked()}
                row = await conn.fetchrow(_RESERVE, key, self.batch, self.window_s, self.budget)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"the rate limit of {key} could not be counted: {exc}") from exc
        assert row is not None  # an UPSERT with RETURNING always returns its row
        granted, left_s = int(row["granted"]), float(row["left_s"])
        self._local[key] = _Local(tokens=granted, until=time.monotonic() + max(0.0, left_s),
                                  exhausted=granted < self.batch)
