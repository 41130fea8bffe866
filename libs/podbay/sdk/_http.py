"""What the sync and async SDK clients share: configuration, error mapping and the exec stream parser.

Errors, all from ``podbay.errors``:

- an HTTP error answer becomes the class its wire ``code`` names, with the server's message and details;
  an answer without the wire shape (a proxy's page, FastAPI's bare ``{"detail": ...}``) becomes the class
  its status means (400 ``InvalidRequest``, 401 ``Unauthorized``, 404 ``NotFound``, 409 ``Conflict``,
  422 ``Unprocessable``, 502/503 ``Unavailable``, 504 ``Timeout``, else ``PodbayError``);
- a server that does not answer in time becomes ``Timeout``; any other network failure (refused,
  reset, DNS, TLS) becomes ``Unavailable``; both name the URL and are retryable.

A create is sent again, with the same ``Idempotency-Key``, when its connection was refused or broke off
(:func:`retry_delay`); other calls are sent once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from podbay.clientconfig import load_client_config
from podbay.contracts.api import ExecEvent
from podbay.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    PodbayError,
    Timeout,
    Unauthorized,
    Unavailable,
    Unprocessable,
    error_from_wire,
)
from podbay.sdk._calls import Call, ndjson_line

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "USER_AGENT",
    "client_options",
    "request_options",
    "error_for_response",
    "network_errors",
    "retry_delay",
    "BROKEN_CONNECTION",
    "EventReader",
    "UNREACHABLE",
]

#: Default bound, in seconds, on connecting and on waiting for an answer. Above the API's default
#: bound on a waiting create or delete (``PODBAY_CREATE_TIMEOUT_S``, 60 s), so the server answers first.
DEFAULT_TIMEOUT_S = 90.0

USER_AGENT = "podbay-sdk/0.1"

#: How an :class:`~podbay.errors.Unavailable` for a connection that never reached the API begins (the CLI
#: adds a hint to it).
UNREACHABLE = "cannot reach the podbay API"

_BY_STATUS: dict[int, type[PodbayError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    422: Unprocessable,
    502: Unavailable,
    503: Unavailable,
    504: Timeout,
}


def client_options(api_url: str | None, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments for ``httpx.Client``/``httpx.AsyncClient``: base URL, bearer key, timeout.

    The URL and key come from ``podbay.clientconfig.load_client_config`` (arguments, then
    ``PODBAY_API_URL``/``PODBAY_API_KEY``, then the config file ``podbay up`` writes).
    """
    cfg = load_client_config(api_url, api_key)
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    return {"base_url": cfg.api_url, "headers": headers, "timeout": httpx.Timeout(timeout_s)}


def request_options(call: Call[Any], timeout_s: float) -> dict[str, Any]:
    """Keyword arguments for ``client.request``/``client.stream`` carrying out ``call``."""
    opts: dict[str, Any] = {}
    if call.params is not None:
        opts["params"] = dict(call.params)
    if call.json is not None:
        opts["json"] = call.json
    if call.content is not None:
        opts["content"] = call.content
    if call.data is not None:
        opts["data"] = dict(call.data)
    if call.files is not None:
        opts["files"] = dict(call.files)
    if call.long_running:
        opts["timeout"] = httpx.Timeout(timeout_s, read=call.read_timeout_s)
    if call.headers is not None:
        opts["headers"] = dict(call.headers)
    return opts


#: Transport failures after which a repeatable call (``Call.retry_delays_s``) is sent again: the connection
#: was refused (nothing arrived) or broke before the answer (the answer was lost). Timeouts are not among
#: them: the server may still be working on the first request, and the client's bound is spent.
BROKEN_CONNECTION: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def retry_delay(call: Call[Any], attempt: int, exc: Unavailable) -> float | None:
    """Seconds to wait before sending ``call`` again after attempt ``attempt`` (0-based) failed with ``exc``
    (from :func:`network_errors`), or None: raise it."""
    if attempt < len(call.retry_delays_s) and isinstance(exc.__cause__, BROKEN_CONNECTION):
        return call.retry_delays_s[attempt]
    return None


def _message_from_detail(body: Any) -> str | None:
    # FastAPI's own errors (before the app's handlers run) are {"detail": str | [{"loc", "msg"}]}.
    if not isinstance(body, dict) or "detail" not in body:
        return None
    detail = body["detail"]
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = ".".join(str(p) for p in first.get("loc", []))
        return f"{loc}: {first.get('msg', '')}" if loc else str(first.get("msg", ""))
    return str(detail)


def error_for_response(resp: httpx.Response) -> PodbayError:
    """The typed error for an answer with status >= 400 (its body must have been read)."""
    try:
        body: Any = resp.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return error_from_wire(body, resp.status_code)
    cls = _BY_STATUS.get(resp.status_code, PodbayError)
    message = _message_from_detail(body) or (resp.text.strip()[:200] if body is None else str(body)[:200])
    return cls(f"HTTP {resp.status_code} from {resp.request.method} {resp.request.url}: {message}")


@contextmanager
def network_errors(base_url: str) -> Iterator[None]:
    """Turn httpx's transport failures inside the block into ``Timeout``/``Unavailable`` naming the URL.

    A plain context manager, so async code uses it too (it only catches).
    """
    try:
        yield
    except httpx.TimeoutException as exc:
        url = _url_of(exc, base_url)
        if isinstance(exc, httpx.ConnectTimeout):
            raise Unavailable(f"{UNREACHABLE} at {url}: connect timed out") from exc
        raise Timeout(f"the podbay API at {url} did not answer in time ({type(exc).__name__})") from exc
    except (httpx.ConnectError, httpx.ProxyError, httpx.UnsupportedProtocol) as exc:
        url = _url_of(exc, base_url)
        raise Unavailable(f"{UNREACHABLE} at {url}: {exc or type(exc).__name__}") from exc
    except httpx.TransportError as exc:
        # Connected, then the answer broke off (the API, or the node behind it, went away mid-request):
        # "cannot reach" would send the reader to check an address that works.
        url = _url_of(exc, base_url)
        raise Unavailable(f"the connection to the podbay API at {url} broke off mid-request: "
                          f"{exc or type(exc).__name__}") from exc


def _url_of(exc: httpx.TransportError, base_url: str) -> str:
    try:
        return str(exc.request.url)
    except RuntimeError:  # httpx raises when the error carries no request
        return base_url


class EventReader:
    """Parses ``/exec/stream`` NDJSON lines into ``ExecEvent`` and checks that the stream ended well.

    ``feed(line)`` returns the event (``None`` for a blank line) and raises: the typed error an ``error``
    event carries, or ``PodbayError`` for a line that is not an ``ExecEvent``. ``finish()`` raises
    ``Unavailable`` if the stream ended before an ``exit`` event.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self.exited = False

    def feed(self, line: str) -> ExecEvent | None:
        """One line (without its newline) -> its event, or ``None`` for a blank line."""
        event = ndjson_line(ExecEvent, line, lambda exc: f"malformed exec event from {self._url}: {line[:200]!r}")
        if event is None:
            return None
        if event.type == "error":
            err = event.error or {}
            raise error_from_wire({"error": {"code": "internal", "message": "exec failed", **err}}, 500)
        if event.type == "exit":
            self.exited = True
        return event

    def finish(self) -> None:
        """Call at the end of the stream; raises ``Unavailable`` unless an ``exit`` event came."""
        if not self.exited:
            raise Unavailable(f"the exec stream from {self._url} ended before the command's exit")
