"""Leader leases in a JetStream KV bucket: one replica of a service runs a singleton loop, a standby takes over.

The bucket ``podbay_leases`` (:data:`podbay.contracts.subjects.LEASES_KV`) has a TTL (``lease_ttl_s``); the
key is the loop's name (``warmpool``), the value names the holder. A replica

- **acquires** with ``create`` (succeeds only when the key is absent: never held, expired by the TTL, or
  deleted by a holder that stepped down);
- **renews** with ``update(last=revision)`` every third of the TTL: the write succeeds only if nobody wrote the
  key since our last write, so a holder that lost the lease (it expired and another took it) finds out on its
  next renewal and steps down instead of overwriting the new holder;
- **trusts** its lease only until ``t + ttl - margin``, where ``t`` is the local time just *before* its last
  successful write: the server's TTL runs from when it stored that write, which is later, so the holder stops
  believing before any standby can acquire. Two holders at once would need a clock running more than
  ``margin`` fast over one TTL.
- **releases** on a clean stop with ``delete(last=revision)``, so a standby takes over at its next try instead
  of after the TTL.

Errors: NATS trouble while renewing counts as "not held" (the caller pauses its work); nothing is raised
from :meth:`Lease.tick`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from podbay.bus import Bus
from podbay.contracts import subjects

__all__ = ["Lease", "leases_kv"]

log = logging.getLogger("podbay.lease")


async def leases_kv(bus: Bus, ttl_s: float) -> KeyValue:
    """The ``podbay_leases`` bucket, created with a TTL of ``ttl_s`` seconds if missing (an existing bucket
    keeps its TTL: every replica must be configured alike)."""
    try:
        return await bus.js.key_value(subjects.LEASES_KV)
    except NotFoundError:
        try:
            return await bus.js.create_key_value(KeyValueConfig(bucket=subjects.LEASES_KV, ttl=ttl_s, history=1,
                                                                      replicas=bus.replicas))
        except BadRequestError:  # another replica created it meanwhile
            return await bus.js.key_value(subjects.LEASES_KV)


class Lease:
    """A lease on ``name`` for this process (``holder``: default ``<hostname>:<pid>``).

    Call :meth:`tick` at least every ``ttl_s / 3`` seconds; do the singleton work only while :attr:`held`.
    """

    def __init__(self, bus: Bus, name: str, *, ttl_s: float, holder: str | None = None,
                 margin_s: float | None = None) -> None:
        self._bus = bus
        self.name = name
        self.ttl_s = ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self._margin_s = margin_s if margin_s is not None else min(1.0, ttl_s / 4)
        self._kv: KeyValue | None = None
        self._revision: int | None = None
        self._valid_until = 0.0

    @property
    def renew_every_s(self) -> float:
        """How often to call :meth:`tick`, seconds."""
        return self.ttl_s / 3

    @property
    def held(self) -> bool:
        """Whether this process holds the lease now (and may do the singleton work)."""
        return self._revision is not None and time.monotonic() < self._valid_until

    async def tick(self) -> bool:
        """Renew the lease if held, else try to acquire it; returns :attr:`held` afterwards."""
        started = time.monotonic()
        try:
            if self._kv is None:
                self._kv = await leases_kv(self._bus, self.ttl_s)
            value = json.dumps({"holder": self.holder}).encode()
            if self._revision is not None:
                try:
                    self._revision = await self._kv.update(self.name, value, last=self._revision)
                except KeyWrongLastSequenceError:
                    log.warning("lease %s: lost (another replica holds it now)", self.name)
                    self._revision = None
            if self._revision is None:
                try:
                    self._revision = await self._kv.create(self.name, value)
                    log.info("lease %s: acquired by %s", self.name, self.holder)
                except KeyWrongLastSequenceError:
                    return False  # held by another replica
            self._valid_until = started + self.ttl_s - self._margin_s
        except Exception as exc:  # NATS down or slow: stop trusting the lease once it would have expired
            log.warning("lease %s: could not renew: %s", self.name, exc)
        return self.held

    async def release(self) -> None:
        """Give the lease up (a standby may take it at once); harmless when not held."""
        rev, self._revision = self._revision, None
        if rev is None or self._kv is None:
            return
        try:
            await self._kv.delete(self.name, last=rev)
            log.info("lease %s: released by %s", self.name, self.holder)
        except Exception as exc:  # lost meanwhile, or NATS gone: the TTL frees it
            log.debug("lease %s: release failed: %s", self.name, exc)
