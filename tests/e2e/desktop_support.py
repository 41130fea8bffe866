"""What the e2e tests of the ``desktop`` template share (docs/computer-use.md, "The desktop template"): its build
through the SDK, and noVNC's page and WebSocket reached through a sandbox's port URL."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect as ws_connect
from websockets.typing import Subprotocol

from podbay.sdk import Client

__all__ = ["DESKTOP_DISK_MIB", "DESKTOP_MEMORY_MIB", "NOVNC_PORT", "SCREEN", "build_desktop", "novnc_get",
           "novnc_path", "rfb_hello"]

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
#: What the RUN steps need: Debian's mirror (the guest's apt sources), over HTTP.
EGRESS = {"allow": [{"domain": "deb.debian.org", "ports": [80]}]}
#: As the browser template (templates/browser/Dockerfile says why).
DESKTOP_MEMORY_MIB = 1024
#: Room for the desktop's packages on chromium's disk (templates/desktop/Dockerfile).
DESKTOP_DISK_MIB = 3072
#: Xvfb's screen (templates/desktop/start-desktop.sh) and noVNC's guest port.
SCREEN = (1280, 720)
NOVNC_PORT = 6080


def build_desktop(stack: Any) -> str:
    """Build ``chromium`` and then ``desktop`` (FROM chromium) on ``stack`` and return the desktop template's
    name. Their install steps come from the host's build cache (cache_dir/layers) after the first build on a
    machine; each build's events are printed, as a long build's progress."""
    def show(e: Any) -> None:
        print(e.model_dump_json(exclude_none=True), flush=True)

    with Client(stack.api_url, stack.api_key, timeout_s=1800) as c:
        c.build_template("chromium", TEMPLATES / "chromium" / "Dockerfile", TEMPLATES / "chromium", egress=EGRESS,
                         on_event=show)
        t0 = time.monotonic()
        tpl = c.build_template("desktop", TEMPLATES / "desktop" / "Dockerfile", TEMPLATES, egress=EGRESS,
                               ready_port=NOVNC_PORT, memory_mib=DESKTOP_MEMORY_MIB, disk_mib=DESKTOP_DISK_MIB,
                               on_event=show)
        print(f"desktop build: {time.monotonic() - t0:.1f} s", flush=True)  # a figure for the docs, not a check
    assert tpl.memory_mib == DESKTOP_MEMORY_MIB
    return str(tpl.name)


def novnc_path(sid: str) -> str:
    """The path prefix of noVNC's port URL for sandbox ``sid`` (``/ports/{port}-{id}``, docs/ports.md)."""
    return f"/ports/{NOVNC_PORT}-{sid.replace('_', '-')}"


def novnc_get(stack: Any, sid: str, token: str, path: str) -> httpx.Response:
    """``GET`` ``path`` of noVNC's web server in sandbox ``sid``, through its port URL with traffic ``token``."""
    return httpx.get(f"{stack.api_url}{novnc_path(sid)}{path}", headers={"x-podbay-access-token": token},
                     timeout=120)


def rfb_hello(stack: Any, sid: str, token: str) -> bytes:
    """The first message of a WebSocket to websockify through the port URL: the VNC server's RFB version line
    (RFC 6143 §7.1.1), ``b"RFB 003.00x\\n"``, when the VNC server answers."""
    url = stack.api_url.replace("http://", "ws://") + f"{novnc_path(sid)}/websockify"
    with ws_connect(url, additional_headers={"x-podbay-access-token": token}, subprotocols=[Subprotocol("binary")],
                    open_timeout=60) as ws:
        hello = ws.recv(timeout=60)
    assert isinstance(hello, bytes), hello
    return hello
