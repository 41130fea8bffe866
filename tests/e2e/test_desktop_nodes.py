"""A long-lived desktop across nodes and forks, with real VMs on two nodes (docs/computer-use.md, "Long-lived
desktops").

The ``desktop`` template is built on the two-node stack (promoted to object storage; the other node fetches it
on first use). One desktop sandbox gets a tab on a page of the guest's own origin (websockify's 404 page), with
script state and a cookie set over CDP.

- Forked, the child is a desktop of its own: its tab is the parent's as forked (script state and cookie), a
  change there leaves the parent's tab alone, and the child's noVNC answers through its own port URL.
- Paused, then suspended to object storage, its node drained, and resumed: the desktop runs on the other
  node, with the tab's script state and cookie, Chromium answering CDP, and the VNC server answering a
  WebSocket through the same port URL and token (the RFB handshake's version line).

Runs before ``test_node_loss.py`` and after the other modules of the shared stack (tests/conftest.py), since it
drains a node (undrained at its end, so that ``test_node_loss.py`` can take the stack as it is).
"""

from __future__ import annotations

from typing import Any

import pytest
from desktop_support import NOVNC_PORT, build_desktop, novnc_get, rfb_hello
from e2e_http import api_client, until

from podbay.sdk import Client

# Two 1024 MiB desktops under TCG, a suspend of one to object storage and its wake on the other node: minutes.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

#: The tab's page, served by websockify in the guest (a 404 page of an http origin, which keeps cookies).
PAGE = "http://127.0.0.1:6080/podbay-desktop-nodes"
#: Reads the tab's script state and cookie in one call (each costs seconds under TCG).
STATE = "[window.__pb, document.cookie]"


def _token(h: Any, sid: str) -> str:
    r = h.get(f"/v1/sandboxes/{sid}/ports/{NOVNC_PORT}/url")
    assert r.status_code == 200, r.text
    return str(r.json()["token"])


def test_a_desktop_forks_into_independent_browsers_and_resumes_on_another_node(multinode_stack: Any) -> None:
    from playwright.sync_api import sync_playwright

    stack = multinode_stack
    template = build_desktop(stack)
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack, timeout_s=600) as h, \
            sync_playwright() as p:
        parent = c.create_sandbox(template=template).id
        child: str | None = None
        drained: str | None = None
        try:
            token = _token(h, parent)
            until("noVNC answers", lambda: novnc_get(stack, parent, token, "/vnc.html").status_code == 200, 120)
            browser = p.chromium.connect_over_cdp(c.cdp(parent).url, timeout=120_000)
            try:
                page = browser.contexts[0].pages[0]
                page.goto(PAGE, timeout=120_000)
                page.evaluate("window.__pb = 'parent'; document.cookie = 'pb=kept; max-age=86400'")
                assert page.evaluate(STATE) == ["parent", "pb=kept"]
            finally:
                browser.close()  # disconnects; the tab stays open in the sandbox

            # A fork: a second desktop, its browser independent of the parent's.
            forked = c.fork_sandbox(parent).children
            assert len(forked) == 1 and forked[0].state == "running", forked
            child = forked[0].sandbox_id
            browser = p.chromium.connect_over_cdp(c.cdp(child).url, timeout=120_000)
            try:
                page = browser.contexts[0].pages[0]
                assert page.url == PAGE and page.evaluate(STATE) == ["parent", "pb=kept"]  # the tab as forked
                page.evaluate("window.__pb = 'child'")
                assert page.evaluate("window.__pb") == "child"
            finally:
                browser.close()
            child_token = _token(h, child)
            assert child_token != token
            assert novnc_get(stack, child, child_token, "/vnc.html").status_code == 200
            assert rfb_hello(stack, child, child_token).startswith(b"RFB 003.00")
            browser = p.chromium.connect_over_cdp(c.cdp(parent).url, timeout=120_000)
            try:
                assert browser.contexts[0].pages[0].evaluate(STATE) == ["parent", "pb=kept"]  # untouched
            finally:
                browser.close()
            c.delete_sandbox(child)
            child = None

            # Pause, suspend to object storage, drain its node, resume: it wakes on the other node.
            first_node = c.get_sandbox(parent).node_id
            assert first_node is not None and first_node in stack.node_ids, first_node
            assert c.pause_sandbox(parent).state == "paused"
            suspended = c.suspend_sandbox(parent)
            assert suspended.state == "suspended" and suspended.node_id is None, suspended
            drain = c.drain_node(first_node)
            drained = first_node
            until(f"{first_node} is drained", lambda: c.get_operation(drain.operation_id).state == "succeeded", 300)
            woken = c.resume_sandbox(parent)
            assert woken.state == "running" and woken.node_id not in (None, first_node), woken
            browser = p.chromium.connect_over_cdp(c.cdp(parent).url, timeout=120_000)
            try:
                page = browser.contexts[0].pages[0]
                assert page.url == PAGE and page.evaluate(STATE) == ["parent", "pb=kept"]
            finally:
                browser.close()
            assert _token(h, parent) == token  # the same port URL and token reach the desktop on its new node
            assert novnc_get(stack, parent, token, "/vnc.html").status_code == 200
            assert rfb_hello(stack, parent, token).startswith(b"RFB 003.00")
        finally:
            for sid in (child, parent):
                if sid is not None:
                    h.delete(f"/v1/sandboxes/{sid}")
            if drained is not None:
                # The shared two-node stack is handed on with both nodes ready, so that test_node_loss.py takes
                # it as it is instead of waiting for it and starting a new one (tests/conftest.py).
                h.post(f"/v1/nodes/{drained}/undrain")
