"""Webhook signing and delivery: a signed POST per lifecycle event to each matching tenant webhook.

Signature (header ``Podbay-Signature``), in the style of Stripe's::

    Podbay-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + raw body bytes)>

The receiver recomputes the HMAC over the timestamp, a dot and the raw body with the secret it got at
creation, compares in constant time, and refuses a timestamp older than a few minutes (replays).
``verify_signature`` does all that. Other headers: ``Podbay-Event-Id`` (dedupe: a delivery may repeat
after a crash), ``Podbay-Event-Seq`` (stream position), ``Podbay-Event-Type``, ``Podbay-Webhook-Id``.

Delivery (``Deliverer``): one durable pull consumer ``webhooks`` on ``PODBAY_EVT`` (``podbay.evt.sandbox.>``)
shared by every process that runs a deliverer, so each event is handed to one of them; events are handled
concurrently (one slow endpoint holds only its own events), each webhook gets up to ``max_attempts`` POSTs
with exponential backoff, and the event is acked once every webhook is done (delivered or given up), so a
crash mid-way redelivers it to another replica (at least once; dedupe by ``Podbay-Event-Id``). The outcome
is recorded on the webhook row (``deliveries``, ``failures``, ``last_*``).

Destinations: unless ``PODBAY_WEBHOOK_ALLOW_PRIVATE`` is on, a webhook may only reach public addresses, so a
tenant cannot make the API POST into its own network (cloud metadata at 169.254.169.254, loopback services,
private ranges). The API refuses such an IP literal or ``localhost`` at registration (``refused_host``), and
the deliverer resolves the host before every attempt and refuses to connect when any address it resolves to
is not public (``refused_addresses``): that covers names pointing inwards and webhooks registered before the
check existed. Such a refusal is a failed delivery without retries, recorded in ``last_error``.

Pinning: the attempt then connects to the address it checked (the first one the name resolved to), never
to the name again, so a name re-pointed between the check and the connection (DNS rebinding) cannot move
the POST inwards. The request keeps the name: its ``Host`` header is the URL's, and for HTTPS the TLS SNI
and the certificate check are for the name (httpx's ``sni_hostname`` request extension), exactly as a
connection by name. With ``PODBAY_WEBHOOK_ALLOW_PRIVATE`` nothing is checked and the URL is used as it is.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import asyncpg
import httpx
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential

from podbay.bus import Bus, consume
from podbay.contracts import subjects
from podbay.egress_ranges import range_kind

__all__ = ["SIGNATURE_HEADER", "sign", "signature_header", "verify_signature", "Deliverer", "DELIVERER_CONSUMER",
           "ALLOW_PRIVATE_SETTING", "refused_host", "refused_addresses", "resolve_host", "pinned_request"]

log = logging.getLogger("podbay.webhooks")

SIGNATURE_HEADER = "Podbay-Signature"
DELIVERER_CONSUMER = "webhooks"

#: The setting that lets webhooks reach non-public addresses; refusals name it.
ALLOW_PRIVATE_SETTING = "PODBAY_WEBHOOK_ALLOW_PRIVATE"

#: Resolves ``(host, port)`` to the IP addresses a connection could go to (see :func:`resolve_host`).
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Digits, hex and dots only: what inet_aton (and so the system resolver) may read as an IPv4 address in a
# legacy spelling (``2130706433``, ``0x7f.1``, ``127.1``) that ipaddress does not parse.
_LEGACY_IPV4 = re.compile(r"^[0-9a-fA-FxX.]+$")


def _kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    for attr, kind in (("is_unspecified", "an unspecified"), ("is_loopback", "a loopback"),
                       ("is_link_local", "a link-local"), ("is_multicast", "a multicast"),
                       ("is_private", "a private"), ("is_reserved", "a reserved")):
        if getattr(ip, attr):
            return kind
    return "a non-public"


def _as_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is not part of it
    except ValueError:
        pass
    if _LEGACY_IPV4.match(host) and any(c.isdigit() for c in host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # ipaddress counts multicast ranges as global; a webhook has no business there either. The egress
    # gateway's table adds what ipaddress misses, e.g. NAT64 (64:ff9b::a00:1) of a private IPv4 address.
    return ip.is_global and not ip.is_multicast and range_kind(ip) is None


def refused_host(host: str) -> str | None:
    """Why a webhook may not go to ``host`` when non-public destinations are not allowed, else None.

    ``host`` is a URL's host as ``httpx.URL(url).host`` gives it: a name or an IP literal, IPv6 without
    brackets. Refused: ``localhost`` and names under ``.localhost``, and IP literals (legacy IPv4 spellings
    such as ``2130706433`` included) that are not globally routable: loopback, link-local (169.254.169.254),
    private, unique-local, shared (100.64.0.0/10), unspecified, multicast, reserved. Other names pass; they are
    checked when a delivery resolves them (:func:`refused_addresses`). The reason names the host and the kind
    of address, e.g. ``"169.254.169.254 is a link-local address"``. Never raises.
    """
    name = host.strip().rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return f"{host} is a loopback name"
    ip = _as_ip(name)
    if ip is not None and not _public(ip):
        return f"{host} is {_kind(ip)} address"
    return None


def refused_addresses(host: str, addresses: Iterable[str]) -> str | None:
    """Why a delivery may not connect to ``host`` resolved to ``addresses`` (IP strings), else None.

    Refused when any address is not globally routable (see :func:`refused_host`); one bad address is enough,
    since the connection may use any of them. The reason reads ``"hooks.example.com resolves to 10.0.0.5, a
    private address"``; for an IP literal host, as :func:`refused_host`'s. Never raises.
    """
    for addr in addresses:
        ip = _as_ip(addr)
        if ip is None or not _public(ip):
            kind = "an unparsable" if ip is None else _kind(ip)
            if _as_ip(host) is not None:
                return f"{host} is {kind} address"
            return f"{host} resolves to {addr}, {kind} address"
    return None


async def resolve_host(host: str, port: int) -> list[str]:
    """The IP addresses ``host`` resolves to for a TCP connection to ``port`` (the event loop's getaddrinfo,
    as the HTTP client's own connection does), without duplicates. Raises ``OSError`` (``socket.gaierror``)
    when the name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def pinned_request(url: str, address: str) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    """What a POST to ``url`` must be sent as to connect to ``address`` (an IP string the URL's host was
    checked to resolve to) while the receiver sees the name: ``(URL with the address as host, the Host
    header of the original URL, request extensions)``; for HTTPS the extensions hold ``sni_hostname`` = the
    name, which httpcore uses for SNI and for the certificate's host name check. An IP-literal host is left
    as it is. Raises ``httpx.InvalidURL``."""
    parsed = httpx.URL(url)
    if _as_ip(parsed.host) is not None and str(_as_ip(parsed.host)) == address:
        return parsed, {}, {}
    pinned = parsed.copy_with(host=address)
    extensions: dict[str, Any] = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
    return pinned, {"Host": parsed.netloc.decode("ascii")}, extensions


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """Hex HMAC-SHA256 of ``"<timestamp>." + body`` under ``secret``."""
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(secret: str, body: bytes, *, timestamp: int | None = None) -> str:
    """The ``Podbay-Signature`` value for ``body``: ``t=<unix s>,v1=<hex>``."""
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={sign(secret, t, body)}"


def verify_signature(secret: str, header: str, body: bytes, *, tolerance_s: float = 300.0,
                     now: float | None = None) -> bool:
    """True when ``header`` signs ``body`` under ``secret`` and its timestamp is within ``tolerance_s``."""
    parts: dict[str, list[str]] = {}
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if sep:
            parts.setdefault(key, []).append(value)
    try:
        t = int(parts["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    want = sign(secret, t, body)
    return any(hmac.compare_digest(want, v) for v in parts.get("v1", []))


class _Retryable(Exception):
    """A delivery attempt that may succeed later (network error, 408, 429, 5xx)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


class _Refused(Exception):
    """A destination the deliverer will not connect to (not a public address); not retried."""


class Deliverer:
    """Delivers events to webhooks; ``run(stop)`` is its background task (see the module docstring).

    ``max_attempts`` POSTs per webhook and event, waiting ``backoff_s`` × 2^n (at most ``backoff_max_s``)
    between them; each POST is bounded by ``timeout_s``. Unless ``allow_private``, each attempt first resolves
    the URL's host with ``resolver`` (default :func:`resolve_host`, bounded by ``timeout_s``) and refuses a
    non-public address: no request is made, no retry follows, and the failure's reason is ``last_error``.
    """

    def __init__(self, pool: asyncpg.Pool, bus: Bus, *, max_attempts: int = 5, backoff_s: float = 1.0,
                 backoff_max_s: float = 60.0, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None, allow_private: bool = False,
                 resolver: Resolver | None = None) -> None:
        self._pool = pool
        self._bus = bus
        self._allow_private = allow_private
        self._resolver = resolver or resolve_host
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._http = httpx.AsyncClient(timeout=timeout_s, transport=transport, follow_redirects=False,
                                       headers={"User-Agent": "podbay-webhooks/0.1"})
        # The longest one event can take, so JetStream does not redeliver it while we are still at it.
        self._ack_wait_s = max_attempts * (timeout_s + backoff_max_s) + 30.0

    async def _subscribe(self) -> Any:
        cfg = ConsumerConfig(
            durable_name=DELIVERER_CONSUMER,
            filter_subject="podbay.evt.sandbox.>",
            ack_policy=AckPolicy.EXPLICIT,
            # A new installation delivers from now on, not the stream's week of history.
            deliver_policy=DeliverPolicy.NEW,
            ack_wait=self._ack_wait_s,
            max_deliver=5,
            max_ack_pending=1000,
        )
        try:
            await self._bus.js.add_consumer(subjects.EVT_STREAM, cfg)
        except Exception as exc:  # exists already (another replica made it), same config: bind to it
            log.debug("webhooks consumer: %s", exc)
        return await self._bus.js.pull_subscribe_bind(durable=DELIVERER_CONSUMER, stream=subjects.EVT_STREAM)

    async def run(self, stop: asyncio.Event) -> None:
        """Consume events until ``stop``; events in flight get a short grace, the rest are redelivered."""
        sub = await self._subscribe()
        try:
            await consume(sub, self.handle, stop, finish_timeout_s=5.0)
        finally:
            await self._http.aclose()

    async def handle(self, msg: Msg) -> None:
        """Deliver one event to its tenant's matching webhooks, then ack it."""
        try:
            payload = json.loads(msg.data)
            tenant_id = payload.get("tenant_id")
            event_type = payload.get("type")
        except (ValueError, AttributeError):
            await msg.term()
            return
        seq = msg.metadata.sequence.stream
        if not tenant_id:
            await msg.ack()
            return
        try:
            hooks = await self._pool.fetch(
                "SELECT id, url, secret FROM webhooks WHERE tenant_id = $1 AND deleted_at IS NULL"
                " AND (cardinality(types) = 0 OR $2 = ANY(types))", tenant_id, event_type)
        except Exception as exc:  # PostgreSQL away: let JetStream redeliver later
            log.warning("webhooks: cannot read webhooks (event %s redelivered later): %s", seq, exc)
            await msg.nak(delay=5)
            return
        if hooks:
            body = json.dumps({**payload, "seq": seq}, separators=(",", ":")).encode()
            await asyncio.gather(*(self._deliver(h, body, payload, seq) for h in hooks))
        await msg.ack()

    async def _check_destination(self, url: str) -> str:
        """The address to connect to for ``url``: the first its host resolves to, every one of them checked.
        Raise ``_Refused`` when the host is or resolves to a non-public address, ``_Retryable`` when it does
        not resolve (DNS may be back later)."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise _Refused(f"invalid URL: {exc}") from exc
        host = parsed.host
        reason = refused_host(host)
        if reason is None:
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
            try:
                addresses = await asyncio.wait_for(self._resolver(host, port), timeout=self._timeout_s)
            except OSError as exc:  # socket.gaierror, and TimeoutError from wait_for
                raise _Retryable(f"cannot resolve {host}: {type(exc).__name__}: {exc}"[:300], None) from exc
            reason = refused_addresses(host, addresses)
            if reason is None and not addresses:
                raise _Retryable(f"cannot resolve {host}: no address", None)
        else:
            addresses = []
        if reason is not None:
            raise _Refused(f"refused: {reason}, not a public one (set {ALLOW_PRIVATE_SETTING}=1 on the API to "
                           "allow non-public destinations)")
        return addresses[0]

    async def _deliver(self, hook: asyncpg.Record, body: bytes, payload: dict[str, Any], seq: int) -> None:
        attempts = 0
        status: int | None = None
        error: str | None = None

        async def attempt() -> int:
            nonlocal attempts
            attempts += 1
            headers = {"Content-Type": "application/json",
                       SIGNATURE_HEADER: signature_header(hook["secret"], body),
                       "Podbay-Event-Id": str(payload.get("id", "")), "Podbay-Event-Seq": str(seq),
                       "Podbay-Event-Type": str(payload.get("type", "")), "Podbay-Webhook-Id": hook["id"]}
            url: str | httpx.URL = hook["url"]
            extensions: dict[str, Any] = {}
            if not self._allow_private:
                # Before every attempt (a name may be re-pointed between attempts), and the connection goes to
                # the very address checked: no second lookup by the HTTP client.
                address = await self._check_destination(hook["url"])
                url, host_header, extensions = pinned_request(hook["url"], address)
                headers.update(host_header)
            try:
                resp = await self._http.post(url, content=body, headers=headers, extensions=extensions)
            except httpx.HTTPError as exc:
                raise _Retryable(f"{type(exc).__name__}: {exc}"[:300], None) from exc
            if resp.status_code in (408, 429) or resp.status_code >= 500:
                raise _Retryable(f"HTTP {resp.status_code}", resp.status_code)
            return resp.status_code

        try:
            async for a in AsyncRetrying(stop=stop_after_attempt(self._max_attempts),
                                         wait=wait_exponential(multiplier=self._backoff_s, max=self._backoff_max_s),
                                         retry=retry_if_exception_type(_Retryable), reraise=True):
                with a:
                    status = await attempt()
        except _Retryable as exc:
            status, error = exc.status, str(exc)
        except _Refused as exc:
            error = str(exc)
        except RetryError as exc:  # not raised with reraise=True; kept for safety
            error = str(exc)
        ok = status is not None and 200 <= status < 300
        if not ok and error is None:
            error = f"HTTP {status}"  # a 4xx other than 408/429: the receiver refused it, no retry
        try:
            await self._pool.execute(
                "UPDATE webhooks SET deliveries = deliveries + $2, failures = failures + $3, last_status = $4,"
                " last_attempts = $5, last_error = $6, last_event_seq = $7, last_attempt_at = now() WHERE id = $1",
                hook["id"], int(ok), int(not ok), status, attempts, None if ok else error, seq)
        except Exception as exc:
            log.warning("webhooks: could not record delivery state of %s: %s", hook["id"], exc)
        if not ok:
            log.info("webhook %s gave up on event %s after %d attempts: %s", hook["id"], seq, attempts, error)
