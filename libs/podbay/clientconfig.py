"""Where the CLI and SDK find the API: ``PODBAY_API_URL``/``PODBAY_API_KEY``, else the dev config file.

``podbay up`` writes ``$XDG_CONFIG_HOME/podbay/config.json`` (``~/.config/podbay/config.json``, mode 0600)
as ``{"api_url": "http://127.0.0.1:8080", "api_key": "pb_..."}``; ``PODBAY_CONFIG`` overrides the path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

__all__ = ["ClientConfig", "config_path", "load_client_config", "save_client_config"]


class ClientConfig(BaseModel):
    api_url: str
    api_key: str | None = None


def config_path() -> Path:
    """The dev config file path (see module docstring)."""
    if os.environ.get("PODBAY_CONFIG"):
        return Path(os.environ["PODBAY_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "podbay" / "config.json"


def load_client_config(api_url: str | None = None, api_key: str | None = None) -> ClientConfig:
    """Explicit arguments win, then the environment, then the config file, then ``http://127.0.0.1:8080``."""
    file_cfg: dict[str, str] = {}
    path = config_path()
    if path.exists():
        try:
            file_cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            file_cfg = {}
    url = api_url or os.environ.get("PODBAY_API_URL") or file_cfg.get("api_url") or "http://127.0.0.1:8080"
    key = api_key or os.environ.get("PODBAY_API_KEY") or file_cfg.get("api_key")
    return ClientConfig(api_url=url.rstrip("/"), api_key=key)


def save_client_config(cfg: ClientConfig) -> Path:
    """Write the config file with mode 0600; returns its path."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(cfg.model_dump_json(indent=2))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path
