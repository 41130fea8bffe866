"""Logging and Prometheus metrics shared by every service.

Metric names are ``podbay_<what>_<unit>``; labels are small closed sets (states, operation kinds, outcomes),
never ids. Every service serves ``/metrics`` (Prometheus text format), ``/healthz`` and ``/readyz``.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import Counter, Gauge, Histogram

from podbay.logs import configure_logging

__all__ = [
    "setup_logging",
    "HTTP_REQUEST_SECONDS",
    "LIFECYCLE_OPERATION_SECONDS",
    "LIFECYCLE_OPERATIONS",
    "HOP_SECONDS",
    "LATENCY_BUCKETS",
    "NODE_CAPACITY",
    "NODE_USED",
    "NODE_SANDBOXES",
    "NODE_HEARTBEATS",
    "PROMOTION_LAG_SECONDS",
    "SCHEDULE_RUNS",
    "SCHEDULE_WAKE_SECONDS",
    "SCHEDULE_LATENESS_SECONDS",
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

# Schedules (services/api/schedules/): outcomes are a closed set (ScheduleRunState), so they stay few labels.
SCHEDULE_RUNS = Counter("podbay_schedule_runs_total", "Schedule runs by outcome (succeeded, failed, timed_out, "
                        "wake_failed, skipped, interrupted).", ["outcome"])
SCHEDULE_WAKE_SECONDS = Histogram("podbay_schedule_wake_seconds", "From a schedule run's start to its sandbox "
                                  "answering, by the state it woke from (running, paused, suspended).",
                                  ["from_state"], buckets=LATENCY_BUCKETS)
SCHEDULE_LATENESS_SECONDS = Histogram("podbay_schedule_lateness_seconds", "How late a run's command started "
                                      "(or its wake finished, without a command) against the schedule's time, "
                                      "jitter included.", buckets=LATENCY_BUCKETS + (300, 900, 3600))

# Node capacity and load, as this node's agent puts them in its heartbeat (alerts: capacity; heartbeats stopping).
NODE_CAPACITY = Gauge("podbay_node_capacity", "Resources this node offers to sandboxes (memory_mib, vcpus).",
                      ["resource"])
NODE_USED = Gauge("podbay_node_used", "Resources this node's sandboxes hold (memory_mib, vcpus).", ["resource"])
NODE_SANDBOXES = Gauge("podbay_node_sandboxes", "Sandboxes on this node.")
NODE_HEARTBEATS = Counter("podbay_node_heartbeats_total", "Heartbeats put into the node KV bucket, by outcome "
                          "(ok, failed).", ["outcome"])
# What a loss of this node would lose: the oldest "newest promoted snapshot" among its live sandboxes.
PROMOTION_LAG_SECONDS = Gauge("podbay_snapshot_promotion_lag_seconds", "Largest age, over this node's running and "
                              "paused sandboxes, of their newest promoted snapshot (or of the sandbox when none).")

# Snapshot and promotion cadence work on this node (issue: idle sandboxes cost nothing); no sandbox ids in labels.
CADENCE_WORK_SECONDS = Counter("podbay_cadence_work_seconds_total", "Wall time of cadence work on this node, by "
                               "kind (check: change detection; snapshot_disk, snapshot_full; promotion).", ["kind"])
CADENCE_SKIPPED = Counter("podbay_cadence_skipped_total", "Cadence snapshots and promotions not taken because "
                          "nothing changed since the last one, by kind (disk, full, promotion).", ["kind"])
CADENCE_LAG_SECONDS = Gauge("podbay_cadence_lag_seconds", "Worst lateness, in seconds, of a due cadence snapshot "
                            "at this node's last cadence pass (budget and API back-off delay it).")
PROMOTION_BYTES = Counter("podbay_promotion_bytes_total", "Bytes of promoted snapshot files by what promotion did "
                          "with them: hashed (read and hashed), reused (hash taken from the previous promoted "
                          "snapshot: extents shared), uploaded (uncompressed bytes of the chunks sent).", ["what"])
CPU_PRESSURE = Gauge("podbay_node_cpu_pressure", "The host's CPU pressure (/proc/pressure/cpu some avg10, percent "
                     "of time some task waited for a CPU).")

NODE_LOCAL_SERVICES = frozenset({"nodeagent", "snapshotter", "gateway"})


def setup_logging(service: str, level: str | None = None) -> None:
    """Logs on stderr in ``PODBAY_LOG_FORMAT`` (``text``: ``HH:MM:SS LEVEL service logger: message``; ``json``: one
    object per line with sandbox/operation/node ids, see :mod:`podbay.logs`), secrets redacted."""
    from podbay.config import get_settings

    settings = get_settings()
    static = {"node_id": settings.node_id} if service in NODE_LOCAL_SERVICES else {}
    secrets = [settings.internal_token, settings.credential_key, settings.openbao_token, settings.grant_signing_key,
               os.environ.get("AWS_SECRET_ACCESS_KEY", ""), settings.api_key or ""]
    configure_logging(service, level=(level or settings.log_level or "INFO"), fmt=settings.log_format,
                      static=static, secrets=secrets)
    # httpx logs one INFO line per request ("HTTP Request: GET ... 200 OK"): the node agent's port proxy and
    # every service-to-service call would flood the logs with it. httpcore logs at DEBUG only, but a DEBUG
    # service level would let its per-connection trace through. Their warnings and errors still show.
    for noisy in ("uvicorn.access", "nats", "botocore", "aiobotocore", "qemu.qmp", "asyncio", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # qemu.qmp logs every refused connect while QEMU is still creating its socket; the driver reports
    # real failures itself.
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)
