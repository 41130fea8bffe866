"""The port edge keeps podbay's own cookies from guests, and isolates a path-form answer from a console
session (services/api/edge/ports.py): the path form shares the API's origin, so a guest page there could
otherwise read the console's CSRF token and act as the person signed in."""

from __future__ import annotations

import asyncio
from typing import Any

from podbay_api.edge.ports import PATH_FORM_CSP, guest_cookie_header, isolating_send


def test_podbay_cookies_never_reach_the_guest() -> None:
    assert guest_cookie_header("podbay_session=s1; app=1; podbay_port_token=t; theme=dark") == "app=1; theme=dark"
    assert guest_cookie_header("podbay_session=s1") == ""
    assert guest_cookie_header("podbay_port_token=t;podbay_session=s") == ""
    # A cookie whose name merely starts like podbay's is the guest's own.
    assert guest_cookie_header("podbay_sessions=x; app=2") == "podbay_sessions=x; app=2"


def _sent(mode: str, cookie: str, guest_headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        out.append(message)

    async def run() -> None:
        wrapped = isolating_send(send, mode, {"cookie": cookie} if cookie else {})
        await wrapped({"type": "http.response.start", "status": 200, "headers": guest_headers})
        await wrapped({"type": "http.response.body", "body": b"<script>fetch('/console/session')</script>"})
    asyncio.run(run())
    return out


def test_a_path_form_answer_to_a_console_browser_is_sandboxed() -> None:
    # The guest's own CSP (which could allow-same-origin) is replaced, not merely joined.
    sent = _sent("path", "podbay_session=abc", [(b"content-type", b"text/html"),
                                                 (b"Content-Security-Policy", b"sandbox allow-same-origin")])
    csp = [v for k, v in sent[0]["headers"] if k.lower() == b"content-security-policy"]
    assert csp == [PATH_FORM_CSP.encode()]
    assert "allow-same-origin" not in PATH_FORM_CSP and PATH_FORM_CSP.startswith("sandbox ")
    assert sent[1]["body"].startswith(b"<script>")


def test_host_forms_and_browsers_without_a_session_are_left_alone() -> None:
    for mode, cookie in (("host", "podbay_session=abc"), ("e2b", "podbay_session=abc"), ("path", "app=1"),
                         ("path", "")):
        sent = _sent(mode, cookie, [(b"content-type", b"text/html")])
        assert sent[0]["headers"] == [(b"content-type", b"text/html")], (mode, cookie)


def test_a_clients_own_sandbox_env_header_never_reaches_the_guest() -> None:
    """``x-podbay-sandbox-env`` is the edge's (the sandbox's create-time environment for the code interpreter's
    kernels): a client's header of that name is dropped, whatever its case, and nothing else of the client's."""
    from podbay_api.edge.ports import SANDBOX_ENV_HEADER, PortsEdge, _Route

    scope = {"headers": [(b"X-Podbay-Sandbox-Env", b'{"PATH": "/evil"}'), (SANDBOX_ENV_HEADER.encode(), b"{}"),
                         (b"content-type", b"application/json")], "scheme": "http", "client": ("10.0.0.9", 1)}
    out = PortsEdge._forward_headers(None, scope, {"host": "h"},
                                     _Route("sbx_1", 49999, "/execute", "e2b"), False)
    names = [k.decode().lower() for k, _ in out]
    assert SANDBOX_ENV_HEADER not in names
    assert "content-type" in names
