"""The live node heartbeats, kept by one long-lived watcher on the ``podbay_nodes`` KV bucket.

A lookup (:meth:`NodeWatch.live`) reads a dict in memory: it opens no JetStream consumer. Listing the
bucket on every lookup (``kv.keys()`` plus a get per key) created a consumer each time, and a burst of
placements ran into JetStream's "maximum consumers limit reached".

What the cache holds, and why it matches the bucket:

- **Puts** arrive through one ordered push consumer (``KeyValue.watchall``): the last value of every key
  first, then each new put. A put's expiry is its stored time (the server's) plus the bucket's TTL
  (``max_age``), converted to this process's monotonic clock once, when the put arrives.
- **Expiry by TTL** produces no message on a bucket without subject delete markers (ours: the limit
  removes old messages silently), so a key whose heartbeat stopped simply ages out of the cache at the same
  moment it leaves the bucket. A node is therefore "live" exactly when its last heartbeat is younger than
  the TTL, as before. Servers and buckets that do emit expiry markers (``Nats-Marker-Reason``) and explicit
  deletes or purges drop the key at once.
- **A lost watcher** (server restart, reconnect, an ordered consumer that went quiet) is replaced: after a
  reconnect, and whenever no update arrived for ``resync_s`` seconds, the watcher is stopped and a new one
  rebuilds the cache from the bucket. So a watcher never stays stale for more than ``resync_s``; this costs
  one consumer per ``resync_s`` on a quiet bucket, never one per lookup.

Errors: :meth:`NodeWatch.live` raises ``Unavailable`` when NATS is not connected or the first load did not
finish within ``load_timeout_s`` (an outage must never read as "no nodes").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from podbay.contracts.messages import NodeHeartbeat
from podbay.errors import Unavailable

__all__ = ["NodeWatch"]

log = logging.getLogger("podbay.nodewatch")


@dataclass(frozen=True)
class _Seen:
    heartbeat: NodeHeartbeat
    expires: float  # time.monotonic() seconds


class NodeWatch:
    """Live heartbeats from one watcher on the node bucket (module docstring).

    ``kv``: returns the bucket (created if missing); ``ttl_s``: the TTL to assume when the bucket does not
    say (its ``max_age`` wins); ``resync_s``: replace a watcher that delivered nothing for this long;
    ``load_timeout_s``: how long a lookup waits for the first load.
    """

    def __init__(self, nc: NATS, kv: Callable[[], Awaitable[KeyValue]], *, ttl_s: float, resync_s: float = 30.0,
                 load_timeout_s: float = 10.0) -> None:
        self._nc = nc
        self._kv = kv
        self._ttl_s = ttl_s
        self._resync_s = resync_s
        self._load_timeout_s = load_timeout_s
        self._nodes: dict[str, _Seen] = {}
        self._loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        #: How many watchers were opened so far (one per start or resync; tests read it).
        self.watchers_opened = 0

    async def live(self) -> list[NodeHeartbeat]:
        """Heartbeats of the nodes whose last put is younger than the bucket's TTL, in key order.

        Raises ``Unavailable`` when NATS is not connected or the first load did not finish in time.
        """
        if self._nc.is_closed or not self._nc.is_connected:
            raise Unavailable("NATS is not connected: the live nodes are unknown")
        if self._closing:
            raise Unavailable("the node watcher is closed")
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="node-watch")
        if not self._loaded.is_set():
            try:
                await asyncio.wait_for(self._loaded.wait(), timeout=self._load_timeout_s)
            except TimeoutError as exc:
                raise Unavailable(f"the node bucket did not load within {self._load_timeout_s:g} s") from exc
        now = time.monotonic()
        return [seen.heartbeat for _, seen in sorted(self._nodes.items()) if seen.expires > now]

    async def close(self) -> None:
        """Stop the watcher (idempotent; returns within about two seconds)."""
        self._closing = True
        task, self._task = self._task, None
        if task is None:
            return
        # The loop sees the flag within a second and stops its watcher itself; cancelling a task parked in
        # nats-py's queue read was seen to hang, so cancel only as a last resort and never wait on it.
        await asyncio.wait({task}, timeout=2.0)
        if not task.done():
            task.cancel()

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self._watch_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - lost connection, server restart: watch again shortly
                if self._closing:
                    return
                log.warning("node watcher failed: %s; watching again", exc)
                await asyncio.sleep(0.5)

    async def _watch_once(self) -> None:
        """One watcher: load the bucket into a fresh dict, swap it in, then apply updates until a resync."""
        kv = await self._kv()
        ttl_s = self._ttl_s
        with contextlib.suppress(Exception):  # an older server may not say; the configured TTL stands
            max_age = (await kv.status()).stream_info.config.max_age
            if max_age:
                ttl_s = float(max_age)
        reconnects = self._nc.stats.get("reconnects", 0)
        # A stopped watcher's ephemeral consumer is removed by the server once it has had no subscriber
        # for this long (nats-py's default is 5 minutes, which let resyncs pile consumers up).
        watcher = await kv.watchall(inactive_threshold=10.0)
        self.watchers_opened += 1
        fresh: dict[str, _Seen] | None = {}
        last = time.monotonic()
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=1.0)
                except (NatsTimeoutError, TimeoutError):
                    entry = False  # nothing this second
                now = time.monotonic()
                if self._closing:
                    return
                if self._nc.stats.get("reconnects", 0) != reconnects:
                    log.info("node watcher: NATS reconnected; watching again")
                    return
                if entry is False:
                    if now - last >= self._resync_s:
                        return  # a quiet watcher may be a dead one: rebuild from the bucket
                    continue
                last = now
                target = fresh if fresh is not None else self._nodes
                if entry is None:  # the initial values are all in
                    if fresh is not None:
                        self._nodes = fresh
                        fresh = None
                        self._loaded.set()
                    continue
                self._apply(target, entry, ttl_s, now)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    @staticmethod
    def _apply(nodes: dict[str, _Seen], entry: KeyValue.Entry, ttl_s: float, now: float) -> None:
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            nodes.pop(entry.key, None)
            return
        try:
            hb = NodeHeartbeat.model_validate_json(entry.value)
        except ValidationError as exc:
            log.warning("skipping node %s: its heartbeat is not a NodeHeartbeat: %s", entry.key, exc)
            nodes.pop(entry.key, None)
            return
        stored = entry.created
        age = 0.0
        if isinstance(stored, datetime):
            age = (datetime.now(UTC) - stored).total_seconds()
        # Clamp: a clock skew between this host and the server must not make a fresh put look expired or
        # an old one immortal.
        age = min(max(age, 0.0), ttl_s)
        nodes[entry.key] = _Seen(hb, now + ttl_s - age)
