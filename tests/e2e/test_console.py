"""The web console (/console) in Debian's Chromium, driven by Playwright, against a live stack with real
microVMs: sign in, the live sandbox list, a terminal on a PTY in the guest (typing, paste, resize), a file
upload, the snapshot tree's snapshot-now and fork, every page's screenshot, and another tenant kept out of a
sandbox's page and terminal. The figures (first paint and time-to-interactive of the sandbox list and the
sandbox page, keystroke-to-echo latency, shipped JS/CSS bytes) are printed (``-s``) and written beside the
screenshots as ``figures.json`` in the test's artefact directory."""

from __future__ import annotations

import json
import secrets
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, new_sandbox, sh, sh_output, until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]
STATIC = Path(__file__).resolve().parents[2] / "services" / "api" / "console" / "static"


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots and figures go (the test's artefacts)."""
    return tmp_path_factory.mktemp("console-shots")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)")
    if not (STATIC / "index.html").exists():
        pytest.skip("the console is not built (scripts/setup.sh builds it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _page(browser: Any, stack: Any) -> Any:
    ctx = browser.new_context(base_url=stack.api_url, viewport={"width": 1280, "height": 800})
    ctx.set_default_timeout(60_000)
    return ctx.new_page()


def _sign_in(page: Any, key: str, shots: Path | None = None) -> None:
    page.goto("/console#/signin")
    page.get_by_label("API key").fill(key)
    if shots:
        page.screenshot(path=str(shots / "signin.png"))
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Sandboxes").wait_for()


def _screen(page: Any) -> list[str]:
    """The terminal's lines as text (xterm.js's buffer, exposed by the console as ``window.__term``)."""
    return list(page.evaluate("""() => { const b = window.__term.buffer.active; const out = [];
        for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true)); return out; }"""))


def _wait_line(page: Any, want: str, timeout_s: float = 30) -> None:
    try:
        until(f"{want!r} on the terminal", lambda: any(line.strip() == want for line in _screen(page)), timeout_s,
              every_s=0.1)
    except AssertionError:
        raise AssertionError(f"{want!r} not on the terminal: {[ln for ln in _screen(page) if ln.strip()][-12:]}") from None


def test_console_end_to_end(stack: Any, browser: Any, shots: Path) -> None:
    figures: dict[str, Any] = {}
    page = _page(browser, stack)
    with api_client(stack) as c:
        _sign_in(page, stack.api_key, shots)
        # The list is open before the sandbox exists: it must appear from the event stream, without a reload.
        sid = c.post("/v1/sandboxes", json={"template": "base"}, params={"wait": "false"}).json()["id"]
        try:
            page.locator(f"tr[data-sandbox='{sid}']").wait_for()
            state = until("the sandbox to run", lambda: (s := c.get(f"/v1/sandboxes/{sid}").json()["state"]) in
                          ("running", "failed") and s, 240)
            assert state == "running", c.get(f"/v1/sandboxes/{sid}").text
            row = page.locator(f"tr[data-sandbox='{sid}']")
            try:
                row.locator(".state[data-state=running]").wait_for(timeout=20_000)
            except Exception:
                page.screenshot(path=str(shots / "sandboxes-stale.png"))
                raise AssertionError(f"the list did not follow the event stream: {row.inner_html()}") from None
            page.screenshot(path=str(shots / "sandboxes.png"))

            # First paint and time-to-interactive (list rendered) of a fresh load of the list, three times.
            paints, ready = [], []
            for _ in range(3):
                page.goto("/console#/sandboxes")
                page.locator(f"tr[data-sandbox='{sid}']").wait_for()
                t = page.evaluate("""() => ({fcp: (performance.getEntriesByName('first-contentful-paint')[0]
                    || {}).startTime, ready: window.__consoleReady})""")
                paints.append(t["fcp"])
                ready.append(t["ready"])
            figures["sandbox_list_first_paint_ms"] = round(statistics.median(paints), 1)
            figures["sandbox_list_interactive_ms"] = round(statistics.median(ready), 1)

            # The sandbox's page: a terminal on a PTY in the guest.
            t0 = time.monotonic()
            page.goto(f"/console#/sandboxes/{sid}")
            page.get_by_text("connected", exact=True).wait_for()
            figures["sandbox_page_terminal_connected_ms"] = round((time.monotonic() - t0) * 1000, 1)
            page.locator(".xterm-helper-textarea").focus()
            page.keyboard.type("echo hi\n")
            _wait_line(page, "hi")
            # Keystroke to echo: one character typed, until the PTY's echo is on the screen.
            # Keystroke to echo, timed in the page: a key into xterm.js (its onData, as a typed key) until the
            # PTY's echo has been written to the screen (the cursor moved on).
            lat = [page.evaluate("""() => new Promise((done) => {
                const term = window.__term, b = term.buffer.active, x0 = b.cursorX, t0 = performance.now();
                const d = term.onWriteParsed(() => { if (b.cursorX !== x0) { d.dispose(); done(performance.now() - t0); } });
                term.input('x', true);
            })""") for _ in range(20)]
            page.keyboard.press("Control+U")
            figures["terminal_keystroke_echo_ms_p50"] = round(statistics.median(lat), 1)
            # A paste goes through as one input (bash takes it as a bracketed paste, run on Enter); a resize
            # reaches the PTY (stty reads the size the guest has).
            page.evaluate("() => window.__term.paste('echo pasted-$((40+2))')")
            page.keyboard.press("Enter")
            _wait_line(page, "pasted-42")
            wide = page.evaluate("() => window.__term.cols")
            page.set_viewport_size({"width": 800, "height": 640})
            until("the terminal to refit", lambda: page.evaluate("() => window.__term.cols") < wide, 10)
            size = page.evaluate("() => [window.__term.rows, window.__term.cols]")
            page.keyboard.type("stty size\n")
            _wait_line(page, f"{size[0]} {size[1]}")
            page.screenshot(path=str(shots / "terminal.png"))
            page.set_viewport_size({"width": 1280, "height": 800})

            # Files: upload through the page, read it back through the API.
            page.get_by_role("tab", name="Files").click()
            page.locator("tr[data-file]").first.wait_for()
            body = f"uploaded from the console {secrets.token_hex(4)}\n"
            page.get_by_label("Upload files").set_input_files(
                files=[{"name": "hello.txt", "mimeType": "text/plain", "buffer": body.encode()}])
            page.locator("tr[data-file='hello.txt']").wait_for()
            got = c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/hello.txt"})
            assert got.status_code == 200 and got.text == body
            page.get_by_role("button", name="hello.txt").click()
            page.get_by_label("Contents of /root/hello.txt").wait_for()
            page.screenshot(path=str(shots / "files.png"))

            page.get_by_role("tab", name="Ports").click()
            page.get_by_text("Open ports").wait_for()
            page.screenshot(path=str(shots / "ports.png"))
            page.get_by_role("tab", name="Events").click()
            page.locator("ol.events li").first.wait_for()
            page.screenshot(path=str(shots / "events.png"))
            # Its audit log: opening the terminal was recorded.
            page.get_by_role("link", name="Audit log of this sandbox").click()
            page.get_by_role("cell", name="sandbox.pty", exact=True).first.wait_for()
            page.screenshot(path=str(shots / "sandbox-audit.png"))
            page.goto(f"/console#/sandboxes/{sid}")
            page.get_by_text("connected", exact=True).wait_for()

            # Snapshot now, then fork from the tree: the child shows under its snapshot and exists in the API.
            page.get_by_role("tab", name="Snapshots").click()
            page.get_by_role("button", name="Snapshot now").click()
            node = page.locator("li[data-snapshot]").first
            node.locator(".state[data-state=ready]").wait_for(timeout=120_000)
            snap = node.get_attribute("data-snapshot")
            page.get_by_role("button", name=f"Fork from {snap}").click()
            child_link = page.locator(f"li[data-snapshot='{snap}'] li[data-child]").first
            child_link.wait_for()
            child = child_link.get_attribute("data-child")
            page.screenshot(path=str(shots / "snapshots.png"))
            assert c.get(f"/v1/sandboxes/{child}").status_code == 200
            until("the fork to run", lambda: c.get(f"/v1/sandboxes/{child}").json()["state"] == "running", 180)
            c.delete(f"/v1/sandboxes/{child}")
            # A second snapshot after a change, then the file-level diff of the two from the tree.
            assert c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/diffme.txt"}, content=b"new\n").is_success
            # The diff reads the snapshots' disks: the write must have left the guest's page cache.
            assert c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "sync"}).json()["exit_code"] == 0
            page.get_by_role("button", name="Snapshot now").click()
            until("two ready snapshots", lambda: page.locator("li[data-snapshot] > .node .state[data-state=ready]").count() == 2,
                  120)
            for box in page.get_by_role("checkbox").all():
                box.check()
            page.get_by_role("button", name="Compare selected").click()
            try:
                page.locator("#snapshot-diff tr[data-path='/root/diffme.txt']").wait_for()
            except Exception:
                raise AssertionError(f"no diff: {page.locator('#toast').inner_text()!r} "
                                     f"{page.locator('#snapshot-diff').inner_text()[:2000]!r}") from None
            page.screenshot(path=str(shots / "snapshot-diff.png"), full_page=True)

            for name, heading in (("templates", "Templates"), ("volumes", "Volumes"), ("credentials", "Credentials"),
                                  ("webhooks", "Webhooks"), ("keys", "API keys"), ("audit", "Audit"), ("nodes", "Nodes")):
                page.goto(f"/console#/{name}")
                page.get_by_role("heading", name=heading, exact=True).wait_for()
                page.locator("table").first.wait_for()
                page.screenshot(path=str(shots / f"{name}.png"), full_page=False)
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
            page.context.close()
    assets = STATIC / "assets"
    figures["shipped_js_bytes"] = {p.name: p.stat().st_size for p in assets.glob("*.js")}
    figures["shipped_css_bytes"] = {p.name: p.stat().st_size for p in assets.glob("*.css")}
    print("console figures:", json.dumps(figures))
    (shots / "figures.json").write_text(json.dumps(figures, indent=2))
    print("console screenshots:", shots)


def test_another_tenant_gets_404_for_the_page_and_the_terminal(stack: Any, browser: Any, shots: Path) -> None:
    saved = stack.api_key, stack.tenant_id
    try:
        other_key = stack.create_api_key(f"console-other-{secrets.token_hex(3)}", "test")
    finally:
        stack.api_key, stack.tenant_id = saved
    with api_client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        page = _page(browser, stack)
        try:
            # A first visit: the list is asked for before there is a session (refused), then the sign-in;
            # the list must then load, not show that first refusal.
            page.goto("/console")
            page.get_by_label("API key").fill(other_key)
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("heading", name="Sandboxes").wait_for()
            assert page.get_by_role("heading", name="Error").count() == 0
            assert page.locator(f"tr[data-sandbox='{sid}']").count() == 0
            page.goto(f"/console#/sandboxes/{sid}")
            page.get_by_role("heading", name="Not found").wait_for()
            assert page.locator("main").get_attribute("data-status") == "404"
            # Dot segments are no sandbox id: the browser would turn them into another API path.
            for bad in ("..", ".", "%2e%2e"):
                page.goto("/console#/sandboxes")
                page.get_by_role("heading", name="Sandboxes").wait_for()
                page.goto(f"/console#/sandboxes/{bad}")
                page.get_by_role("heading", name="Not found").wait_for()
            page.screenshot(path=str(shots / "other-tenant-404.png"))
            # The terminal's WebSocket, opened from the console's own page with its session and token: refused.
            outcome = page.evaluate("""async (sid) => {
                const s = await (await fetch('/console/session')).json();
                return await new Promise((done) => {
                  const ws = new WebSocket(`ws://${location.host}/v1/sandboxes/${sid}/pty?csrf=${s.csrf_token}`);
                  ws.onopen = () => done('open');
                  ws.onclose = (ev) => done('closed ' + ev.code);
                });
            }""", sid)
            assert outcome.startswith("closed"), outcome
            with httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {other_key}"}) as b:
                assert b.get(f"/v1/sandboxes/{sid}").status_code == 404
        finally:
            page.context.close()
            c.delete(f"/v1/sandboxes/{sid}")


def test_a_template_build_streams_its_log_into_the_page(stack: Any, browser: Any, shots: Path) -> None:
    name = f"console-{secrets.token_hex(3)}"
    page = _page(browser, stack)
    try:
        _sign_in(page, stack.api_key)
        page.goto("/console#/templates")
        page.get_by_label("Name (name or name:tag)").fill(name)
        page.get_by_label("Dockerfile").fill("FROM base\nRUN echo console-build-$((6*7))\n")
        page.get_by_role("button", name="Build", exact=True).click()
        log = page.get_by_label("Build log")
        log.get_by_text("console-build-42").wait_for(timeout=300_000)
        log.get_by_text(f"built {name}").wait_for(timeout=300_000)
        page.screenshot(path=str(shots / "template-build.png"))
    finally:
        page.context.close()
        with api_client(stack) as c:
            c.delete(f"/v1/templates/{name}")


def _sql(stack: Any, query: str, *args: Any) -> list[Any]:
    """One statement against the stack's PostgreSQL (rows a test sets up, such as a node no agent runs)."""
    import asyncpg

    from podbay.devstack.procs import run_sync

    async def run() -> list[Any]:
        conn = await asyncpg.connect(stack.pg_dsn)
        try:
            return list(await conn.fetch(query, *args))
        finally:
            await conn.close()

    return run_sync(run())


def test_nodes_drain_with_progress_and_template_hit_rate(stack: Any, browser: Any, shots: Path) -> None:
    """The operator's Nodes page drains a node and follows the drain's progress to its end, then undrains it;
    the Templates page shows a pool's size and the caller's warm hit rate (no microVM needed)."""
    node = f"console-node-{secrets.token_hex(3)}"
    # A node that no agent runs (not live, so nothing is placed there): its drain moves nothing and succeeds.
    _sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
                " ($1, 'http://127.0.0.1:1', 1024, 2, 'tcg', 'ready')", node)
    tpl = f"console-pool-{secrets.token_hex(3)}"
    page = _page(browser, stack)
    page.on("dialog", lambda d: d.accept())
    try:
        _sign_in(page, stack.api_key)
        page.goto("/console#/nodes")
        row = page.locator(f"tr[data-node='{node}']")
        row.wait_for()
        row.get_by_role("button", name=f"Drain {node}").click()
        row.locator(".drain[data-drain-state=succeeded]").wait_for(timeout=60_000)
        assert "0 of 0 moved" in row.locator(".drain").inner_text()
        row.locator(".state[data-state=drained]").wait_for(timeout=30_000)
        page.screenshot(path=str(shots / "nodes-drain.png"))
        # Opened afresh, the page finds the node's drain again (GET /v1/nodes names it).
        page.goto("/console#/sandboxes")
        page.goto("/console#/nodes")
        row.locator(".drain[data-drain-state=succeeded]").wait_for()
        row.get_by_role("button", name=f"Undrain {node}").click()
        row.locator(".state[data-state=ready]").wait_for(timeout=30_000)
        assert row.locator(".drain").count() == 0

        # A pool of a template of the caller's tenant, with two creates audited (one from a warm slot).
        _sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus, owner_tenant) VALUES ($1, 'sha256:none',"
                    " 256, 1, $2)", tpl, stack.tenant_id)
        with api_client(stack) as c:
            assert c.put(f"/v1/pools/{tpl}", json={"size": 0}).status_code == 200
        for warm in (True, False):
            _sql(stack, "INSERT INTO audit_log (tenant_id, actor, action, target, detail) VALUES ($1, 'key_x',"
                        " 'sandbox.create', 'sbx_x', $2::jsonb)", stack.tenant_id,
                 json.dumps({"template": tpl, **({"warm": True} if warm else {})}))
        page.goto("/console#/templates")
        page.get_by_role("heading", name="Templates", exact=True).wait_for()
        assert page.locator(f"[data-pool='{tpl}']").inner_text() == "0 / 0"
        assert page.locator(f"[data-hit-rate='{tpl}']").inner_text() == "50% · 1 of 2"
        page.screenshot(path=str(shots / "templates.png"))
    finally:
        page.context.close()
        _sql(stack, "DELETE FROM warm_pools WHERE template=$1", tpl)
        _sql(stack, "DELETE FROM templates WHERE name=$1", tpl)
        _sql(stack, "UPDATE nodes SET state='drained' WHERE id=$1", node)  # out of placement, as others' test nodes


def test_sandbox_page_processes_egress_schedules_resources_desktop_and_parent(stack: Any, browser: Any,
                                                                              shots: Path) -> None:
    """The sandbox page's other tabs against a real microVM: a process listed and killed, an egress rule added,
    a schedule added and deleted, CPU/memory/disk graphs drawn from samples, the Desktop tab (shown when port
    6080 serves, as the desktop template's noVNC does: here a stand-in page) opening the guest's page on the
    port's own host through the port edge, and a fork child's link to its parent."""
    page = _page(browser, stack)
    page.on("dialog", lambda d: d.accept())  # the confirm() before a kill or a delete
    with api_client(stack) as c, new_sandbox(c) as sid:
        # A process to kill, and a stand-in for noVNC's page on the desktop's port.
        sh(c, sid, "setsid sleep 4242 </dev/null >/dev/null 2>&1 & mkdir -p /tmp/novnc && "
                   "echo '<!doctype html><title>vnc</title><p>novnc-stand-in-page</p><script src=app.js></script>'"
                   " > /tmp/novnc/vnc.html && echo 'document.body.append(\"script-ran-\" + (6*7))' > /tmp/novnc/app.js && "
                   "setsid python3 -m http.server 6080 --directory /tmp/novnc </dev/null >/dev/null 2>&1 &")
        until("port 6080 to listen", lambda: any(p["port"] == 6080 and p["listening"] for p in
                                                 c.get(f"/v1/sandboxes/{sid}/ports").json()["ports"]), 60)
        try:
            _sign_in(page, stack.api_key)
            t0 = time.monotonic()
            page.goto(f"/console#/sandboxes/{sid}?tab=processes")
            row = page.locator("tr[data-pid]", has_text="sleep 4242")
            row.wait_for()
            assert page.locator("#parent-link").count() == 0  # not a fork child
            assert "null" not in page.locator("main .bar").first.inner_text()
            print(f"console processes tab: {(time.monotonic() - t0) * 1000:.0f} ms")  # a figure, not a check
            page.screenshot(path=str(shots / "processes.png"))
            pid = row.get_attribute("data-pid")
            page.get_by_role("button", name=f"Kill process {pid}").click()
            row.wait_for(state="detached")
            # (the listing's own shell names 'sleep 4242' too, hence the whole command line's match)
            assert sh_output(c, sid, "ps -eo args= | grep -c '^sleep 4242$' || true").strip() == "0"

            page.get_by_role("tab", name="Resources").click()
            until("two samples drawn", lambda: int(page.locator("svg[data-metric=cpu]").get_attribute("data-points")
                                                   or 0) >= 2, 60)
            for metric in ("cpu", "memory", "disk"):
                assert page.locator(f"svg[data-metric={metric}] polyline").get_attribute("points")
            assert "of" in page.get_by_role("img", name="Memory").get_attribute("aria-label")
            page.screenshot(path=str(shots / "resources.png"))

            # The tabs by keyboard: the arrow key moves from Resources to the next tab, Egress, and opens it.
            page.get_by_role("tab", name="Resources").focus()
            page.keyboard.press("ArrowRight")
            assert page.get_by_role("tab", name="Egress").get_attribute("aria-selected") == "true"
            page.get_by_label("Allow domain").fill("example.com")
            page.get_by_label("Port", exact=True).fill("443")
            page.get_by_role("button", name="Allow", exact=True).click()
            page.locator("tr[data-rule='allow example.com']").wait_for()
            net = c.get(f"/v1/sandboxes/{sid}/network").json()
            assert net["source"] == "sandbox" and {"domain": "example.com", "ports": [443]} in [
                {k: v for k, v in r.items() if v not in (None, [])} for r in net["policy"]["allow"]], net
            page.screenshot(path=str(shots / "egress.png"))

            page.get_by_role("tab", name="Schedules").click()
            page.get_by_label("Cron (minute hour day month weekday)").fill("*/30 * * * *")
            page.get_by_label("Command", exact=True).fill("echo from-a-schedule")
            page.get_by_role("button", name="Add schedule").click()
            sched = page.locator("tr[data-schedule]").first
            sched.wait_for()
            schedule_id = sched.get_attribute("data-schedule")
            listed = c.get(f"/v1/sandboxes/{sid}/schedules").json()["schedules"]
            assert [(s["id"], s["cron"], s["command"]["argv"]) for s in listed] == [
                (schedule_id, "*/30 * * * *", ["/bin/sh", "-c", "echo from-a-schedule"])]
            page.screenshot(path=str(shots / "schedules.png"))
            page.get_by_role("button", name=f"Delete schedule {schedule_id}").click()
            sched.wait_for(state="detached")
            assert c.get(f"/v1/sandboxes/{sid}/schedules").json()["schedules"] == []

            page.get_by_role("tab", name="Desktop").click()
            page.screenshot(path=str(shots / "desktop.png"))
            with page.context.expect_page() as opened:
                page.get_by_role("link", name="Open the desktop").click()
            desk = opened.value
            desk.get_by_text("novnc-stand-in-page").wait_for()
            desk.get_by_text("script-ran-42").wait_for()  # its scripts load through the port edge too
            # On the port's own host (an origin apart from the console's), with the token exchanged for a cookie.
            assert desk.url.split("/")[2].startswith(f"6080-{sid.replace('_', '-')}."), desk.url
            assert "podbay_token" not in desk.url
            desk.close()

            # A fork child's page links to its parent.
            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1}, params={"wait": "false"})
            assert r.status_code in (200, 202), r.text
            child = r.json()["children"][0]["sandbox_id"]
            try:
                assert c.get(f"/v1/sandboxes/{child}").json()["parent_id"] == sid
                page.goto(f"/console#/sandboxes/{child}?tab=events")
                page.get_by_role("link", name=f"Parent sandbox {sid}").click()
                page.get_by_role("heading", name=f"Sandbox {sid}").wait_for()
                page.goto(f"/console#/sandboxes/{child}?tab=events")
                page.locator("#parent-link").wait_for()
                page.screenshot(path=str(shots / "fork-parent.png"))
            finally:
                c.delete(f"/v1/sandboxes/{child}", params={"wait": "false"})
        finally:
            page.context.close()


def test_nodes_page_follows_a_live_migration(multinode_stack: Any, browser: Any, shots: Path) -> None:
    """Two nodes: a running sandbox's node drained from the Nodes page, whose drain shows the sandbox's move
    (destination, downtime) as it lands and ends ``succeeded``, 1 of 1 moved; the sandbox runs on the other node;
    the node is undrained from the page."""
    st = multinode_stack
    page = _page(browser, st)
    page.on("dialog", lambda d: d.accept())
    with api_client(st) as c, new_sandbox(c) as sid:
        node = c.get(f"/v1/sandboxes/{sid}").json()["node_id"]
        try:
            _sign_in(page, st.api_key)
            page.goto("/console#/nodes")
            row = page.locator(f"tr[data-node='{node}']")
            row.get_by_role("button", name=f"Drain {node}").click()
            row.locator(".drain").wait_for()
            page.screenshot(path=str(shots / "nodes-draining.png"))
            moved = row.locator(f"li[data-moved='{sid}']")
            moved.wait_for(timeout=300_000)
            row.locator(".drain[data-drain-state=succeeded]").wait_for(timeout=300_000)
            assert "1 of 1 moved" in row.locator(".drain").inner_text()
            assert "downtime" in moved.inner_text()
            page.screenshot(path=str(shots / "nodes-migration.png"))
            now = c.get(f"/v1/sandboxes/{sid}").json()
            assert now["node_id"] not in (None, node) and now["state"] == "running", now
            assert now["node_id"] in moved.inner_text()
            row.locator(".state[data-state=drained]").wait_for(timeout=30_000)
            row.get_by_role("button", name=f"Undrain {node}").click()
            row.locator(".state[data-state=ready]").wait_for(timeout=30_000)
        finally:
            page.context.close()
            c.post(f"/v1/nodes/{node}/undrain")  # the shared two-node stack is handed on with both nodes ready


def test_screenshots_are_kept(shots: Path) -> None:
    """Copies this run's screenshots to docs/console/ when PODBAY_CONSOLE_SHOTS_TO_DOCS=1 (for the reviewer)."""
    import os

    if os.environ.get("PODBAY_CONSOLE_SHOTS_TO_DOCS") != "1":
        pytest.skip("set PODBAY_CONSOLE_SHOTS_TO_DOCS=1 to copy the screenshots into docs/console/")
    docs = Path(__file__).resolve().parents[2] / "docs" / "console"
    docs.mkdir(exist_ok=True)
    for png in shots.glob("*.png"):
        shutil.copy(png, docs / png.name)
    if (shots / "figures.json").exists():  # written by the end-to-end test, when it ran in this session
        shutil.copy(shots / "figures.json", docs / "figures.json")
