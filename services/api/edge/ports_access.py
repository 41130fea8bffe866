"""Who may reach a guest port, and how a port's address is spelled (docs/DESIGN.md §8, ports).

Addresses:

* host form ``{port}-{label}.{ports_domain}``, where ``label`` is the sandbox id with ``-`` for ``_``
  (:func:`host_label`: host labels with ``_`` are refused by wildcard certificates and some clients; an id
  is ``<prefix>_<hex>``, so the first ``-`` of a label is its ``_``). A label spelled with ``_`` is accepted too.
* path form ``/ports/{port}-{label}/<path>`` on the API, for places without wildcard DNS.
* E2B's host ``{port}-{sandboxID}.{e2b_domain}``, and its ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` headers.

Access to a private port (the default) takes one of: the sandbox's traffic token (:func:`traffic_token`, an
HMAC of its id with the internal token, so nothing is stored) in ``X-Podbay-Access-Token``; the cookie a
``?podbay_token=`` link was exchanged for (:data:`COOKIE`); or an API key of the sandbox's tenant
(``Authorization: Bearer``). Through E2B's host form, E2B's rule: ``e2b-traffic-access-token`` when the
sandbox was created with ``network.allowPublicTraffic = false`` (:func:`e2b_traffic_token`), open otherwise.
A token is bound to one sandbox id, so one tenant's token never opens another tenant's sandbox.

Public ports are rate-limited across API replicas (:mod:`podbay.ratelimit`, used by the edge). Metrics per
sandbox and port:
:data:`PORT_REQUESTS`, :data:`PORT_BYTES`, :data:`PORT_OPEN`.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import re

from prometheus_client import Counter, Gauge

from podbay.edge_tls import domain_host

__all__ = ["e2b_closed_port", "host_label", "sandbox_from_label", "parse_host", "parse_path", "traffic_token", "e2b_traffic_token",
           "token_ok", "COOKIE", "TOKEN_HEADER", "TOKEN_QUERY", "PATH_PREFIX", "E2B_TOKEN_HEADER",
           "PORT_REQUESTS", "PORT_BYTES", "PORT_OPEN", "port_url"]

TOKEN_HEADER = "x-podbay-access-token"
TOKEN_QUERY = "podbay_token"
COOKIE = "podbay_port_token"
E2B_TOKEN_HEADER = "e2b-traffic-access-token"
PATH_PREFIX = "/ports/"

_LABEL = r"(?P<port>\d{1,5})-(?P<label>[A-Za-z0-9][A-Za-z0-9_-]{0,126})"
_HOST = re.compile(rf"^{_LABEL}\.(?P<domain>[A-Za-z0-9.-]+?)\.?(:\d{{1,5}})?$")
_PATH = re.compile(rf"^{re.escape(PATH_PREFIX)}{_LABEL}(?P<rest>/.*)?$")

# Labelled by how the port was addressed (mode: podbay host, path, e2b) and the guest port, never by sandbox or
# tenant: ids in labels would leak who runs what to every reader of /metrics, and grow series without bound.
PORT_REQUESTS = Counter("podbay_port_requests_total", "Requests (and WebSocket sessions) through the port edge, "
                        "by addressing mode, guest port, access (private, public) and status class.",
                        ["mode", "port", "access", "status"])
PORT_BYTES = Counter("podbay_port_bytes_total", "Body bytes through the port edge, by addressing mode, guest "
                     "port and direction (in: to the guest, out: to the client).", ["mode", "port", "direction"])
PORT_OPEN = Gauge("podbay_port_open_connections", "Requests and WebSockets open through the port edge now, by "
                  "addressing mode and guest port.", ["mode", "port"])


def host_label(sandbox_id: str) -> str:
    """The host-label spelling of a sandbox id: ``sbx_3f2a`` -> ``sbx-3f2a``."""
    return sandbox_id.replace("_", "-")


def sandbox_from_label(label: str) -> str:
    """The sandbox id a host label names (the inverse of :func:`host_label`; ``_`` spellings pass as they are)."""
    return label if "_" in label else label.replace("-", "_", 1)


def _port(text: str) -> int | None:
    port = int(text)
    return port if 0 < port <= 65535 else None


def parse_host(host: str, domain: str | None) -> tuple[int, str] | None:
    """``(port, sandbox_id)`` of a ``{port}-{label}.{domain}[:port]`` host; None for any other host. A ``domain``
    that carries a port (``e2b.localhost:8443``, where the TLS edge is not on 443) is compared by its name."""
    if not domain:
        return None
    m = _HOST.match(host)
    if m is None or m.group("domain").lower() != domain_host(domain).rstrip("."):
        return None
    port = _port(m.group("port"))
    return None if port is None else (port, sandbox_from_label(m.group("label")))


def parse_path(path: str) -> tuple[int, str, str] | None:
    """``(port, sandbox_id, rest)`` of a path-form request ``/ports/{port}-{label}/<rest>`` (``rest`` starts
    with ``/``; ``""`` when the path stops after the label, which the edge redirects to add the slash)."""
    m = _PATH.match(path)
    if m is None:
        return None
    port = _port(m.group("port"))
    return None if port is None else (port, sandbox_from_label(m.group("label")), m.group("rest") or "")


def traffic_token(secret: str, sandbox_id: str) -> str:
    """The sandbox's traffic token (hex HMAC-SHA256 of its id): opens its private ports."""
    return hmac.new(secret.encode(), f"ports:{sandbox_id}".encode(), hashlib.sha256).hexdigest()


def e2b_traffic_token(secret: str, sandbox_id: str) -> str:
    """E2B's ``trafficAccessToken`` of a sandbox created with ``allowPublicTraffic: false``."""
    return hmac.new(secret.encode(), f"e2b-traffic:{sandbox_id}".encode(), hashlib.sha256).hexdigest()


def token_ok(given: str | None, expected: str) -> bool:
    """Constant-time comparison; an absent token is never good."""
    if not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def port_url(sandbox_id: str, port: int, *, scheme: str, domain: str, api_host: str) -> tuple[str, str]:
    """``(host-form URL, path-form URL)`` of a guest port, for an API reached at ``api_host`` (``host[:port]``,
    as the client sent it)."""
    _, sep, api_port = api_host.rpartition(":")
    if not sep or not api_port.isdigit():  # no port, or an IPv6 literal without one
        api_port = ""
    suffix = f":{api_port}" if api_port else ""
    label = f"{port}-{host_label(sandbox_id)}"
    return f"{scheme}://{label}.{domain}{suffix}/", f"{scheme}://{api_host}{PATH_PREFIX}{label}/"


#: E2B's proxy tells a browser from a program by these words in its User-Agent.
_BROWSER_WORDS = ("mozilla", "chrome", "safari", "firefox", "edge", "opera", "msie")


def e2b_closed_port(sandbox_id: str, port: int, user_agent: str) -> tuple[bytes, bytes]:
    """E2B's answer (status 502) for a port of a running sandbox that nothing listens on, as its proxy gives
    it -> (content type, body): for a browser, an HTML page titled "Closed Port Error"; for anything else,
    JSON ``{"message": "The sandbox is running but port is not open", "sandboxId", "port", "code": 502}``."""
    if any(w in user_agent.lower() for w in _BROWSER_WORDS):
        sid = html.escape(sandbox_id)
        page = ("<!doctype html><html><head><meta charset=utf-8><title>Closed Port Error</title></head><body>"
                f"<h1>Closed Port Error</h1><p>The sandbox {sid} is running but there's no service running on "
                f"port {port}.</p></body></html>")
        return b"text/html; charset=utf-8", page.encode()
    body = {"message": "The sandbox is running but port is not open", "sandboxId": sandbox_id, "port": port,
            "code": 502}
    return b"application/json; charset=utf-8", json.dumps(body).encode()
