"""NATS JetStream access for every service: connect, declare streams/KV, publish commands, subscribe.

Names come from ``podbay.contracts.subjects``. nats-py errors are converted to ``podbay.errors`` at this
boundary. Streams (docs/DESIGN.md §4):

- ``PODBAY_CMD``: work-queue retention over ``podbay.cmd.>``; one durable pull consumer per receiver;
  the operation id is the ``Nats-Msg-Id`` so duplicate publishes within the dedupe window are dropped.
- ``PODBAY_EVT``: limits retention over ``podbay.evt.>`` (7 days, 1 GiB).
- KV ``podbay_nodes``: heartbeats with a TTL, read through one watcher per process (``podbay.nodewatch``).
"""

from __future__ import annotations

import asyncio
import logging
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
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from podbay.contracts import subjects
from podbay.contracts.messages import NodeHeartbeat
from podbay.errors import Unavailable
from podbay.nodewatch import NodeWatch

__all__ = ["Bus", "connect_bus", "consume", "MAX_DELIVER"]

log = logging.getLogger("podbay.bus")

#: Deliveries of one command before JetStream gives up on it (handlers that retry by nak must answer on the last).
MAX_DELIVER = 20


class Bus:
    """A connected NATS client with its JetStream context and the podbay streams declared."""

    def __init__(self, nc: NATS, js: JetStreamContext, *, heartbeat_ttl_s: float) -> None:
        self.nc = nc
        self.js = js
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._nodes_kv: KeyValue | None = None
        self._node_watch: NodeWatch | None = None

    async def ensure_streams(self) -> None:
        """Declare the command and event streams and the node KV bucket; idempotent."""
        await self._ensure_stream(
            StreamConfig(
                name=subjects.CMD_STREAM,
                subjects=["podbay.cmd.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=120.0,
            )
        )
        await self._ensure_stream(
            StreamConfig(
                name=subjects.EVT_STREAM,
                subjects=["podbay.evt.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=7 * 24 * 3600.0,
                max_bytes=1 << 30,
                duplicate_window=120.0,
            )
        )
        await self.nodes_kv()

    async def _ensure_stream(self, cfg: StreamConfig) -> None:
        try:
            await self.js.add_stream(cfg)
        except BadRequestError:
            # Exists with another config (e.g. an older version): update in place.
            await self.js.update_stream(cfg)

    async def nodes_kv(self) -> KeyValue:
        """The ``podbay_nodes`` KV bucket (created with the heartbeat TTL if missing)."""
        if self._nodes_kv is None:
            try:
                self._nodes_kv = await self.js.key_value(subjects.NODES_KV)
            except NotFoundError:
                self._nodes_kv = await self.js.create_key_value(
                    KeyValueConfig(bucket=subjects.NODES_KV, ttl=self._heartbeat_ttl_s, history=1)
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

    async def publish_command(self, subject: str, msg: BaseModel, *, msg_id: str) -> None:
        """Publish a command on the work-queue stream; ``msg_id`` (the operation id) deduplicates."""
        try:
            await self.js.publish(subject, msg.model_dump_json().encode(), headers={"Nats-Msg-Id": msg_id})
        except Exception as exc:  # nats-py raises several unrelated types on a lost server
            raise Unavailable(f"could not publish {subject}: {exc}") from exc

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


async def connect_bus(url: str, *, name: str, heartbeat_ttl_s: float = 10.0, timeout_s: float = 30.0) -> Bus:
    """Connect with retries (``Unavailable`` after ``timeout_s``), declare the streams, return the ``Bus``."""

    async def _disconnected() -> None:
        log.warning("disconnected from NATS")

    async def _reconnected() -> None:
        log.info("reconnected to NATS")

    async def _error(exc: Exception) -> None:
        log.debug("NATS error: %s", exc)

    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(Exception),
            reraise=True,
        ):
            with attempt:
                nc = await nats.connect(
                    url,
                    name=name,
                    connect_timeout=2,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    disconnected_cb=_disconnected,
                    reconnected_cb=_reconnected,
                    error_cb=_error,
                )
                js = nc.jetstream(timeout=10)
                bus = Bus(nc, js, heartbeat_ttl_s=heartbeat_ttl_s)
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
