"""The ``desktop`` template with real VMs (docs/computer-use.md, "The desktop template").

Built once per module from ``templates/desktop/Dockerfile`` with 1024 MiB, FROM ``templates/chromium/Dockerfile``
(whose install, and after the first build on a machine the desktop's own, come from the host's build cache,
cache_dir/layers). One sandbox serves the tests: its snapshot holds Xvfb, matchbox, Chromium on the display
(CDP on guest port 9222), x11vnc and websockify with noVNC on guest port 6080. Checked: the X display has the
desktop's size and xdotool reaches it; noVNC's page is served through the sandbox's port URL with its traffic
token; a WebSocket through the port URL reaches the VNC server (the RFB handshake's version line); a
screenshot through the computer API is the whole X screen (the desktop's size while the page's viewport is
emulated smaller); last, a tab's script state set over CDP is there after the sandbox is suspended to object
storage and woken, and noVNC answers again.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, sh, until
from websockets.sync.client import connect as ws_connect
from websockets.typing import Subprotocol

from podbay.sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

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


@pytest.fixture(scope="module")
def desktop_template(stack: Any) -> str:
    def show(e: Any) -> None:
        print(e.model_dump_json(exclude_none=True), flush=True)

    with Client(stack.api_url, stack.api_key, timeout_s=1800) as c:
        c.build_template("chromium", TEMPLATES / "chromium" / "Dockerfile", TEMPLATES / "chromium", egress=EGRESS,
                         on_event=show)
        t0 = time.monotonic()
        tpl = c.build_template("desktop", TEMPLATES / "desktop" / "Dockerfile", TEMPLATES, egress=EGRESS,
                               ready_port=NOVNC_PORT, memory_mib=DESKTOP_MEMORY_MIB, disk_mib=DESKTOP_DISK_MIB, on_event=show)
        print(f"desktop build: {time.monotonic() - t0:.1f} s", flush=True)  # a figure for the docs, not a check
    assert tpl.memory_mib == DESKTOP_MEMORY_MIB
    return str(tpl.name)


@pytest.fixture(scope="module")
def desktop(stack: Any, desktop_template: str) -> Iterator[tuple[str, str]]:
    """(sandbox id, its traffic token)."""
    with api_client(stack) as h:
        t0 = time.monotonic()
        r = h.post("/v1/sandboxes", json={"template": desktop_template})
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        try:
            r = h.get(f"/v1/sandboxes/{sid}/ports/{NOVNC_PORT}/url")
            assert r.status_code == 200, r.text
            token = str(r.json()["token"])
            until("noVNC answers through the port URL", lambda: _get(stack, sid, token, "/vnc.html").status_code
                  == 200, 120)
            print(f"desktop sandbox: created and noVNC answering in {time.monotonic() - t0:.1f} s", flush=True)
            yield sid, token
        finally:
            h.delete(f"/v1/sandboxes/{sid}")


def _png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's IHDR chunk; asserts the signature and chunk order."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    assert data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def _port_path(sid: str) -> str:
    return f"/ports/{NOVNC_PORT}-{sid.replace('_', '-')}"


def _get(stack: Any, sid: str, token: str, path: str) -> httpx.Response:
    return httpx.get(f"{stack.api_url}{_port_path(sid)}{path}", headers={"x-podbay-access-token": token},
                     timeout=120)


def test_the_display_has_the_desktop_size_and_xdotool_reaches_it(stack: Any, desktop: tuple[str, str]) -> None:
    sid, _ = desktop
    with api_client(stack) as h:
        assert sh(h, sid, "DISPLAY=:0 xdotool getdisplaygeometry").split() == [str(n) for n in SCREEN]
        # Chromium's window is on the display (the window manager mapped it).
        assert sh(h, sid, "DISPLAY=:0 xdotool search --onlyvisible --class chromium | head -1").strip()


def test_the_novnc_page_is_served_through_the_port_url(stack: Any, desktop: tuple[str, str]) -> None:
    sid, token = desktop
    r = _get(stack, sid, token, "/vnc.html")
    assert r.status_code == 200 and "noVNC" in r.text, r.text[:500]
    assert _get(stack, sid, token, "/core/rfb.js").status_code == 200  # the client's code too
    assert httpx.get(f"{stack.api_url}{_port_path(sid)}/vnc.html", timeout=120).status_code in (401, 403)


def test_a_vnc_websocket_through_the_port_url_starts_the_rfb_handshake(stack: Any, desktop: tuple[str, str]) -> None:
    sid, token = desktop
    url = stack.api_url.replace("http://", "ws://") + f"{_port_path(sid)}/websockify"
    with ws_connect(url, additional_headers={"x-podbay-access-token": token}, subprotocols=[Subprotocol("binary")],
                    open_timeout=60) as ws:
        hello = ws.recv(timeout=60)
    assert isinstance(hello, bytes) and hello.startswith(b"RFB 003.00"), hello


def test_a_screenshot_is_the_whole_x_screen(stack: Any, desktop: tuple[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    sid, _ = desktop
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c, sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(c.cdp(sid).url, timeout=120_000)
        try:  # the page's viewport made smaller than the screen: a picture of the page would be 640x360
            page = browser.contexts[0].pages[0]
            browser.contexts[0].new_cdp_session(page).send("Emulation.setDeviceMetricsOverride", {
                "width": 640, "height": 360, "deviceScaleFactor": 1, "mobile": False})
            with api_client(stack) as h:
                r = h.post(f"/v1/sandboxes/{sid}/computer/screenshot")
        finally:
            browser.close()
    assert r.status_code == 200 and r.headers["x-podbay-screenshot-source"] == "display", r.text[:300]
    assert _png_size(r.content) == SCREEN
    assert r.content.endswith(b"IEND\xaeB`\x82")


def test_a_suspended_and_woken_desktop_keeps_its_tab_and_vnc(stack: Any, desktop: tuple[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    sid, token = desktop
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c, sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(c.cdp(sid).url, timeout=120_000)
        try:
            browser.contexts[0].pages[0].evaluate("window.__pb = 42")
        finally:
            browser.close()  # disconnects; the tab stays open in the sandbox
        with api_client(stack) as h:
            r = h.post(f"/v1/sandboxes/{sid}/suspend")
            assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
            r = h.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
        browser = p.chromium.connect_over_cdp(c.cdp(sid).url, timeout=120_000)
        try:
            assert browser.contexts[0].pages[0].evaluate("window.__pb") == 42
        finally:
            browser.close()
    assert _get(stack, sid, token, "/vnc.html").status_code == 200
