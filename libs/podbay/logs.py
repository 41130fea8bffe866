"""Log lines of every podbay process: readable text for development, one JSON object per line in production.

``PODBAY_LOG_FORMAT=text`` (default) writes ``HH:MM:SS LEVEL service logger: message``; ``json`` writes one
object per line with the keys ``time`` (RFC 3339 UTC, milliseconds), ``level``, ``service``, ``logger``,
``message``, then ``sandbox_id``, ``operation_id`` and ``node_id`` when known, and ``exc`` (the traceback) when
an exception is logged. The ids come from :mod:`contextvars`: code that handles a command or a request for a
sandbox binds them once (:func:`bind_log_context` or ``with log_context(...)``), and every line logged while
handling it, in that task and the tasks it starts, carries them.

Secrets never reach a log line: the values of the secret settings (internal token, credential key, OpenBao
token, S3 secret key) are replaced by ``[redacted]`` in every message and traceback, and so is the token of
any ``Bearer`` authorization text.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

__all__ = ["CONTEXT_KEYS", "bind_log_context", "bind_from_path", "bind_from_message", "log_context", "current_log_context", "JsonFormatter",
           "TextFormatter", "RedactingFilter", "configure_logging"]

CONTEXT_KEYS = ("sandbox_id", "operation_id", "node_id")
_VARS: dict[str, contextvars.ContextVar[str | None]] = {
    k: contextvars.ContextVar(f"podbay_log_{k}", default=None) for k in CONTEXT_KEYS}
_PATH_IDS = (("sandbox_id", re.compile(r"/sandboxes/([A-Za-z0-9_.-]+)")),
             ("operation_id", re.compile(r"/operations/([A-Za-z0-9_.-]+)")))
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
REDACTED = "[redacted]"


def bind_log_context(**ids: str | None) -> None:
    """Set ``sandbox_id`` / ``operation_id`` / ``node_id`` for the rest of the current task (and tasks it starts).
    ``None`` values are ignored; unknown keys raise ``KeyError``."""
    for key, value in ids.items():
        if value is not None:
            _VARS[key].set(str(value))


def bind_from_path(path: str) -> None:
    """Bind ``sandbox_id`` / ``operation_id`` found in a request path (``/v1/sandboxes/{id}/...``,
    ``/v1/operations/{id}``) for the rest of the request's task."""
    for key, pattern in _PATH_IDS:
        if m := pattern.search(path):
            _VARS[key].set(m.group(1))


def bind_from_message(data: bytes) -> None:
    """Bind ``sandbox_id`` / ``operation_id`` from a JSON command's top-level keys (missing or not JSON: none)."""
    try:
        body = json.loads(data)
    except ValueError:
        return
    if isinstance(body, dict):
        bind_log_context(**{k: v for k in ("sandbox_id", "operation_id")
                            if isinstance(v := body.get(k), str)})


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Bind ids for the ``with`` block only."""
    tokens = [(_VARS[k], _VARS[k].set(str(v))) for k, v in ids.items() if v is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def current_log_context() -> dict[str, str]:
    """The ids bound in the current context."""
    return {k: v for k, var in _VARS.items() if (v := var.get()) is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``static`` fields (e.g. a node-local service's ``node_id``) fill ids that the
    context does not bind."""

    def __init__(self, service: str, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self.service = service
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in self.static.items() if k in CONTEXT_KEYS})
        out.update(current_log_context())
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL service logger: message`` (the development format)."""

    def __init__(self, service: str) -> None:
        super().__init__("%(asctime)s %(levelname)-5s " + service + " %(name)s: %(message)s", "%H:%M:%S")


class RedactingFilter(logging.Filter):
    """Replaces secret values and bearer tokens in a record's message and exception text before formatting."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        # Short values would redact ordinary words; the secrets podbay handles are long random strings.
        self.secrets = sorted({s for s in secrets if s and len(s) >= 8}, key=len, reverse=True)

    def _clean(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, REDACTED)
        return _BEARER.sub(r"\1" + REDACTED, text)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = self._clean(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._clean(record.exc_text)
            record.exc_info = None  # the formatter uses the cleaned text
        return True


def configure_logging(service: str, *, level: str = "INFO", fmt: Literal["text", "json"] = "text",
                      static: dict[str, str] | None = None, secrets: Iterable[str] = (),
                      stream: Any = None) -> logging.Handler:
    """Replace the root logger's handlers with one on ``stream`` (stderr) in ``fmt``; returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(service, static) if fmt == "json" else TextFormatter(service))
    handler.addFilter(RedactingFilter(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return handler
