"""The back-off of a connection to a server that may still be starting (PostgreSQL, NATS).

``connect_pool`` (:mod:`podbay.db`) and ``connect`` (:mod:`podbay.bus`) run their connect in
``async for attempt in while_starting(timeout_s, retry): with attempt: ...``: a service that starts next to
its servers waits for them instead of failing at once.
"""

from __future__ import annotations

from tenacity import AsyncRetrying, stop_after_delay, wait_exponential
from tenacity.retry import retry_base

__all__ = ["while_starting"]


def while_starting(timeout_s: float, retry: retry_base) -> AsyncRetrying:
    """Attempts for up to ``timeout_s`` seconds, 50 ms apart at first and doubling to 1 s, while ``retry``
    says the error is worth another try; the last error is re-raised as it is."""
    return AsyncRetrying(
        stop=stop_after_delay(timeout_s),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        retry=retry,
        reraise=True,
    )
