"""HTTP API bodies for event subscribers: the event stream (``GET /v1/events``) and webhooks (``/v1/webhooks``).

An event on the wire is one JSON object per line (NDJSON), the lifecycle ``Event`` plus ``seq``: its
position in the ``PODBAY_EVT`` JetStream stream. Positions only grow, so a subscriber that keeps the last
``seq`` it handled resumes with ``after=<seq>`` and sees every later event once.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

__all__ = [
    "EVENT_TYPE_PATTERN",
    "EVENT_TYPES",
    "EventType",
    "EventOut",
    "WebhookCreate",
    "WebhookInfo",
    "WebhookCreated",
    "WebhookList",
]

#: An event type: lower-case letters, digits and underscores, in one token or two joined by a dot
#: (``schedule.fired``); each token is one NATS subject token, so a filter on it stays one subject.
EVENT_TYPE_PATTERN = r"^[a-z][a-z0-9_]{0,31}(\.[a-z][a-z0-9_]{0,31})?$"



class EventType(StrEnum):
    """The sandbox event types podbay emits, on ``podbay.evt.sandbox.<id>.<type>`` (the one list: emitters
    pass these members to ``podbay.lifecycle.SandboxEvent``/``podbay.outbox.emit_sandbox_event``, the CLI
    notes a filter type outside it, docs/sdk.md's table lists it; a unit test checks all three). Filters
    accept any well-formed type (``EVENT_TYPE_PATTERN``), for types to come. A member is its wire string."""

    CREATED = "created"  # the API accepted a create or a fork child (state starting)
    STARTED = "started"  # the guest runs on its node (create, warm claim, fork child)
    PAUSED = "paused"  # held in memory; also a suspend that failed and left it paused
    RESUMED = "resumed"  # runs again after a pause, or after a wake from suspended
    SNAPSHOTTED = "snapshotted"  # a disk or full snapshot was taken on the node
    PROMOTED = "promoted"  # a snapshot's files reached the object store
    SUSPENDING = "suspending"  # on its way to the object store
    SUSPENDED = "suspended"  # no VM, no node files: only the object store holds it
    RESUMING = "resuming"  # a wake from suspended was placed
    RESTORED = "restored"  # rolled back to one of its snapshots
    FORKED = "forked"  # the parent's event once its children started
    REATTACHED = "reattached"  # a restarted node agent found the VM alive and took it back
    MIGRATED = "migrated"  # live-migrated to another node (a drain)
    RESCHEDULED = "rescheduled"  # its node was lost; placed again from its newest snapshot
    FAILED = "failed"
    DELETED = "deleted"
    SCHEDULE_FIRED = "schedule.fired"  # a schedule's run started
    SCHEDULE_FINISHED = "schedule.finished"  # a schedule's run ended (data.state, data.exit_code)


#: The values of ``EventType``, in its order (what the CLI names in its note).
EVENT_TYPES: tuple[str, ...] = tuple(t.value for t in EventType)

#: A type a filter names: any well-formed type, not only ``EventType``'s.
EventTypeName = Annotated[str, StringConstraints(pattern=EVENT_TYPE_PATTERN)]


class EventOut(BaseModel):
    """One lifecycle event as a subscriber sees it.

    ``seq`` is the stream position (resume after it); ``data.seq`` orders one sandbox's own events.
    """

    model_config = ConfigDict(extra="ignore")

    seq: int = Field(description="Position in the event stream; pass it back as `after` to resume.")
    id: str = Field(description="Event id (unique; the webhook delivery carries it too).")
    type: str
    sandbox_id: str | None = None
    node_id: str | None = None
    tenant_id: str | None = None
    generation: int | None = None
    state: str | None = None
    reason: str | None = None
    at: datetime
    data: dict[str, Any] = Field(default_factory=dict)


class WebhookCreate(BaseModel):
    """``POST /v1/webhooks``: where to POST events, and which types (empty: all)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=8, max_length=2048, description="http:// or https:// URL that receives POSTs.")
    types: list[EventTypeName] = Field(default_factory=list, max_length=32,
                                   description="Only these event types; empty means every type.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/?#]+[^\s]*$", v):
            raise ValueError("must be an http:// or https:// URL without spaces")
        return v


class WebhookInfo(BaseModel):
    """A webhook and the state of its deliveries (never its secret)."""

    id: str
    url: str
    types: list[str]
    created_at: datetime
    deliveries: int = Field(0, description="Events delivered (a 2xx answer).")
    failures: int = Field(0, description="Events given up on after the last attempt.")
    last_status: int | None = Field(None, description="HTTP status of the last attempt (null: no answer).")
    last_attempts: int | None = Field(None, description="Attempts the last event took.")
    last_error: str | None = None
    last_event_seq: int | None = Field(None, description="Stream position of the last event handled.")
    last_attempt_at: datetime | None = None


class WebhookCreated(WebhookInfo):
    """The answer to a create: the signing secret, shown this once."""

    secret: str = Field(description="HMAC-SHA256 key for the `Podbay-Signature` header; shown only now.")


class WebhookList(BaseModel):
    webhooks: list[WebhookInfo]
