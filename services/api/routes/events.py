"""``GET /v1/events``: the caller's tenant's sandbox lifecycle events, as NDJSON, from a stream position.

Each request gets its own ordered, ephemeral JetStream push consumer on ``PODBAY_EVT`` that starts at the
requested position (``DeliverPolicy.BY_START_SEQUENCE``); nothing polls. The consumer's filter subject is
the narrowest one the filters allow (``podbay.evt.sandbox.<id>.<type>`` down to ``podbay.evt.sandbox.>``);
the rest (several sandboxes or types, and always the tenant) is checked here on each event's payload, so an
event of another tenant is never written. When the client goes away Starlette cancels the generator and the
consumer is unsubscribed and deleted (the server also drops it after ``INACTIVE_S`` without interest).

Wire format: ``application/x-ndjson``, one ``EventOut`` per line, newline-terminated; while following, a
blank line every ``KEEPALIVE_S`` keeps idle connections (and proxies) alive and is to be skipped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import StreamingResponse
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from podbay.bus import Bus
from podbay.contracts import subjects
from podbay.contracts.events import EVENT_TYPE_PATTERN, EventOut
from podbay.errors import InvalidRequest, Unavailable

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep

__all__ = ["router", "EventFilter", "event_subject_filter", "stream_events"]

log = logging.getLogger("podbay.api.events")

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

#: Seconds between keep-alive blank lines while following an idle stream.
KEEPALIVE_S = 15.0
#: Seconds the server keeps a request's consumer once nobody listens (a crashed API process's leftovers).
INACTIVE_S = 30.0
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TYPE = re.compile(EVENT_TYPE_PATTERN)


@dataclass(frozen=True)
class EventFilter:
    """Which events one subscriber sees: its tenant, and optionally some sandboxes and types."""

    tenant_id: str
    sandboxes: frozenset[str] = frozenset()
    types: frozenset[str] = frozenset()

    def matches(self, payload: dict[str, object]) -> bool:
        """True when the event (its JSON payload) belongs to the tenant and passes the filters."""
        if payload.get("tenant_id") != self.tenant_id:
            return False
        if self.sandboxes and payload.get("sandbox_id") not in self.sandboxes:
            return False
        return not self.types or payload.get("type") in self.types


def event_subject_filter(f: EventFilter) -> str:
    """The narrowest single subject that covers the filter (the rest is checked per event)."""
    sbx = next(iter(f.sandboxes)) if len(f.sandboxes) == 1 else "*"
    typ = next(iter(f.types)) if len(f.types) == 1 else "*"
    if sbx == "*" and typ == "*":
        return "podbay.evt.sandbox.>"
    return subjects.sandbox_event(sbx, typ)


def parse_filter(tenant_id: str, sandbox: list[str], type_: list[str]) -> EventFilter:
    """Check the query's filters; ``InvalidRequest`` (400) names the first bad one."""
    for s in sandbox:
        if not _ID.match(s):
            raise InvalidRequest(f"invalid sandbox id {s!r}: expected 1 to 64 letters, digits, '_' or '-'")
    for t in type_:
        if not _TYPE.match(t):
            raise InvalidRequest(f"invalid event type {t!r}: expected lower-case letters, digits or '_' (two such words may be joined by '.')")
    return EventFilter(tenant_id=tenant_id, sandboxes=frozenset(sandbox), types=frozenset(type_))


def _to_line(seq: int, payload: dict[str, object]) -> bytes | None:
    try:
        return EventOut.model_validate({**payload, "seq": seq}).model_dump_json().encode() + b"\n"
    except ValidationError:  # not a lifecycle event (nothing podbay writes today): skip, never fail the stream
        log.info("skipping an event at seq %d that is not an EventOut", seq)
        return None


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # makes this an async generator


async def stream_events(bus: Bus, f: EventFilter, *, after: int, follow: bool) -> AsyncIterator[bytes]:
    """Open the consumer now, then return an iterator of NDJSON lines of the events after stream position
    ``after`` that pass ``f``.

    Opening first means a JetStream that does not answer is a 503 ``Unavailable`` before any byte of the
    answer, not a broken stream. With ``follow`` the iterator runs until cancelled (blank keep-alive lines
    while idle); without, it stops at the last event that existed when it started.
    """
    try:
        last = (await bus.js.stream_info(subjects.EVT_STREAM)).state.last_seq
    except Exception as exc:
        raise Unavailable(f"the event stream did not answer: {exc}") from exc
    if not follow and last <= after:
        return _nothing()
    cfg = ConsumerConfig(inactive_threshold=INACTIVE_S)
    if after > 0:
        cfg.deliver_policy, cfg.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, after + 1
    else:
        cfg.deliver_policy = DeliverPolicy.ALL
    try:
        sub = await bus.js.subscribe(event_subject_filter(f), stream=subjects.EVT_STREAM, ordered_consumer=True,
                                     config=cfg, idle_heartbeat=5.0)
    except Exception as exc:
        raise Unavailable(f"could not open the event stream: {exc}") from exc
    return _pump(bus, sub, f, last=last, follow=follow)


async def _pump(bus: Bus, sub: Any, f: EventFilter, *, last: int, follow: bool) -> AsyncIterator[bytes]:
    consumer: str | None = getattr(sub, "_consumer", None)  # updated from each message after a reset
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=KEEPALIVE_S if follow else 2.0)
            except (NatsTimeoutError, TimeoutError):
                if follow:
                    yield b"\n"
                    continue
                # Nothing arrived: done once the consumer has nothing more to send.
                try:
                    info = await sub.consumer_info()
                except Exception as exc:  # the consumer was reset or the server left: end; the client resumes
                    log.info("event consumer info failed, ending the listing: %s", exc)
                    return
                if info.num_pending == 0:
                    return
                continue
            meta = msg.metadata
            consumer = meta.consumer
            seq = meta.sequence.stream
            try:
                payload = json.loads(msg.data)
            except ValueError:
                payload = None
            if isinstance(payload, dict) and f.matches(payload):
                line = _to_line(seq, payload)
                if line is not None:
                    yield line
            if not follow and (seq >= last or meta.num_pending == 0):
                return
    finally:
        # Possibly cancelled (the client went away): shield the clean-up so its awaits can run.
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await sub.unsubscribe()
                if consumer:
                    await bus.js.delete_consumer(subjects.EVT_STREAM, consumer)
            except Exception as exc:  # already gone (inactive threshold) or the server left: it expires anyway
                log.debug("event consumer clean-up: %s", exc)


@router.get(
    "/events",
    responses={200: {"content": {"application/x-ndjson": {}},
                     "description": "One EventOut JSON object per line (blank lines are keep-alives)."}},
)
async def list_events(
    ctx: CtxDep,
    who: PrincipalDep,
    sandbox: list[str] = Query([], max_length=100, description="Only events of these sandboxes (repeatable)."),
    type: list[str] = Query([], max_length=32, description="Only these event types, e.g. created, paused "
                            "(repeatable)."),
    after: int | None = Query(None, ge=0, description="Start after this stream position (an event's `seq`); "
                              "default 0: from the oldest kept event."),
    follow: bool = Query(False, description="Keep the response open and stream new events as they happen."),
    last_event_id: str | None = Header(None, description="Same as `after` (when `after` is absent)."),
) -> StreamingResponse:
    """The tenant's sandbox lifecycle events in stream order, as NDJSON (``EventOut`` per line).

    Resume with ``after=<the last seq you handled>``: every later event comes once, none is repeated.
    """
    f = parse_filter(who.tenant_id, sandbox, type)
    start = after
    if start is None and last_event_id:
        if not last_event_id.strip().isdigit():
            raise InvalidRequest(f"invalid Last-Event-ID {last_event_id[:40]!r}: expected a stream position")
        start = int(last_event_id.strip())
    body = await stream_events(ctx.bus, f, after=start or 0, follow=follow)
    return StreamingResponse(body, media_type="application/x-ndjson",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
