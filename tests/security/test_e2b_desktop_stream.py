"""The stream of E2B's desktop SDK (``stream.start()``: x11vnc behind noVNC on guest port 6080, reached at
``https://`` + ``get_host(6080)`` + ``/vnc.html``) with the unmodified ``e2b-desktop`` SDK against the
``e2b-desktop`` template (docs/computer-use.md, "E2B's desktop SDK").

Boundary: tenant vs tenant at the port edge (docs/SECURITY.md), for the desktop's stream. As on E2B, two locks:
the port edge (a sandbox created with ``allowPublicTraffic: false`` answers only its own
``e2b-traffic-access-token``: not none, not another tenant's sandbox's token, not another tenant's API key,
for noVNC's page and for its WebSocket alike), and the VNC server's password (``require_auth=True``: the
server offers VNC authentication alone, refuses a wrong password and takes the SDK's). Encoded paths stay in
noVNC's web root. Needs real microVMs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

e2b_desktop = pytest.importorskip("e2b_desktop")
e2b = pytest.importorskip("e2b")

# The e2e helpers (the template's build, podbay env --e2b, the RFB handshake) are shared with
# tests/e2e/test_e2b_desktop.py; pytest's prepend import mode puts only this folder on sys.path.
_E2E = str(Path(__file__).resolve().parents[1] / "e2e")
if _E2E not in sys.path:
    sys.path.insert(0, _E2E)

from e2b_desktop_support import build_e2b_desktop, e2b_exports, rfb_security_types  # noqa: E402


@pytest.fixture(scope="module")
def shell(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    build_e2b_desktop(stack)
    exports = e2b_exports(stack, tmp_path_factory.mktemp("client"))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in exports.items():
            mp.setenv(k, v)
        yield exports


def _other_tenant_key(stack: Any) -> str:
    from podbay.contracts.e2b import to_e2b_key

    api = Path(sys.executable).with_name("podbay-api")
    out = subprocess.run([str(api), "create-key", "--tenant", "desktop-other", "--name", "t"], env=stack.env,
                         capture_output=True, text=True, check=True, timeout=60)
    return to_e2b_key(str(json.loads(out.stdout)["key"]))


def test_the_stream_answers_its_own_sandbox_token_and_password_only(shell: dict[str, str], stack: Any) -> None:
    other_key = _other_tenant_key(stack)
    mine = e2b_desktop.Sandbox.create(timeout=900, network={"allow_public_traffic": False})
    theirs = e2b.Sandbox.create(template="base", timeout=600, network={"allow_public_traffic": False},
                                api_key=other_key)
    try:
        mine.stream.start(require_auth=True)
        password = mine.stream.get_auth_key()
        url = mine.stream.get_url(auth_key=password)
        ws_url = f"wss://{mine.get_host(6080)}/websockify"
        my_tok = {"e2b-traffic-access-token": str(mine.traffic_access_token)}
        their_tok = {"e2b-traffic-access-token": str(theirs.traffic_access_token)}
        with httpx.Client(timeout=60) as client:  # trust_env: SSL_CERT_FILE from the exports
            r = client.get(url, headers=my_tok)
            assert r.status_code == 200 and "noVNC" in r.text, r.text[:300]
            # The edge: no token, another tenant's sandbox's token, another tenant's API key: refused.
            assert client.get(url).status_code == 403
            assert client.get(url, headers=their_tok).status_code == 403
            assert client.get(url, headers={"authorization": f"Bearer {other_key}"}).status_code in (401, 403)
            # A Host naming my sandbox over their sandbox's TLS name (and token): misdirected, not served.
            r = client.get(f"https://{theirs.get_host(6080)}/vnc.html",
                           headers={"host": mine.get_host(6080), **their_tok})
            assert r.status_code == 421, r.text
            # Encoded and dotted paths stay inside noVNC's web root.
            for path in ("/..%2f..%2f..%2fetc/passwd", "/%2e%2e/%2e%2e/%2e%2e/etc/passwd", "/../../../etc/passwd"):
                r = client.get(f"https://{mine.get_host(6080)}{path}", headers=my_tok)
                assert "root:" not in r.text and r.status_code in (400, 403, 404), (path, r.status_code)
        for headers in ({}, their_tok, {"authorization": f"Bearer {other_key}"}):
            with pytest.raises(Exception, match="403|401"):  # websockets' InvalidStatus: the edge's refusal
                rfb_security_types(ws_url, headers)
        # The VNC server: VNC authentication alone, a wrong password refused, the SDK's taken.
        _, types, result = rfb_security_types(ws_url, my_tok, password="wrong-" + password[:4])
        assert types == [2] and result == 1, (types, result)
        _, types, result = rfb_security_types(ws_url, my_tok, password=password)
        assert types == [2] and result == 0, (types, result)
    finally:
        mine.kill()
        theirs.kill()
