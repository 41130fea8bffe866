"""E2B's ports by hostname through the TLS edge (services/api/edge/tls.py), with the unmodified ``e2b`` SDK and
httpx trusting only what ``podbay env --e2b`` exports: ``https://`` + ``Sandbox.get_host(port)`` reaches the
guest's server; without the traffic token (``allowPublicTraffic: false``), with another tenant's sandbox's token,
or with a Host naming another sandbox the edge refuses; a Host other than the TLS server name is 421.

Boundary: tenant vs tenant at the port edge, over HTTPS (docs/SECURITY.md). Needs real microVMs.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

e2b = pytest.importorskip("e2b")

SERVE = ("mkdir -p /tmp/tls && echo tls-{tag} > /tmp/tls/index.html && (setsid python3 -m http.server {port} "
         "--bind 0.0.0.0 --directory /tmp/tls >/dev/null 2>&1 </dev/null &)")


@pytest.fixture(scope="module")
def shell(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``eval "$(podbay env --e2b)"`` for a client config as ``podbay up`` writes it: the real CLI's exports,
    applied to this process's environment for the module (the SDK and httpx read them from there)."""
    cfg = tmp_path_factory.mktemp("client") / "config.json"
    cfg.write_text(json.dumps({"api_url": stack.api_url, "api_key": stack.api_key, **stack.edge_client()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODBAY_API_", "E2B_"))}
    env["PODBAY_CONFIG"] = str(cfg)
    out = subprocess.run([str(Path(sys.executable).with_name("podbay")), "env", "--e2b"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    exports = dict(shlex.split(line)[1].split("=", 1) for line in out.splitlines() if line.startswith("export "))
    assert {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "SSL_CERT_FILE"} <= set(exports)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in exports.items():
            mp.setenv(k, v)
        yield exports


def _other_tenant_key(stack: Any) -> str:
    from podbay.contracts.e2b import to_e2b_key

    api = Path(sys.executable).with_name("podbay-api")
    out = subprocess.run([str(api), "create-key", "--tenant", "tls-other", "--name", "t"], env=stack.env,
                         capture_output=True, text=True, check=True, timeout=60)
    return to_e2b_key(str(json.loads(out.stdout)["key"]))


# A public port takes at most `ports_public_rate_per_s` (50 by default) requests per second, shared by the TLS
# and the plain edge: the timing loops below stay under it (one request per 25 ms at most) so that a fast
# machine measures round trips, not the limiter's 429s. Only the request itself is timed.
_PACE_S = 0.025


def _timed_get(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> float:
    """One paced GET that must answer 200; its round trip in ms."""
    t0 = time.perf_counter()
    r = client.get(url, headers=headers or {})
    took = time.perf_counter() - t0
    assert r.status_code == 200, (r.status_code, r.text[:200])
    time.sleep(max(0.0, _PACE_S - took))
    return took * 1000


def _wait_ok(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    deadline = time.monotonic() + 90
    while True:
        r = client.get(url, headers=headers or {})
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


@pytest.fixture(scope="module")
def public_box(shell: dict[str, str]) -> Iterator[Any]:
    sb = e2b.Sandbox.create(template="base", timeout=600)
    try:
        sb.commands.run(SERVE.format(tag="public", port=8000))
        yield sb
    finally:
        sb.kill()


def test_get_host_is_reached_over_https_with_the_trust_podbay_env_exports(shell: dict[str, str],
                                                                          public_box: Any) -> None:
    host = public_box.get_host(8000)
    assert host == f"8000-{public_box.sandbox_id}.{shell['E2B_DOMAIN']}"
    with httpx.Client(timeout=60) as client:  # trust_env: SSL_CERT_FILE from the exports
        r = _wait_ok(client, f"https://{host}/index.html")
        assert r.status_code == 200 and r.text == "tls-public\n", r.text
        # The guest's server saw the request come through (its Host is the public name).
        assert r.url.scheme == "https"
    # Without that trust the edge's certificate is not accepted: the exports are what makes it work.
    with httpx.Client(timeout=60, trust_env=False) as bare, pytest.raises(httpx.ConnectError, match="CERTIFICATE"):
        bare.get(f"https://{host}/index.html")


def test_get_host_round_trip(shell: dict[str, str], public_box: Any) -> None:
    """p50/p99 of 40 GETs of a guest page through the TLS edge (keep-alive), of 20 on a new client each (a TLS
    handshake and the client's loading of the trust bundle each), and of 40 through the plain HTTP port edge;
    printed for the record, no bound asserted."""
    url = f"https://{public_box.get_host(8000)}/index.html"
    figures = {}
    with httpx.Client(timeout=60) as client:
        assert _wait_ok(client, url).status_code == 200
        figures["keepalive"] = [_timed_get(client, url) for _ in range(40)]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fresh = httpx.Client(timeout=60)  # its construction loads the trust bundle: timed too
        built_ms = (time.perf_counter() - t0) * 1000
        with fresh:
            times.append(built_ms + _timed_get(fresh, url))
    figures["new_connection"] = times
    # The same page through the plain HTTP port edge (Host header), for what TLS adds.
    api = os.environ["E2B_SANDBOX_URL"]
    with httpx.Client(timeout=60) as client:
        times = [_timed_get(client, f"{api}/index.html", {"host": url.split("/")[2]}) for _ in range(40)]
    figures["plain_http_keepalive"] = times
    for name, ts in figures.items():
        q = statistics.quantiles(ts, n=100, method="inclusive")
        print(f"get_host round trip ({name}, {len(ts)} requests): p50 {statistics.median(ts):.1f} ms, "
              f"p99 {q[98]:.1f} ms, max {max(ts):.1f} ms")


def test_private_ports_over_https_refuse_strangers_and_other_sandboxes(shell: dict[str, str], stack: Any) -> None:
    mine = e2b.Sandbox.create(template="base", timeout=600, network={"allow_public_traffic": False})
    theirs = e2b.Sandbox.create(template="base", timeout=600, network={"allow_public_traffic": False},
                                api_key=_other_tenant_key(stack))
    try:
        mine.commands.run(SERVE.format(tag="mine", port=8000))
        theirs.commands.run(SERVE.format(tag="theirs", port=8000))
        my_host, their_host = mine.get_host(8000), theirs.get_host(8000)
        my_tok = {"e2b-traffic-access-token": mine.traffic_access_token}
        their_tok = {"e2b-traffic-access-token": theirs.traffic_access_token}
        with httpx.Client(timeout=60) as client:
            r = _wait_ok(client, f"https://{my_host}/index.html", my_tok)
            assert r.status_code == 200 and r.text == "tls-mine\n", r.text
            assert _wait_ok(client, f"https://{their_host}/index.html", their_tok).text == "tls-theirs\n"
            # No token: 403, as E2B answers.
            r = client.get(f"https://{my_host}/index.html")
            assert r.status_code == 403, r.text
            # Another tenant's sandbox's token does not open mine, nor my token theirs.
            assert client.get(f"https://{my_host}/index.html", headers=their_tok).status_code == 403
            assert client.get(f"https://{their_host}/index.html", headers=my_tok).status_code == 403
            # Another tenant's API key is refused too.
            other_key = {"authorization": f"Bearer {shell['E2B_API_KEY']}"}
            assert client.get(f"https://{their_host}/index.html", headers=other_key).status_code in (401, 403)
            # A Host naming their sandbox over a connection opened (SNI) for mine: 421, whatever the token.
            for tok in (my_tok, their_tok):
                r = client.get(f"https://{my_host}/index.html", headers={"host": their_host, **tok})
                assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", r.text
            # Encoded and dotted paths stay inside the sandbox's own server.
            r = client.get(f"https://{my_host}/..%2f..%2fetc/passwd", headers=my_tok)
            assert r.status_code == 404 and "root:" not in r.text
    finally:
        mine.kill()
        theirs.kill()



def test_a_paused_sandbox_created_with_auto_resume_wakes_on_an_https_request(shell: dict[str, str]) -> None:
    sb = e2b.Sandbox.create(template="base", timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.commands.run(SERVE.format(tag="wakes", port=8000))
        url = f"https://{sb.get_host(8000)}/index.html"
        with httpx.Client(timeout=300) as client:
            assert _wait_ok(client, url).text == "tls-wakes\n"
            sb.pause()
            assert not sb.is_running()
            r = client.get(url)  # the edge resumes it, as E2B's proxy does for autoResume
            assert r.status_code == 200 and r.text == "tls-wakes\n", r.text
        assert sb.is_running()
    finally:
        sb.kill()
