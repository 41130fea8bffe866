"""Proxy path fuzzing: a client's envd path, in any spelling, either is refused (400) or names one allow-listed
envd route of the SAME sandbox; never another sandbox, never a route of the node. Client vs node boundary
of docs/SECURITY.md.

The API side runs as the server does: ``EnvdRouting`` (the E2B SDK's ``E2b-Sandbox-Id`` header and
``{port}-{id}.{domain}`` host forms) and the router's own ``/e2b/envd/{id}/...`` form, with the ASGI ``path``
decoded from ``raw_path`` as uvicorn decodes it; the node side is its gate's route table
(services/nodeagent/dataplane/grant_check.py). The variants tried are counted and printed (``-s``).
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podbay.envdpath import ENVD_ROUTES, EnvdPathRefused, parse_envd_path
from podbay.errors import GrantRefused
from podbay.grants import GrantKind
from podbay_api.edge.envd import PREFIX, EnvdRouting, envd_route
from podbay_nodeagent.dataplane.grant_check import route_of

MINE, OTHER, DOMAIN = "sbx_mine", "sbx_other", "e2b.test"
NODE = "http://10.0.0.7:8091"
# Spellings of separators, dots, escapes and ids that have opened other paths in proxies before.
_TOKENS = ["..", ".", "%2e", "%2E", "%2e%2e", "%2E%2e", ".%2e", "%252e", "%252e%252e", "%25", "%2f", "%2F", "%252f",
           "%5c", "%5C", "\\", "/", "//", "%00", "\x00", "%0a", "\r\n", "\t", " ", "%20", "%c0%ae", "%c0%af",
           "\u2024", "\u2025", "\uff0e", "\uff0f", "\u2215", "\xc0\xae", ";", ";x=1", "?", "#", "%3f", "%23", "@",
           MINE, OTHER, "internal", "e2b", "envd", "v1", "sandboxes", "exec", "ports", "metrics", "files", "health",
           "process.Process", "filesystem.Filesystem", "Start", "Stat", "List", "x"]
_tried = {"variants": 0}


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    """Prints how many path variants the module tried (each through three API forms and the node's gate)."""
    yield
    print(f"\nenvd path variants tried: {_tried['variants']}")


def _decoded(raw: bytes) -> str:
    """The ASGI ``path`` uvicorn makes of ``raw`` (percent-decoded once, as UTF-8 with replacement)."""
    return urllib.parse.unquote(raw.decode("latin-1"), encoding="utf-8", errors="replace")


def _upstream_via_router(raw: bytes, headers: list[tuple[bytes, bytes]]) -> str | None:
    """What the API would send upstream for a request with ``raw`` path and ``headers``: the node URL's path,
    or None when the request is refused (400) or is not an envd request at all."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["scope"] = scope

    async def send(message: Any) -> None:
        seen.setdefault("status", message.get("status"))

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "POST", "path": _decoded(raw), "raw_path": raw, "headers": headers,
             "query_string": b""}
    asyncio.run(EnvdRouting(app, DOMAIN)(scope, receive, send))
    if "scope" not in seen:
        assert seen["status"] in (400, 502), seen
        return None
    inner = seen["scope"]
    # The router's match, on the (decoded) path: /e2b/envd/{sandbox_id}/{path:path}
    m = re.fullmatch(rf"{PREFIX}/([^/]+)/(.*)", inner["path"], flags=re.DOTALL)
    if m is None:
        return None  # some other route of the API (or a 404): not the envd proxy
    try:
        route = envd_route(inner, m.group(1))
    except EnvdPathRefused:
        return None
    # As e2b_envd builds it.
    return httpx.URL(NODE).copy_with(path=f"/internal/e2b/{m.group(1)}{route}").path


def _check(raw: bytes) -> None:
    _tried["variants"] += 1
    for headers in ([(b"e2b-sandbox-id", MINE.encode())], [(b"host", f"49983-{MINE}.{DOMAIN}".encode())]):
        path = _upstream_via_router(raw, headers)
        if path is not None:
            assert path.removeprefix(f"/internal/e2b/{MINE}") in ENVD_ROUTES, (raw, path)
    # The router's own form, addressed to the caller's sandbox.
    direct = f"{PREFIX}/{MINE}".encode() + (raw if raw.startswith(b"/") else b"/" + raw)
    path = _upstream_via_router(direct, [])
    if path is not None:
        assert path.removeprefix(f"/internal/e2b/{MINE}") in ENVD_ROUTES, (direct, path)
    # The node's gate on the same bytes: envd only for an allow-listed route of the sandbox the path names.
    node_path = _decoded(f"/internal/e2b/{MINE}".encode() + (raw if raw.startswith(b"/") else b"/" + raw))
    try:
        kind, subject = route_of(node_path, {})
    except GrantRefused:
        return
    assert kind == GrantKind.ENVD and subject == MINE, (raw, kind, subject)
    assert node_path.removeprefix(f"/internal/e2b/{MINE}") in ENVD_ROUTES, raw


def _encode(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogatepass")


@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=8), st.sampled_from(["/", "", "\\", "/./"]))
def test_token_paths_map_to_an_envd_route_of_the_same_sandbox_or_are_refused(parts: list[str], sep: str) -> None:
    _check(_encode("/" + sep.join(parts)))


@settings(max_examples=1500, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_arbitrary_bytes_map_to_an_envd_route_of_the_same_sandbox_or_are_refused(raw: bytes) -> None:
    _check(b"/" + raw)


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(sorted(ENVD_ROUTES)), st.sampled_from(_TOKENS), st.integers(min_value=0, max_value=40))
def test_an_envd_route_with_one_token_spliced_in_maps_to_itself_or_is_refused(
        route: str, token: str, at: int) -> None:
    at = min(at, len(route))
    _check(_encode(route[:at] + token + route[at:]))


@pytest.mark.parametrize("raw", [
    b"/../sbx_other/process.Process/Start", b"/..%2fsbx_other/process.Process/Start",
    b"/%2e%2e/%2e%2e/v1/sandboxes/sbx_other/exec", b"/%252e%252e/sbx_other/files", b"/..\\sbx_other/files",
    b"/files/../../sbx_other/files", b"//files", b"/./files", b"/files%00", b"/files\x00", b"/fi%6ces",
    b"/\xc0\xae\xc0\xae/files", b"/process.Process/Start/..", b"/process.Process/../../../metrics",
    b"/%2fprocess.Process/Start", b"/files/", b"/FILES",
])
def test_known_traversals_are_refused(raw: bytes) -> None:
    with pytest.raises(EnvdPathRefused):
        parse_envd_path(raw)
    _check(raw)
    assert _upstream_via_router(raw, [(b"e2b-sandbox-id", MINE.encode())]) is None


def test_every_envd_route_passes_unchanged() -> None:
    for route in ENVD_ROUTES:
        assert parse_envd_path(route.encode()) == route
        assert _upstream_via_router(route.encode(), [(b"e2b-sandbox-id", MINE.encode())]) == \
            f"/internal/e2b/{MINE}{route}"
        assert route_of(f"/internal/e2b/{MINE}{route}", {}) == (GrantKind.ENVD, MINE)


@pytest.mark.parametrize("sid", ["sbx_mine/../sbx_other", "sbx%5fmine", "..", "sbx mine", "sbx_mine\x00", ""])
def test_a_malformed_sandbox_id_is_refused(sid: str) -> None:
    assert _upstream_via_router(b"/files", [(b"e2b-sandbox-id", sid.encode("latin-1"))]) is None

