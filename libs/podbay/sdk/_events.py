"""Event subscription and webhooks for the SDK: request builders and the NDJSON line parser (the
``client.webhooks`` namespace is in ``podbay.sdk._async_namespaces`` and the generated ``_sync_namespaces``).

``client.events(...)`` (sync iterator) and ``async for e in async_client.events(...)`` yield ``EventOut``
models; ``event.seq`` is the stream position to resume after. While following, a dropped connection is
reopened from the last position seen (no loss, no repeat), waiting ``RECONNECT_S`` doubling up to 10 s.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

import httpx

from podbay.contracts.events import EventOut, WebhookCreated, WebhookInfo, WebhookList
from podbay.sdk._calls import Call, _model, check_id, ndjson_line

__all__ = [
    "RECONNECT_S",
    "events_call",
    "parse_event_line",
]

#: First wait before reopening a followed stream that dropped, in seconds (doubles, at most 10 s).
RECONNECT_S = 0.5


def events_call(*, sandbox: str | Sequence[str] | None = None, types: Sequence[str] | None = None,
                after: int | None = None, follow: bool = False) -> Call[None]:
    """``GET /v1/events`` with the filters; ids are checked before anything is sent."""
    sandboxes = [sandbox] if isinstance(sandbox, str) else list(sandbox or [])
    params: list[tuple[str, str]] = [("sandbox", check_id(s)) for s in sandboxes]
    params += [("type", t) for t in (types or [])]
    if after is not None:
        params.append(("after", str(int(after))))
    params.append(("follow", "true" if follow else "false"))
    # A list of pairs keeps repeated keys; Call.params is a Mapping, so pass it through httpx's own type.
    return Call("GET", "/v1/events", parse=lambda r: None, params=_Pairs(params), long_running=True,
                read_timeout_s=None if follow else 60.0)


class _Pairs(dict[str, Any]):
    """Query pairs with repeated keys, accepted where ``request_options`` does ``dict(call.params)``."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        grouped: dict[str, list[str]] = {}
        for k, v in pairs:
            grouped.setdefault(k, []).append(v)
        super().__init__(grouped)


def parse_event_line(line: str, url: str) -> EventOut | None:
    """One NDJSON line -> its ``EventOut``; ``None`` for a blank (keep-alive) line."""
    return ndjson_line(EventOut, line, lambda exc: f"malformed event from {url}: {line[:200]!r}")


def _webhook_path(webhook_id: str) -> str:
    return f"/v1/webhooks/{check_id(webhook_id, 'webhook id')}"


def create_webhook_call(url: str, types: Sequence[str] | None = None) -> Call[WebhookCreated]:
    return Call("POST", "/v1/webhooks", parse=_model(WebhookCreated), json={"url": url, "types": list(types or [])})


def _hooks(resp: httpx.Response) -> builtins.list[WebhookInfo]:
    return _model(WebhookList)(resp).webhooks


def list_webhooks_call() -> Call[builtins.list[WebhookInfo]]:
    return Call("GET", "/v1/webhooks", parse=_hooks)


def delete_webhook_call(webhook_id: str) -> Call[WebhookInfo]:
    return Call("DELETE", _webhook_path(webhook_id), parse=_model(WebhookInfo))
