"""NATS JetStream access for every service: connect, declare streams/KV, publish commands, subscribe.

Names come from ``podbay.contracts.subjects``. nats-py errors are converted to ``podbay.errors`` at this
boundary. Streams (docs/DESIGN.md §4):

- ``PODBAY_CMD``: work-queue retention over ``podbay.cmd.>``; one durable pull consumer per receiver;
  the operation id is the ``Nats-Msg-Id`` so duplicate publishes within the dedupe window are dropped.
- ``PODBAY_EVT``: limits retention over ``podbay.evt.>`` (7 days, 1 GiB).
- KV ``podbay_nodes``: heartbeats with a TTL, read through one watcher per process (``podbay.nodewatch``).

A cluster: ``PODBAY_NATS_URL`` may list several servers separated by commas (:func:`nats_servers`); the client
connects to any and moves to another when its server is lost or stops answering pings. Streams and KV buckets
are declared with :attr:`Bus.replicas` replicas (R3 on a cluster of three or more; see :func:`stream_replicas`),
so JetStream keeps them, and their consumers, through the loss of any one server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel
from tenacity import retry_if_exception_type

from podbay.contracts import subjects
from podbay.contracts.messages import NodeHeartbeat
from podbay.errors import Unavailable
from podbay.nodewatch import NodeWatch
from podbay.retrying import while_starting

__all__ = ["Bus", "connect_bus", "consume", "MAX_DELIVER", "nats_servers", "stream_replicas", "PING_INTERVAL_S",
           "PUBLISH_RETRY_S"]

log = logging.getLogger("podbay.bus")

#: Deliveries of one command before JetStream gives up on it (handlers that retry by nak must answer on the last).
MAX_DELIVER = 20
#: Seconds between the client's pings; two unanswered ones mark the connection stale and the client moves to
#: another server. nats-py's default (120 s) left a client on a frozen or cut-off server for four minutes.
PING_INTERVAL_S = 2.0
#: How long :meth:`Bus.publish_command` keeps trying (s): longer than a JetStream stream's leader election
#: after a server is lost (a few seconds) plus a client's move to another server (two missed pings).
PUBLISH_RETRY_S = 15.0


def nats_servers(url: str) -> list[str]:
    """The server URLs of ``PODBAY_NATS_URL``: one URL, or several separated by commas (spaces ignored), in
    order. Raises ``ValueError`` when none is given."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError("PODBAY_NATS_URL names no server")
    return servers


def stream_replicas(configured: int, cluster_size: int) -> int:
    """Replicas of podbay's streams and KV buckets: ``configured`` when above 0, else 3 on a cluster of at
    least three servers and 1 otherwise (JetStream's replicas are at most 5 and at most the cluster's size).

    ``cluster_size``: the servers of the cluster the client learned of (its own plus those the server
    announced in ``connect_urls``), or those listed in the URL if more.
    """
    if configured > 0:
        return min(configured, 5)
    return 3 if cluster_size >= 3 else 1


class Bus:
    """A connected NATS client with its JetStream context and the podbay streams declared."""

    def __init__(self, nc: NATS, js: JetStreamContext, *, heartbeat_ttl_s: float, replicas: int = 1) -> None:
        self.nc = nc
        self.js = js
        #: Replicas of every stream and KV bucket this bus declares (:func:`stream_replicas`).
        self.replicas = replicas
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._nodes_kv: KeyValue | None = None
        self._node_watch: NodeWatch | None = None

    async def ensure_streams(self) -> None:
        """Declare the command and event streams and the node KV bucket; idempotent."""
        await self._ensure_stream(subjects.CMD_STREAM, "podbay.cmd.>", RetentionPolicy.WORK_QUEUE)
        await self._ensure_stream(subjects.EVT_STREAM, "podbay.evt.>", RetentionPolicy.LIMITS,
                                  max_age=7 * 24 * 3600.0, max_bytes=1 << 30)
        await self.nodes_kv()

    async def _ensure_stream(self, name: str, subject: str, retention: RetentionPolicy, *,
                             max_age: float | None = None, max_bytes: int | None = None) -> None:
        """Declare stream ``name`` over ``subject``: stored in files, a 120 s duplicate window (a publish
        retried with its Nats-Msg-Id is dropped), ``self.replicas``; ``max_age`` seconds and ``max_bytes``
        bound a LIMITS stream (None: unbounded)."""
        cfg = StreamConfig(name=name, subjects=[subject], retention=retention, storage=StorageType.FILE,
                           max_age=max_age, max_bytes=max_bytes, duplicate_window=120.0,
                           num_replicas=self.replicas)
        try:
            await self.js.add_stream(cfg)
        except BadRequestError:
            # Exists with another config (an older version, or R1 before the cluster grew): update in place;
            # JetStream moves a stream to more replicas by itself. Never to fewer: a process that started
            # while a server was down saw a smaller cluster, and must not strip the stream of its copies.
            current = await self.js.stream_info(cfg.name or "")
            cfg.num_replicas = max(cfg.num_replicas or 1, current.config.num_replicas or 1)
            await self.js.update_stream(cfg)

    async def nodes_kv(self) -> KeyValue:
        """The ``podbay_nodes`` KV bucket (created with the heartbeat TTL if missing)."""
        if self._nodes_kv is None:
            try:
                self._nodes_kv = await self.js.key_value(subjects.NODES_KV)
            except NotFoundError:
                self._nodes_kv = await self.js.create_key_value(
                    KeyValueConfig(bucket=subjects.NODES_KV, ttl=self._heartbeat_ttl_s, history=1,
                                   replicas=self.replicas)
                )
        return self._nodes_kv

    async def live_nodes(self) -> list[NodeHeartbeat]:
        """Heartbeats of the nodes alive now: put within the bucket's TTL (a silent node's key expired).

        Read from one long-lived watcher's cache (``podbay.nodewatch``), never by listing the bucket, so a
        lookup opens no consumer. Raises ``Unavailable`` when NATS is not connected.
        """
        if self._node_watch is None:
            self._node_watch = NodeWatch(self.nc, self.nodes_kv, ttl_s=self._heartbeat_ttl_s)
        return await self._node_watch.live()

    async def ensure_consumer(self, durable: str, filter_subject: str, *, ack_wait_s: float = 60.0) -> None:
        """Declare a durable pull consumer on the command stream (explicit ack, redelivery after ``ack_wait_s``)."""
        cfg = ConsumerConfig(
            durable_name=durable,
            filter_subject=filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=MAX_DELIVER,
            max_ack_pending=256,
        )
        await self.js.add_consumer(subjects.CMD_STREAM, cfg)

    async def pull_subscribe(self, durable: str, filter_subject: str, *, ack_wait_s: float = 60.0) -> Any:
        """A pull subscription bound to the durable consumer (declared here if missing)."""
        await self.ensure_consumer(durable, filter_subject, ack_wait_s=ack_wait_s)
        return await self.js.pull_subscribe_bind(durable=durable, stream=subjects.CMD_STREAM)

    async def publish_command(self, subject: str, msg: BaseModel, *, msg_id: str,
                              retry_s: float = PUBLISH_RETRY_S) -> None:
        """Publish a command on the work-queue stream; ``msg_id`` (the operation id) deduplicates.

        Retried for up to ``retry_s`` seconds: the caller has usually committed the state change the command
        carries out, and on a cluster a lost server or a new stream leader refuses or drops publishes for a
        few seconds (no responders, timeouts, a reconnect). A retry is safe: JetStream drops a second copy with
        the same ``Nats-Msg-Id`` within the stream's duplicate window. Raises ``Unavailable`` after that.
        """
        data = msg.model_dump_json().encode()
        deadline = time.monotonic() + retry_s
        delay = 0.1
        while True:
            try:
                await self.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id},
                                      timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                return
            except Exception as exc:  # nats-py raises several unrelated types on a lost server
                if time.monotonic() + delay >= deadline:
                    raise Unavailable(f"could not publish {subject}: {exc}") from exc
                log.warning("publish of %s failed (%s: %s); retrying", subject, type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def close(self) -> None:
        """Flush what was published, then close. (``drain`` would wait up to 30 s on an idle pull
        subscription, and everything podbay publishes that matters is already acked by JetStream.)"""
        if self._node_watch is not None:
            await self._node_watch.close()
        try:
            await self.nc.flush(timeout=2)
        except Exception:  # already closed or the server went away: nothing left to flush
            pass
        try:
            await self.nc.close()
        except Exception:
            pass


async def connect_bus(url: str, *, name: str, heartbeat_ttl_s: float = 10.0, timeout_s: float = 30.0,
                      replicas: int | None = None) -> Bus:
    """Connect with retries (``Unavailable`` after ``timeout_s``), declare the streams, return the ``Bus``.

    ``url``: one server or several separated by commas (:func:`nats_servers`); the client reconnects without
    end, to any of them or any other server the cluster announces. ``replicas``: of the streams and buckets
    (:func:`stream_replicas`; None: the ``PODBAY_NATS_REPLICAS`` setting, whose 0 means by cluster size).
    """
    servers = nats_servers(url)
    if replicas is None:
        from podbay.config import get_settings  # here: the bus is also used by tools that load no settings

        replicas = get_settings().nats_replicas

    async def _disconnected() -> None:
        log.warning("disconnected from NATS")

    async def _reconnected() -> None:
        log.info("reconnected to NATS")

    async def _error(exc: Exception) -> None:
        log.debug("NATS error: %s", exc)

    try:
        async for attempt in while_starting(timeout_s, retry_if_exception_type(Exception)):
            with attempt:
                nc = await nats.connect(
                    servers=servers,
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    ping_interval=PING_INTERVAL_S,
                    max_outstanding_pings=2,
                    disconnected_cb=_disconnected,
                    reconnected_cb=_reconnected,
                    error_cb=_error,
                )
                js = nc.jetstream(timeout=10)
                # The cluster's size as this client sees it: the servers listed, or the ones its server
                # announced (a clustered server's connect_urls name every member up, itself included).
                info = getattr(nc, "_server_info", None) or {}
                size = max(len(servers), len(info.get("connect_urls") or []), 1)
                bus = Bus(nc, js, heartbeat_ttl_s=heartbeat_ttl_s, replicas=stream_replicas(replicas, size))
                await bus.ensure_streams()
                return bus
    except Exception as exc:
        raise Unavailable(f"NATS at {url} did not answer: {exc}") from exc
    raise AssertionError("unreachable")


async def consume(sub: Any, handle: Callable[[Msg], Coroutine[Any, Any, None]], stop: asyncio.Event, *, batch: int = 1,
                  finish_timeout_s: float = 60.0) -> None:
    """Fetch from a pull subscription until ``stop``, running ``handle(msg)`` for each message concurrently.

    ``batch`` stays 1 on latency-sensitive paths: nats-py's ``fetch(n)`` with n > 1 keeps waiting for the
    rest of the batch until the pull request expires, which put up to a second on every command hop.

    ``handle`` acks, naks or terms the message itself. On ``stop`` no new message is fetched and the ones in
    flight get ``finish_timeout_s`` to finish; those still running then are cancelled and their messages
    nak'ed, so another replica (or this one restarted) gets them at once instead of after ``ack_wait``. A crash
    mid-handler is safe too: the unacked message is redelivered after the consumer's ``ack_wait``.
    """
    inflight: dict[asyncio.Task[None], Msg] = {}
    while not stop.is_set():
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except (NatsTimeoutError, TimeoutError):
            continue
        except Exception as exc:  # server restart, lost connection: nats-py reconnects by itself
            log.warning("fetch failed: %s", exc)
            await asyncio.sleep(0.5)
            continue
        for m in msgs:
            task = asyncio.create_task(handle(m))
            inflight[task] = m
            task.add_done_callback(lambda t: inflight.pop(t, None))
    if inflight:
        await asyncio.wait(set(inflight), timeout=finish_timeout_s)
    await _hand_back(inflight)


async def _hand_back(inflight: dict[asyncio.Task[None], Msg]) -> None:
    """Cancel handlers still running at shutdown and nak their messages for immediate redelivery."""
    left = dict(inflight)
    if not left:
        return
    log.warning("stopping with %d message(s) still being handled: handing them back", len(left))
    for task in left:
        task.cancel()
    await asyncio.wait(set(left), timeout=10)
    for msg in left.values():
        if getattr(msg, "_ackd", False):
            continue  # the handler acked, nak'ed or termed it before it was cancelled
        try:
            await msg.nak()
        except Exception as exc:  # noqa: BLE001 - the server redelivers after ack_wait anyway
            log.warning("could not hand back a message: %s", exc)
