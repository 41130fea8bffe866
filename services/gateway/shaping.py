"""What the gateway writes into traffic, and credential selection (pure logic; no mitmproxy, no database).

* :func:`error_body`: the JSON body of a refusal, ``{"error": {"code", "message"}}`` (the API's shape).
* :func:`format_header`: a credential's header value (``format`` with ``{value}`` replaced, once, literally).
* :func:`redact`: every occurrence of a revealed value replaced with ``[podbay:redacted]`` before a
  response reaches the guest.
* :class:`CredentialRow` and :func:`pick_credential`: which stored credential applies to a host and path.
* :func:`over_rate_limit`: the rate-limit arithmetic (uses in the last 60 s against a per-minute limit).
* :class:`TokenBuckets`: a token bucket per key (the DNS server's per-sandbox query rate).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from podbay.contracts.egress import name_matches


__all__ = [
    "MAX_REDACTED",
    "remember_redacted",
    "DENIED_HEADER",
    "REDACTED",
    "error_body",
    "format_header",
    "redact",
    "redact_text",
    "CredentialRow",
    "host_matches",
    "credentials_for_host",
    "pick_credential",
    "over_rate_limit",
    "expired",
    "TokenBuckets",
]

#: Set on every refusal the gateway writes itself, so a client can tell it from the destination's answer.
DENIED_HEADER = "X-Podbay-Denied"
REDACTED = "[podbay:redacted]"


def error_body(code: str, message: str) -> bytes:
    """``{"error": {"code": code, "message": message}}`` as UTF-8 JSON bytes."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def format_header(fmt: str, value: str) -> str:
    """``fmt`` with each ``{value}`` replaced by ``value`` (plain replacement, not ``str.format``: other braces
    in ``fmt`` stay as they are). A value with CR or LF is refused (``ValueError``): it would split headers."""
    if "\r" in value or "\n" in value:
        raise ValueError("a credential value must not contain line breaks")
    return fmt.replace("{value}", value)


#: Values redacted per connection at most (each response is searched for every one of them).
MAX_REDACTED = 256


def remember_redacted(known: set[str], new: Iterable[str], cap: int = MAX_REDACTED) -> None:
    """Add ``new`` to the values redacted on a connection (``known``, changed in place). A workload identity
    token is minted per request, so a long kept-alive connection would collect them without end (and every
    response is searched for each): past ``cap`` the older values are dropped and only ``new`` kept (a
    credential's value comes back with its next use)."""
    fresh = set(new)
    if len(known | fresh) > cap:
        known.clear()
    known.update(fresh)


def redact(data: bytes, secrets: Iterable[str]) -> tuple[bytes, int]:
    """``data`` with every occurrence of each non-empty secret (UTF-8) replaced by :data:`REDACTED`; returns
    the new bytes and the number of replacements. Longer secrets are replaced first, so a secret that
    contains another is not left half visible."""
    count = 0
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        needle = secret.encode()
        n = data.count(needle)
        if n:
            data = data.replace(needle, REDACTED.encode())
            count += n
    return data, count


def redact_text(text: str, secrets: Iterable[str]) -> tuple[str, int]:
    """:func:`redact` for a ``str`` (header values)."""
    count = 0
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        n = text.count(secret)
        if n:
            text = text.replace(secret, REDACTED)
            count += n
    return text, count


@dataclass(frozen=True)
class CredentialRow:
    """The parts of a ``credentials`` row the gateway decides on (the sealed value stays in ``sealed_*``)."""

    id: str
    tenant_id: str
    name: str
    hosts: tuple[str, ...]
    header: str
    format: str
    backend: str
    path_prefix: str | None = None
    expires_at: datetime | None = None
    rate_limit_per_min: int | None = None
    ciphertext: bytes | None = field(default=None, repr=False)
    secret_ref: str | None = None


def host_matches(patterns: Iterable[str], host: str) -> bool:
    """Whether ``host`` matches one of ``patterns`` (exact or ``*.`` wildcard, as in egress rules)."""
    return any(name_matches(p, host) for p in patterns)


def credentials_for_host(rows: Iterable[CredentialRow], host: str) -> list[CredentialRow]:
    """The rows whose ``hosts`` match ``host`` (any path)."""
    return [r for r in rows if host_matches(r.hosts, host)]


def _specificity(row: CredentialRow, host: str) -> tuple[int, int, str]:
    exact = int(any(p.lower().rstrip(".") == host for p in row.hosts))
    return (exact, len(row.path_prefix or ""), row.id)


def pick_credential(rows: Sequence[CredentialRow], host: str, path: str) -> CredentialRow | None:
    """The credential for a request to ``host`` with ``path`` (the request target's path, query removed):
    among rows whose hosts match and whose ``path_prefix`` (if any) starts ``path``, the most specific
    (an exact host before a wildcard, then the longest prefix; ties by id, so the choice is stable)."""
    host = host.lower().rstrip(".")
    path = path.split("?", 1)[0] or "/"
    fits = [r for r in credentials_for_host(rows, host) if not r.path_prefix or path.startswith(r.path_prefix)]
    if not fits:
        return None
    return max(fits, key=lambda r: _specificity(r, host))


def over_rate_limit(uses_last_minute: int, limit_per_min: int | None) -> bool:
    """Whether one more use would exceed ``limit_per_min`` given ``uses_last_minute`` allowed uses in the
    last 60 s (``None`` = unlimited; 0 = never)."""
    return limit_per_min is not None and uses_last_minute >= limit_per_min


def expired(row: CredentialRow, now: datetime) -> bool:
    """Whether ``row`` has an ``expires_at`` at or before ``now`` (both timezone-aware)."""
    return row.expires_at is not None and row.expires_at <= now


class TokenBuckets:
    """A token bucket per key: ``rate_per_s`` tokens a second, at most ``burst`` saved. ``take(key)`` spends
    one and says whether there was one. At most ``max_keys`` buckets are kept: beyond it full ones (keys
    idle long enough to have refilled) are forgotten, as a new bucket starts full anyway."""

    def __init__(self, rate_per_s: float, burst: int, *, max_keys: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.max_keys, self._clock = rate_per_s, float(burst), max_keys, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, monotonic s of last update)

    def take(self, key: str) -> bool:
        now = self._clock()
        tokens, then = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets = {k: (t, u) for k, (t, u) in self._buckets.items()
                             if t + (now - u) * self.rate < self.burst}
        return ok
