"""Lease renewals on activity, batched: the data plane's hot path (exec, files) writes no lease to PostgreSQL.

Every data-plane call of a running sandbox renews its lease (``lease_expires_at = now() + lease_s``, so an idle
sandbox's lease action, pause or delete, runs ``lease_s`` after its last call: services/nodeagent/ops/lease.py).
Instead of one ``UPDATE`` per call, a process notes the sandbox here (:meth:`LeaseRenewals.note`, in memory)
and :meth:`LeaseRenewals.run` renews every sandbox noted since the last flush in one statement every
:data:`FLUSH_S` seconds. So a busy fleet's database load follows the number of active sandboxes per interval,
not the number of commands.

What stays true: a lease is extended at most :data:`FLUSH_S` (plus one statement) after the call that earned
it, and from the flush's time, so the lease ends no earlier than it did with the immediate renewal (at most
:data:`FLUSH_S` later). A call to a sandbox whose lease runs out within :data:`SYNC_MARGIN_S` is renewed at once
by the caller (:func:`due_sql`), so a delayed renewal never lets an active sandbox's lease expire. A flush that
fails keeps its sandboxes for the next one. A process that stops flushes what it holds (the last pass of :meth:`LeaseRenewals.run`); one
that dies loses at most one interval of renewals (those sandboxes' leases end up to :data:`FLUSH_S` early, at
the time the previous renewal gave them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg

from podbay.lifecycle import renew_leases_sql

__all__ = ["LeaseRenewals", "FLUSH_S", "SYNC_MARGIN_S", "FLUSH_SQL", "due_sql"]

log = logging.getLogger("podbay.renewals")

#: Seconds between two flushes of the noted renewals.
FLUSH_S = 2.0
#: A call renews at once (not batched) when the lease ends within this many seconds: two flush intervals, so
#: a flush that is late or fails once still cannot let an active sandbox's lease run out.
SYNC_MARGIN_S = 3 * FLUSH_S

#: $1 sandbox ids: renew the leases of those still running, in one statement.
FLUSH_SQL = renew_leases_sql()


def due_sql(table: str = "sandboxes") -> str:
    """A boolean SQL expression over ``table``'s row: its lease ends within :data:`SYNC_MARGIN_S` (renew now)."""
    return f"({table}.lease_expires_at < now() + interval '{SYNC_MARGIN_S:g} seconds')"


class LeaseRenewals:
    """The sandboxes of this process whose lease a call renewed since the last flush (ids, in memory)."""

    def __init__(self, pool: asyncpg.Pool, *, flush_s: float = FLUSH_S) -> None:
        self._pool = pool
        self._flush_s = flush_s
        self._noted: set[str] = set()
        self.flushes = 0  # statements written (for tests and metrics)

    def note(self, sandbox_id: str) -> None:
        """Renew ``sandbox_id``'s lease at the next flush (it must be running then)."""
        self._noted.add(sandbox_id)

    async def flush(self) -> int:
        """Renew every noted lease now in one statement; returns how many sandboxes were noted (0: no
        statement). On a database error the ids are kept for the next flush and the error is raised."""
        if not self._noted:
            return 0
        ids, self._noted = self._noted, set()
        try:
            await self._pool.execute(FLUSH_SQL, sorted(ids))  # sorted: row locks in one order across replicas
        except BaseException:
            self._noted |= ids
            raise
        self.flushes += 1
        return len(ids)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every ``flush_s`` seconds until ``stop`` is set, then once more."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._flush_s)
            try:
                await self.flush()
            except Exception as exc:  # PostgreSQL away: kept for the next flush
                log.warning("lease renewals not written (%d kept): %s", len(self._noted), exc)
            if stop.is_set():
                return
