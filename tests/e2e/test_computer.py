"""Computer use with the ``browser`` template, with real VMs (docs/computer-use.md).

The template is built once per module from ``templates/browser/Dockerfile`` with 1024 MiB, FROM
``templates/chromium/Dockerfile`` (whose slow install comes from the host's build cache, cache_dir/layers,
after the first build on a machine; the browser's build boots its disk once with that memory), and one
sandbox of it serves the tests: its snapshot already holds a running Chromium with CDP on guest port 9222. A
page is served in the sandbox by another process (``python3 -m http.server``). The tests share one Playwright
connection (the Python package, no browser of its own) to the sandbox's tab, over CDP through the API's port
edge, and each page load is one the checks need: under TCG a connection and a page load each cost seconds to
tens of seconds. Checked: a screenshot is a PNG of the browser's window size; Playwright reads the page's
title; mouse and keyboard input through the API reach the page; a fork of the sandbox is a browser of its own
(the child's tab starts with the parent's script state, a change in the child leaves the parent's tab alone,
and both answer CDP); a sandbox of a template without a browser answers 409 ``no_browser``. Credential fill:
the node types a stored credential into a password field of a page served in the sandbox (the page sees its
length and character sum), while the agent's CDP stream shows it redacted and a scan of the guest's process
environments, command lines and files (outside the swap file) finds none of it; a page of another origin, an
unknown, out-of-scope or expired credential and a missing selector are refused and type nothing, each audited;
the API's screenshot shows the password field's box before the fill and masks it (opaque black) after it, and
leaves the other field alone; so does a screenshot the agent takes itself over CDP (Playwright's).
"""

from __future__ import annotations

import io
import json
import math
import struct
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client, new_sandbox, sh, until
from PIL import Image

from podbay.sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

#: The one page of the tests: a text field and a key log for the input checks, and a login form for the fill
#: (``#seen`` shows the length and character sum of what the password field received).
PAGE = """<!doctype html><html><head><title>podbay computer e2e</title></head>
<body style="margin:0"><input id="q" style="position:absolute;left:0;top:0;width:400px;height:40px">
<div id="keys" style="position:absolute;top:60px"></div>
<div style="position:absolute;top:100px"><input id="user"><input id="pw" type="password"><div id="seen"></div></div>
<script>document.addEventListener("keydown", e => { document.getElementById("keys").textContent += e.key + ","; });
document.getElementById("pw").addEventListener("input", e => { const v = e.target.value;
  document.getElementById("seen").textContent = v.length + ":" + [...v].reduce((a, c) => a + c.charCodeAt(0), 0); });
</script></body></html>
"""

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
#: What chromium's RUN step needs: Debian's mirror (the guest's apt sources), over HTTP.
EGRESS = {"allow": [{"domain": "deb.debian.org", "ports": [80]}]}
#: The browser template's memory (templates/browser/Dockerfile says why).
BROWSER_MEMORY_MIB = 1024


@pytest.fixture(scope="module")
def browser_template(stack: Any) -> str:
    def show(e: Any) -> None:
        print(e.model_dump_json(exclude_none=True), flush=True)

    with Client(stack.api_url, stack.api_key, timeout_s=1800) as c:
        c.build_template("chromium", TEMPLATES / "chromium" / "Dockerfile", TEMPLATES / "chromium", egress=EGRESS,
                         on_event=show)
        tpl = c.build_template("browser", TEMPLATES / "browser" / "Dockerfile", TEMPLATES / "browser",
                               ready_port=9222, memory_mib=BROWSER_MEMORY_MIB, on_event=show)
    assert tpl.memory_mib == BROWSER_MEMORY_MIB
    return str(tpl.name)


@pytest.fixture(scope="module")
def sandbox(stack: Any, browser_template: str) -> Iterator[str]:
    with api_client(stack) as h:
        r = h.post("/v1/sandboxes", json={"template": browser_template})
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        try:
            yield sid
        finally:
            h.delete(f"/v1/sandboxes/{sid}")


def test_a_new_sandbox_has_a_running_browser(stack: Any, sandbox: str) -> None:
    with api_client(stack) as h:
        out = sh(h, sandbox, "python3 -c \"import urllib.request; "
                             "print(urllib.request.urlopen('http://127.0.0.1:9222/json/version').read().decode())\"")
        assert '"webSocketDebuggerUrl"' in out, out


@pytest.fixture(scope="module")
def site(stack: Any, sandbox: str) -> str:
    """``http://127.0.0.1:8000/`` in the sandbox: :data:`PAGE` served by ``python3 -m http.server``."""
    with api_client(stack) as h:
        r = h.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/srv/site/index.html"}, content=PAGE.encode())
        assert r.status_code == 200, r.text
        sh(h, sandbox, "cd /srv/site && setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null &")
        until("the page server", lambda: "podbay computer e2e" in sh(
            h, sandbox, "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').read()"
                        ".decode())\" 2>/dev/null || true"), 30)
    return "http://127.0.0.1:8000/"


def _other_origin(site: str) -> str:
    """The same page from another origin (``localhost`` instead of ``127.0.0.1``): the same server."""
    return site.replace("127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    """Playwright's sync API, started once for the module (it cannot be started twice at a time)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def tab(stack: Any, sandbox: str, playwright: Any) -> Iterator[Any]:
    """The sandbox's browser tab as an agent drives it: a Playwright ``Page`` of a connection over CDP through
    the API's port edge, shared by the tests (each connection costs seconds under TCG). Closing the connection
    disconnects; the sandbox's browser keeps running."""
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c:
        browser = playwright.chromium.connect_over_cdp(c.cdp(sandbox).url, timeout=120_000)
    try:
        page = browser.contexts[0].pages[0]
        page.set_default_timeout(120_000)  # a bound, not a timing assertion: Chromium runs under TCG
        yield page
    finally:
        browser.close()


SECRET = "pb-fill-Secret-7c1e9a42d0"
# Run in the guest with the secret in two halves (so this scan's own command line does not hold it):
# prints the places outside the swap file (/swapfile) where the whole value is found. The files are searched
# by one grep (every regular file under the tops, whatever its size; -r follows no symbolic link found on
# the way, as os.walk does not), which reads the value from its stdin, so that no process's command line,
# environment or file holds it (one process in C: in a Python walk, every file's open and read is
# interpreted, which TCG makes slow). grep's errors are hits too (a scan that could not look must not pass),
# but for a file removed while it ran.
SCAN = r"""
import os, subprocess, sys
needle = (sys.argv[1] + sys.argv[2]).encode()
hits = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for part in ("environ", "cmdline"):
            try:
                if needle in open(f"/proc/{pid}/{part}", "rb").read():
                    hits.append(f"/proc/{pid}/{part}")
            except OSError:
                pass
tops = ["/etc", "/home", "/root", "/tmp", "/srv", "/var", "/opt", "/run"]
r = subprocess.run(["grep", "-r", "-l", "-a", "-F", "-f", "-", "--", *[t for t in tops if os.path.isdir(t)]],
                   input=needle + b"\n", capture_output=True)
hits += r.stdout.decode(errors="replace").splitlines()
if r.returncode not in (0, 1):
    hits += [f"grep: {e}" for e in r.stderr.decode(errors="replace").splitlines()
             if not e.endswith("No such file or directory")] or [f"grep exited {r.returncode}"]
print("\n".join(hits))
"""


def _png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's IHDR chunk; asserts the signature and chunk order."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    assert data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def _all_mask(png: bytes, box: Any) -> bool:
    """Whether every pixel inside ``box`` (Playwright's ``{x, y, width, height}``, CSS pixels, one pixel in
    from each edge) has the screenshot mask's colour, opaque black."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    xs = range(math.ceil(box["x"]) + 1, math.floor(box["x"] + box["width"]) - 1)
    ys = range(math.ceil(box["y"]) + 1, math.floor(box["y"] + box["height"]) - 1)
    assert len(xs) > 4 and len(ys) > 4, box
    return all(img.getpixel((x, y)) == (0, 0, 0) for x in xs for y in ys)


def test_screenshot_is_a_png_of_the_viewport_size(stack: Any, sandbox: str, tab: Any) -> None:
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c:
        png = c.screenshot(sandbox)
    size = tab.evaluate("[innerWidth, innerHeight]")  # the page's own idea of its viewport (the window less its frame)
    assert _png_size(png) == tuple(size) and size[0] == 1280  # --window-size=1280,720
    assert png.endswith(b"IEND\xaeB`\x82")  # whole: the last chunk is there


def test_playwright_reads_the_title_and_mouse_and_keyboard_reach_the_page(stack: Any, sandbox: str, site: str,
                                                                         tab: Any) -> None:
    # One navigation: a page load under TCG costs tens of seconds, and the input checks need the page that
    # Playwright has just loaded anyway. From the other origin, where the fill test's refusal of a wrong
    # origin finds the tab next.
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c:
        ep = c.cdp(sandbox)  # the endpoint that ``tab`` connected to
        assert ep.url.startswith("ws://") and "/devtools/browser/" in ep.url and ep.port == 9222
        tab.goto(_other_origin(site))
        assert tab.title() == "podbay computer e2e"

        assert c.mouse(sandbox, "click", 100, 20).events == 3  # move, press, release: focus the input
        assert c.keyboard(sandbox, text="hello").events == 1
        c.keyboard(sandbox, keys=["Shift+a", "Enter"])
        assert c.mouse(sandbox, "scroll", 100, 100, delta_y=50).events == 1
        assert c.mouse(sandbox, "drag", 10, 10, to_x=200, to_y=30, steps=4).events == 7
        assert tab.input_value("#q") == "helloA"
        assert tab.text_content("#keys") == "Shift,A,Enter,"


def test_a_fork_is_a_browser_of_its_own(stack: Any, sandbox: str, tab: Any, playwright: Any) -> None:
    # Before the fill test: a child forked after a fill would hold the value in its page memory.
    tab.evaluate("window.__pb = 'parent'")
    with Client(stack.api_url, stack.api_key, timeout_s=300) as c:
        children = c.fork_sandbox(sandbox).children
        assert len(children) == 1 and children[0].state == "running", children
        child = children[0].sandbox_id
        try:
            browser = playwright.chromium.connect_over_cdp(c.cdp(child).url, timeout=120_000)
            try:
                page = browser.contexts[0].pages[0]
                assert page.url == tab.url and page.evaluate("window.__pb") == "parent"  # the tab as forked
                page.evaluate("window.__pb = 'child'")
                assert page.evaluate("window.__pb") == "child"
                assert tab.evaluate("window.__pb") == "parent"  # the parent's browser is another one
            finally:
                browser.close()
        finally:
            c.delete_sandbox(child)


def test_a_sandbox_without_a_browser_is_refused(stack: Any) -> None:
    with api_client(stack) as h, new_sandbox(h, "base") as sid:
        for method, path in (("POST", "screenshot"), ("GET", "cdp")):
            r = h.request(method, f"/v1/sandboxes/{sid}/computer/{path}")
            assert r.status_code == 409 and r.json()["error"]["code"] == "no_browser", r.text
        r = h.post(f"/v1/sandboxes/{sid}/computer/keyboard", json={"action": "keys", "keys": []})
        assert r.status_code == 422, r.text


def test_credential_fill_types_from_outside_and_redacts(stack: Any, sandbox: str, site: str, tab: Any) -> None:
    with api_client(stack) as h:
        expires = datetime.now(UTC) + timedelta(seconds=2)  # expired by the time it is used (waited for below)
        for name, extra in (("site-pw", {}), ("other-pw", {"sandboxes": ["sbx_someoneelse"]}),
                            ("old-pw", {"expires_at": expires.isoformat()})):
            r = h.post("/v1/credentials", json={"name": name, "value": SECRET, "hosts": ["127.0.0.1"], **extra})
            assert r.status_code == 201, r.text
        with Client(stack.api_url, stack.api_key, timeout_s=300) as c:
            if tab.url != _other_origin(site):  # where the Playwright test leaves the tab; alone, load it
                tab.goto(_other_origin(site))

            def fill(credential: str, selector: str) -> Any:
                return h.post(f"/v1/sandboxes/{sandbox}/computer/fill",
                              json={"credential": credential, "selector": selector})

            r = fill("site-pw", "#pw")  # same server, another origin
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
            assert tab.text_content("#seen") == ""
            tab.goto(site)
            time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds() + 0.5))
            for cred, sel, status, code in (("nope", "#pw", 404, "credential_not_found"),
                                            ("other-pw", "#pw", 403, "credential_out_of_scope"),
                                            ("old-pw", "#pw", 403, "credential_expired"),
                                            ("site-pw", "#missing", 422, "selector_not_found")):
                r = fill(cred, sel)
                assert r.status_code == status and r.json()["error"]["code"] == code, r.text
            assert tab.text_content("#seen") == ""  # nothing was typed by any refusal
            before = c.screenshot(sandbox)  # no fill yet: nothing masked
            agent_before = tab.screenshot()  # the agent's own, over CDP through the port edge
            r = fill("site-pw", "#pw")
            assert r.status_code == 200, r.text
            assert r.json()["origin"] == "http://127.0.0.1:8000" and SECRET not in r.text
            expected = f"{len(SECRET)}:{sum(map(ord, SECRET))}"
            assert tab.text_content("#seen") == expected  # the page received the value
            assert tab.input_value("#pw") == "[redacted by podbay]"  # the agent's CDP stream does not
            after = c.screenshot(sandbox)
            pw, user = tab.locator("#pw").bounding_box(), tab.locator("#user").bounding_box()
            assert pw is not None and user is not None
            assert not _all_mask(before, pw)  # unmasked before the fill: the field's white box
            assert _all_mask(after, pw) and not _all_mask(after, user)  # masked after it; the user field not
            # The agent's own screenshot over CDP (Playwright's Page.captureScreenshot) is masked by the node's
            # relay from the fill on, too (services/nodeagent/computer/cdp_mask.py).
            agent_after = tab.screenshot()
            assert not _all_mask(agent_before, pw)
            assert _all_mask(agent_after, pw) and not _all_mask(agent_after, user)
        half = len(SECRET) // 2
        r = h.post(f"/v1/sandboxes/{sandbox}/exec", json={"argv": ["python3", "-c", SCAN, SECRET[:half],
                                                                     SECRET[half:]]})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        assert r.json()["stdout"].strip() == "", r.json()["stdout"]
        rows = h.get("/v1/audit", params={"action": "credential.fill", "sandbox_id": sandbox}).json()["entries"]
        reasons = sorted(str(e["detail"].get("reason", e["decision"])) for e in rows)
        assert reasons == ["allow", "credential_expired", "credential_not_found", "credential_out_of_scope",
                           "origin_not_allowed", "selector_not_found"], rows
        assert SECRET not in json.dumps(rows)
