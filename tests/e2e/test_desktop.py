"""The ``desktop`` template with real VMs (docs/computer-use.md, "The desktop template").

Built once per module from ``templates/desktop/Dockerfile`` with 1024 MiB, FROM ``templates/chromium/Dockerfile``
(whose install, and after the first build on a machine the desktop's own, come from the host's build cache,
cache_dir/layers). One sandbox serves the tests: its snapshot holds Xvfb, matchbox, Chromium on the display
(CDP on guest port 9222), x11vnc and websockify with noVNC on guest port 6080. Checked: the X display has the
desktop's size and xdotool reaches it; noVNC's page is served through the sandbox's port URL with its traffic
token; a WebSocket through the port URL reaches the VNC server (the RFB handshake's version line); a
screenshot through the computer API is the whole X screen (the desktop's size while the page's viewport is
emulated smaller, and the override is cleared after); last, a tab's script state set over CDP is there after the
sandbox is suspended to object storage and woken, noVNC answers again, and a credential filled into a password
field before the suspend is still redacted from the agent's CDP stream and masked in the API's screenshot after
the wake (the node re-arms both from the fill's audit row: services/nodeagent/computer/fill_memory.py). The desktop on
another node and its fork: test_desktop_nodes.py.
"""

from __future__ import annotations

import io
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from desktop_support import NOVNC_PORT, SCREEN, build_desktop, novnc_get, novnc_path, rfb_hello
from e2e_http import api_client, sh, until
from PIL import Image

from podbay.sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def desktop_template(stack: Any) -> str:
    return build_desktop(stack)


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
            until("noVNC answers through the port URL", lambda: novnc_get(stack, sid, token, "/vnc.html").status_code
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


def test_the_display_has_the_desktop_size_and_xdotool_reaches_it(stack: Any, desktop: tuple[str, str]) -> None:
    sid, _ = desktop
    with api_client(stack) as h:
        assert sh(h, sid, "DISPLAY=:0 xdotool getdisplaygeometry").split() == [str(n) for n in SCREEN]
        # Chromium's window is on the display (the window manager mapped it). The template is ready when noVNC
        # answers; Chromium maps its window on its own time, later on a loaded host.
        until("Chromium's window on the display",
              lambda: sh(h, sid, "DISPLAY=:0 xdotool search --onlyvisible --class chromium | head -1").strip(), 60)


def test_the_novnc_page_is_served_through_the_port_url(stack: Any, desktop: tuple[str, str]) -> None:
    sid, token = desktop
    r = novnc_get(stack, sid, token, "/vnc.html")
    assert r.status_code == 200 and "noVNC" in r.text, r.text[:500]
    assert novnc_get(stack, sid, token, "/core/rfb.js").status_code == 200  # the client's code too
    assert httpx.get(f"{stack.api_url}{novnc_path(sid)}/vnc.html", timeout=120).status_code in (401, 403)


def test_a_vnc_websocket_through_the_port_url_starts_the_rfb_handshake(stack: Any, desktop: tuple[str, str]) -> None:
    sid, token = desktop
    hello = rfb_hello(stack, sid, token)
    assert hello.startswith(b"RFB 003.00"), hello


def test_a_screenshot_is_the_whole_x_screen(stack: Any, desktop: tuple[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    sid, _ = desktop
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c, sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(c.cdp(sid).url, timeout=120_000)
        try:  # the page's viewport made smaller than the screen: a picture of the page would be 640x360
            page = browser.contexts[0].pages[0]
            cdp = browser.contexts[0].new_cdp_session(page)
            cdp.send("Emulation.setDeviceMetricsOverride", {"width": 640, "height": 360, "deviceScaleFactor": 1,
                                                            "mobile": False})
            try:
                with api_client(stack) as h:
                    r = h.post(f"/v1/sandboxes/{sid}/computer/screenshot")
            finally:
                # The override outlives this connection: left on, it would shrink the page in the next test.
                cdp.send("Emulation.clearDeviceMetricsOverride")
        finally:
            browser.close()
    assert r.status_code == 200 and r.headers["x-podbay-screenshot-source"] == "display", r.text[:300]
    assert _png_size(r.content) == SCREEN
    assert r.content.endswith(b"IEND\xaeB`\x82")


#: A password field on a page of the guest's own origin (websockify's 404 page), at CSS (= screen) pixels.
FIELD = ("document.body.insertAdjacentHTML('beforeend', '<input id=pbpw type=password style=\"position:fixed;"
         "left:40px;top:40px;width:400px;height:60px;z-index:9\">')")
SECRET = "pb-desktop-Secret-5b2f80"


def test_a_suspended_and_woken_desktop_keeps_its_tab_vnc_and_fill_redaction(stack: Any,
                                                                            desktop: tuple[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    sid, token = desktop
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c, sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(c.cdp(sid).url, timeout=120_000)
        try:
            page = browser.contexts[0].pages[0]
            page.goto("http://127.0.0.1:6080/podbay-fill", timeout=120_000)
            # One call (each costs seconds under TCG). The viewport is the whole screen, so the field's CSS
            # pixels are the screen's pixels the mask check reads below.
            assert page.evaluate(FIELD + "; window.__pb = 42; [innerWidth, innerHeight]") == list(SCREEN)
        finally:
            browser.close()  # disconnects; the tab stays open in the sandbox
        with api_client(stack) as h:
            r = h.post("/v1/credentials", json={"name": "desktop-pw", "value": SECRET, "hosts": ["127.0.0.1"]})
            assert r.status_code == 201, r.text
            r = h.post(f"/v1/sandboxes/{sid}/computer/fill", json={"credential": "desktop-pw", "selector": "#pbpw"})
            assert r.status_code == 200, r.text
            r = h.post(f"/v1/sandboxes/{sid}/suspend")
            assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
            r = h.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
        browser = p.chromium.connect_over_cdp(c.cdp(sid).url, timeout=120_000)
        try:
            page = browser.contexts[0].pages[0]
            # The tab's state and the filled value are in the page after the wake (the value's length, not the
            # value: that would be redacted too); the agent's CDP stream still shows the value redacted.
            assert page.evaluate("[window.__pb, document.querySelector('#pbpw').value.length]") == [42, len(SECRET)]
            assert page.input_value("#pbpw") == "[redacted by podbay]"
        finally:
            browser.close()
        with api_client(stack) as h:
            r = h.post(f"/v1/sandboxes/{sid}/computer/screenshot")
        assert r.status_code == 200, r.text[:300]
        img = Image.open(io.BytesIO(r.content)).convert("RGB")  # the field's box, 2 px in, is the mask's black
        assert all(img.getpixel((x, y)) == (0, 0, 0) for x in range(42, 438) for y in range(42, 98))
    assert novnc_get(stack, sid, token, "/vnc.html").status_code == 200
