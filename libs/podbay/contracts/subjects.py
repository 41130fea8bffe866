"""JetStream names (docs/DESIGN.md §4). Every subject string in podbay is built here."""

from __future__ import annotations

__all__ = [
    "CMD_STREAM",
    "EVT_STREAM",
    "NODES_KV",
    "LEASES_KV",
    "SCHEDULER_PLACE",
    "SCHEDULER_CONSUMER",
    "node_cmd",
    "node_cmd_filter",
    "node_consumer",
    "sandbox_event",
    "node_event",
    "operation_done",
    "OPERATIONS_DONE_WILDCARD",
    "snapshotter_promote",
    "snapshotter_consumer",
    "warm_claim",
    "warm_kick",
    "WARM_POOLS_CHANGED",
    "API_KEY_REVOKED",
    "audit_event",
    "egress_event",
    "SCHEDULER_DRAIN",
    "SCHEDULER_DRAIN_CONSUMER",
    "migrate_prepare",
    "migrate_finish",
]

CMD_STREAM = "PODBAY_CMD"
"""Work-queue stream over ``podbay.cmd.>``: each command is delivered to one consumer and removed on ack."""

EVT_STREAM = "PODBAY_EVT"
"""Limits stream over ``podbay.evt.>``: lifecycle events, kept for subscribers."""

NODES_KV = "podbay_nodes"
"""KV bucket: key = node id, value = ``NodeHeartbeat`` JSON; the bucket TTL expires silent nodes."""

LEASES_KV = "podbay_leases"
"""KV bucket of leader leases (``podbay.lease``): key = the singleton loop's name, value = holder JSON; the
bucket TTL (``lease_ttl_s``) expires a lease its holder stopped renewing."""

SCHEDULER_PLACE = "podbay.cmd.scheduler.place"
SCHEDULER_CONSUMER = "scheduler"
SCHEDULER_DRAIN = "podbay.cmd.scheduler.drain"
"""``DrainNodeCmd``: the scheduler moves every sandbox off a draining node (its own durable consumer)."""
SCHEDULER_DRAIN_CONSUMER = "scheduler-drain"


def node_cmd(node_id: str, verb: str) -> str:
    """``podbay.cmd.node.<node>.<verb>``: a command for one node agent."""
    return f"podbay.cmd.node.{node_id}.{verb}"


def node_cmd_filter(node_id: str) -> str:
    return f"podbay.cmd.node.{node_id}.>"


def node_consumer(node_id: str) -> str:
    return f"node-{node_id}"


def sandbox_event(sandbox_id: str, event_type: str) -> str:
    """``podbay.evt.sandbox.<id>.<type>`` (types: created, started, failed, deleted, ...)."""
    return f"podbay.evt.sandbox.{sandbox_id}.{event_type}"


def node_event(node_id: str, event_type: str) -> str:
    return f"podbay.evt.node.{node_id}.{event_type}"


def snapshotter_promote(node_id: str) -> str:
    """``podbay.cmd.snapshotter.<node>.promote``: promote a snapshot whose files are on ``node_id``."""
    return f"podbay.cmd.snapshotter.{node_id}.promote"


def snapshotter_consumer(node_id: str) -> str:
    return f"snapshotter-{node_id}"


OPERATIONS_DONE_WILDCARD = "podbay.ops.*"


def operation_done(operation_id: str) -> str:
    """``podbay.ops.<operation id>``: a core-NATS notice (not a stream) that an operation finished.

    The truth is the ``operations`` row; the notice only wakes an API call that waits for it.
    """
    return f"podbay.ops.{operation_id}"


def warm_claim(node_id: str) -> str:
    """``podbay.warm.<node>.claim``: core-NATS request/reply; the API hands a claimed warm slot to its node,
    which resumes it and answers ``WarmClaimReply``. Not a stream: an unanswered claim falls back to a
    restore, so nothing needs to be kept."""
    return f"podbay.warm.{node_id}.claim"


def warm_kick(node_id: str) -> str:
    """``podbay.warm.<node>.kick``: core-NATS notice that the node's warm targets changed."""
    return f"podbay.warm.{node_id}.kick"


WARM_POOLS_CHANGED = "podbay.warm.pools.changed"
"""Core-NATS notice (payload: template name) that a pool's bounds changed; the warm-pool service listens."""

API_KEY_REVOKED = "podbay.api.keys.revoked"
"""Core-NATS notice (payload: the revoked key's sha256, hex) so every API process drops it from its cache."""


def audit_event(tenant_id: str, action: str) -> str:
    """``podbay.evt.audit.<tenant>.<action>``: one audit row (an API change, a credential use, a denial).
    Dots in ``action`` (``credential.use``) become further subject tokens."""
    return f"podbay.evt.audit.{tenant_id or '_'}.{action}"


def egress_event(sandbox_id: str, event_type: str) -> str:
    """``podbay.evt.egress.<sandbox>.<type>`` (types: denied, credential_used, credential_refused)."""
    return f"podbay.evt.egress.{sandbox_id}.{event_type}"


def migrate_prepare(node_id: str) -> str:
    """``podbay.migrate.<dest>.prepare``: core-NATS request/reply from a source node agent to the destination
    of a live migration (``MigratePrepare``); nothing to keep, a lost request fails the migration."""
    return f"podbay.migrate.{node_id}.prepare"


def migrate_finish(node_id: str) -> str:
    """``podbay.migrate.<dest>.finish``: core-NATS request/reply (``MigrateFinish``)."""
    return f"podbay.migrate.{node_id}.finish"
