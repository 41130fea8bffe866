"""Logging and Prometheus metrics shared by every service.

Metric names are ``podbay_<what>_<unit>``; labels are small closed sets (states, operation kinds, outcomes),
never ids. Every service serves ``/metrics`` (Prometheus text format) and ``/healthz``.
"""

from __future__ import annotations

import logging
import os
import sys

from prometheus_client import Counter, Histogram

__all__ = [
    "setup_logging",
    "HTTP_REQUEST_SECONDS",
    "LIFECYCLE_OPERATION_SECONDS",
    "LIFECYCLE_OPERATIONS",
    "HOP_SECONDS",
    "LATENCY_BUCKETS",
]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

HTTP_REQUEST_SECONDS = Histogram(
    "podbay_http_request_seconds",
    "HTTP request duration, by route template, method and status class.",
    ["service", "route", "method", "status"],
    buckets=LATENCY_BUCKETS,
)
LIFECYCLE_OPERATION_SECONDS = Histogram(
    "podbay_lifecycle_operation_seconds",
    "Duration of sandbox lifecycle operations as seen by the service, by kind and outcome.",
    ["service", "kind", "outcome"],
    buckets=LATENCY_BUCKETS,
)
LIFECYCLE_OPERATIONS = Counter(
    "podbay_lifecycle_operations_total",
    "Sandbox lifecycle operations, by kind and outcome.",
    ["service", "kind", "outcome"],
)
HOP_SECONDS = Histogram(
    "podbay_hop_seconds",
    "Time spent in one hop of a request path (db, bus, node, qemu, guest).",
    ["service", "hop"],
    buckets=LATENCY_BUCKETS,
)


class _Formatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__("%(asctime)s %(levelname)-5s " + service + " %(name)s: %(message)s", "%H:%M:%S")


def setup_logging(service: str, level: str | None = None) -> None:
    """Readable one-line logs on stderr: ``HH:MM:SS LEVEL service logger: message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("PODBAY_LOG_LEVEL") or "INFO").upper())
    for noisy in ("uvicorn.access", "nats", "botocore", "aiobotocore", "qemu.qmp", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # qemu.qmp logs every refused connect while QEMU is still creating its socket; the driver reports
    # real failures itself.
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)
