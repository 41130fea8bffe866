"""The envd routes (E2B's in-sandbox API) a client may reach, and the one parser of a client's envd path.

The API's envd proxy (services/api/edge/envd.py) and the node's grant check (services/nodeagent/dataplane/grant_check.py)
both take a path from the wire. Neither concatenates it into a URL: :func:`parse_envd_path` reads the raw
bytes once, refuses every spelling that could mean something else after one more decoding or normalisation
(percent signs at all, backslashes, empty and dot segments, control and non-ASCII bytes), then looks the path
up in :data:`ENVD_ROUTES`, the routes services/nodeagent/envd serves. What goes upstream is the allow-listed
route's own constant path, never the client's string.

    /health, /files                                                     plain HTTP
    /process.Process/{List,Connect,Start,Update,StreamInput,SendInput,SendSignal,CloseStdin}
    /filesystem.Filesystem/{Stat,MakeDir,Move,ListDir,Remove,WatchDir,CreateWatcher,GetWatcherEvents,RemoveWatcher}

Errors: :class:`EnvdPathRefused` (a ``podbay.errors.InvalidRequest``, 400) saying why.
"""

from __future__ import annotations

import re

from podbay.errors import InvalidRequest

__all__ = ["ENVD_ROUTES", "SANDBOX_ID", "EnvdPathRefused", "parse_envd_path", "check_sandbox_id"]

_PROCESS = ("List", "Connect", "Start", "Update", "StreamInput", "SendInput", "SendSignal", "CloseStdin")
_FILESYSTEM = ("Stat", "MakeDir", "Move", "ListDir", "Remove", "WatchDir", "CreateWatcher", "GetWatcherEvents",
               "RemoveWatcher")
#: Every envd path the node serves (services/nodeagent/envd/__init__.py and its .proto files).
ENVD_ROUTES: frozenset[str] = frozenset(
    ["/health", "/files"] + [f"/process.Process/{m}" for m in _PROCESS]
    + [f"/filesystem.Filesystem/{m}" for m in _FILESYSTEM])
_BY_PATH = {r: r for r in ENVD_ROUTES}
#: A sandbox id as the API makes them (``sbx_`` + hex) and E2B SDKs echo them: letters, digits, ``_``, ``-``.
SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_PATH = 256


class EnvdPathRefused(InvalidRequest):
    """400: an envd path that is not, byte for byte, one of :data:`ENVD_ROUTES`."""


def check_sandbox_id(value: str) -> str:
    """``value`` if it matches :data:`SANDBOX_ID` exactly; :class:`EnvdPathRefused` otherwise."""
    if not SANDBOX_ID.fullmatch(value):
        raise EnvdPathRefused("malformed sandbox id")
    return value


def parse_envd_path(raw: bytes | str) -> str:
    """The allow-listed envd route (a constant of :data:`ENVD_ROUTES`) that the raw request path ``raw``
    (bytes as on the wire, no query) names; :class:`EnvdPathRefused` for anything else. Refused before
    the lookup, each with its own message: non-ASCII or control bytes (NUL included), ``%`` (no envd route has
    one, so any percent-encoding, single or double, is an attempt to hide something), ``\\``, a path that does
    not start with ``/``, ``//`` and ``.``/``..`` segments."""
    if isinstance(raw, str):
        try:
            raw = raw.encode("ascii")
        except UnicodeEncodeError as exc:
            raise EnvdPathRefused("the envd path has non-ASCII characters") from exc
    if len(raw) > _MAX_PATH:
        raise EnvdPathRefused("the envd path is too long")
    if any(b < 0x21 or b > 0x7E for b in raw):
        raise EnvdPathRefused("the envd path has control, space or non-ASCII bytes")
    if b"%" in raw:
        raise EnvdPathRefused("percent-encoding is not allowed in an envd path")
    if b"\\" in raw:
        raise EnvdPathRefused("backslashes are not allowed in an envd path")
    if not raw.startswith(b"/"):
        raise EnvdPathRefused("the envd path must start with /")
    segments = raw[1:].split(b"/")
    if any(s in (b"", b".", b"..") for s in segments):
        raise EnvdPathRefused("empty or dot segments are not allowed in an envd path")
    text = raw.decode("ascii")
    route = _BY_PATH.get(text)
    if route is None:
        raise EnvdPathRefused(f"not an envd route: {text[:80]}")
    return route  # the allow-list's own string, not the client's
