"""API work in flight on this node's data plane, which the snapshot cadence yields to (:mod:`.cadence`).

:class:`ApiWork` (plain ASGI, inside the grant check) notes each exec and file call while it runs. The node
counts as busy while a call started less than ``BUSY_WINDOW_S`` ago is still running: a user's short command
is waiting or running now, and background work should not compete with it for the two cores. A long stream
(an exec that runs for minutes, a port's WebSocket) stops counting after the window, so it cannot hold the
cadence off for good.
"""

from __future__ import annotations

import itertools
import time

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ApiWork", "busy", "BUSY_WINDOW_S"]

BUSY_WINDOW_S = 5.0
_started: dict[int, float] = {}  # request number -> monotonic start, of calls still running
_ids = itertools.count()


def busy(now: float | None = None) -> bool:
    """Whether an API call that started in the last ``BUSY_WINDOW_S`` seconds is still running here."""
    t = time.monotonic() if now is None else now
    return any(t - s < BUSY_WINDOW_S for s in _started.values())


class ApiWork:
    """Notes the data plane's sandbox calls (``/v1/sandboxes/...``) while they run (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or "/sandboxes/" not in scope.get("path", ""):
            await self.app(scope, receive, send)
            return
        n = next(_ids)
        _started[n] = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            _started.pop(n, None)
