"""Where the CLI and SDK find the API: ``PODBAY_API_URL``/``PODBAY_API_KEY``, else the dev config file.

``podbay up`` writes ``$XDG_CONFIG_HOME/podbay/config.json`` (``~/.config/podbay/config.json``, mode 0600)
as ``{"api_url": "http://127.0.0.1:8080", "api_key": "pb_...", "e2b_domain": "e2b.localhost:8443",
"ca_cert": ".../edge-ca.pem", "ca_bundle": ".../edge-trust.pem"}`` (the last three: the stack's TLS edge, for
``podbay env --e2b``); ``PODBAY_CONFIG`` overrides the path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from pydantic import BaseModel

from podbay.errors import InvalidRequest

__all__ = ["ClientConfig", "config_path", "load_client_config", "save_client_config", "stack_edge", "StackEdge"]


class ClientConfig(BaseModel):
    """Where the API is (``api_url``, no trailing slash) and the bearer key to send (``None``: none)."""

    api_url: str
    api_key: str | None = None


class StackEdge(BaseModel):
    """A dev stack's TLS edge as ``podbay up`` recorded it beside the URL and key: its E2B domain
    (``e2b.localhost:8443``), its edge CA (PEM path) and a bundle of the system's roots with that CA (PEM path);
    None when not known."""

    e2b_domain: str | None = None
    ca_cert: str | None = None
    ca_bundle: str | None = None


def config_path() -> Path:
    """The dev config file path (see module docstring)."""
    if os.environ.get("PODBAY_CONFIG"):
        return Path(os.environ["PODBAY_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "podbay" / "config.json"


def _read_file(path: Path) -> dict[str, str]:
    """The config file's ``api_url``/``api_key``; ``{}`` when the file does not exist.

    Raises ``InvalidRequest`` naming the file for one that cannot be read, is not JSON, or is not an object
    of strings: ignoring it would leave a wrong key in force and surface later as a puzzling 401.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read the podbay config file {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the podbay config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"the podbay config file {path} must hold a JSON object, not {type(data).__name__}")
    for key in ("api_url", "api_key", "e2b_domain", "ca_cert", "ca_bundle"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise InvalidRequest(f"the podbay config file {path}: {key} must be a string")
    return data


def load_client_config(api_url: str | None = None, api_key: str | None = None, *,
                       prefer_file: bool = False) -> ClientConfig:
    """Explicit arguments win, then the environment, then the config file, then ``http://127.0.0.1:8080``;
    with ``prefer_file`` the config file comes before the environment (``podbay env``: what ``podbay up``
    saved last, so that ``eval "$(podbay env)"`` replaces a key a restart revoked).

    The file is read only when the URL or the key is still missing (always with ``prefer_file``). Raises
    ``podbay.errors.InvalidRequest`` (naming the file and the problem) for a config file that exists but is
    unreadable or malformed, and for a URL that is not an absolute http(s) URL with a host.
    """
    if prefer_file:
        file_cfg = _read_file(config_path())
        url = api_url or file_cfg.get("api_url") or os.environ.get("PODBAY_API_URL")
        key = api_key or file_cfg.get("api_key") or os.environ.get("PODBAY_API_KEY")
    else:
        url = api_url or os.environ.get("PODBAY_API_URL")
        key = api_key or os.environ.get("PODBAY_API_KEY")
        file_cfg = _read_file(config_path()) if not (url and key) else {}
        url = url or file_cfg.get("api_url")
        key = key or file_cfg.get("api_key")
    return ClientConfig(api_url=_checked_url(url or "http://127.0.0.1:8080").rstrip("/"), api_key=key)


def stack_edge(api_url: str) -> StackEdge | None:
    """The config file's record when it is of the stack at ``api_url`` (with its E2B domain and trust files),
    else None: a URL given by flag or environment for another API must not get this stack's domain. Raises
    like :func:`load_client_config` for a malformed file."""
    data = _read_file(config_path())
    if not data.get("api_url") or str(data["api_url"]).rstrip("/") != api_url.rstrip("/"):
        return None
    return StackEdge(**{k: data.get(k) for k in StackEdge.model_fields})


def _checked_url(url: str) -> str:
    """``url`` when it is an absolute http(s) URL with a host (parsed as httpx parses it), else
    ``InvalidRequest`` saying so: a typo must not surface later as an internal error or a vague failure to
    connect."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise InvalidRequest(f"the API URL {url!r} is not a valid URL ({exc}); expected http(s)://HOST[:PORT]") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidRequest(f"the API URL {url!r} is not an http(s) URL with a host; expected http(s)://HOST[:PORT]")
    return url


def save_client_config(cfg: ClientConfig, edge: StackEdge | None = None) -> Path:
    """Write the config file (``cfg``, and ``edge``'s values that are set) with mode 0600; returns its path."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    data = {**cfg.model_dump(), **(edge.model_dump(exclude_none=True) if edge is not None else {})}
    tmp.write_text(json.dumps(data, indent=2))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path
