"""Guest ports through the API's edge, with real VMs (docs/SPECIFICATION.md "Ports").

One sandbox is shared by the tests of this module (servers started in it stay up between tests); the
paused-wake test runs last among those that need it running. Requests use the stack's API address with the
``Host`` header of the host form (``{port}-{label}.localhost``), which a browser or curl would resolve to
loopback by itself, or the path form ``/ports/{port}-{label}/``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, new_sandbox, sh, until
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

pytestmark = pytest.mark.e2e

# A WebSocket echo server on the guest's standard library (RFC 6455: handshake, unmasked replies; text and
# binary frames, up to 64 KiB, are sent back as they came; a close frame is answered and ends the session).
WS_ECHO = r'''
import base64, hashlib, socket, struct, threading, sys
def serve(c):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(4096)
        if not chunk:
            return
        data += chunk
    key = [l.split(b":", 1)[1].strip() for l in data.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    f = c.makefile("rb")
    while True:
        h = f.read(2)
        if len(h) < 2:
            return
        op, n = h[0] & 0x0F, h[1] & 0x7F
        if n == 126:
            n = struct.unpack("!H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", f.read(8))[0]
        mask = f.read(4)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        head = bytes([0x80 | op])
        head += bytes([len(body)]) if len(body) < 126 else bytes([126]) + struct.pack("!H", len(body))
        c.sendall(head + body)
        if op == 8:
            return
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


def _label(sid: str) -> str:
    return sid.replace("_", "-")


def _host(port: int, sid: str) -> str:
    return f"{port}-{_label(sid)}.localhost"


def _other_tenant_key(stack: Any) -> str:
    api = Path(sys.executable).with_name("podbay-api")
    out = subprocess.run([str(api), "create-key", "--tenant", "ports-other", "--name", "t"], env=stack.env,
                         capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["key"])


def _serve_http(c: httpx.Client, sid: str, port: int) -> None:
    sh(c, sid, f"mkdir -p /srv/{port} && echo hello-{port} > /srv/{port}/index.txt && "
               f"(setsid python3 -m http.server {port} --bind 0.0.0.0 --directory /srv/{port} "
               f">/dev/null 2>&1 </dev/null &)")


@pytest.fixture(scope="module")
def box(stack: Any) -> Iterator[tuple[httpx.Client, str, str]]:
    """(API client, sandbox id, its traffic token) with an HTTP server on 8000."""
    with api_client(stack) as c, new_sandbox(c) as sid:
        _serve_http(c, sid, 8000)
        r = c.get(f"/v1/sandboxes/{sid}/ports/8000/url")
        assert r.status_code == 200, r.text
        token = r.json()["token"]
        assert r.json()["url"].startswith(f"http://8000-{_label(sid)}.localhost:")
        yield c, sid, token


def _get(stack: Any, port: int, sid: str, path: str = "/index.txt", **kw: Any) -> httpx.Response:
    headers = {"host": _host(port, sid), **kw.pop("headers", {})}
    return httpx.get(f"{stack.api_url}{path}", headers=headers, timeout=120, **kw)


def test_an_http_server_is_reached_with_the_token_and_refused_without(stack: Any, box: Any) -> None:
    c, sid, token = box
    until("the guest's server answers", lambda: _get(stack, 8000, sid, headers={
        "x-podbay-access-token": token}).status_code == 200, 60)
    r = _get(stack, 8000, sid, headers={"x-podbay-access-token": token})
    assert r.text == "hello-8000\n"
    assert _get(stack, 8000, sid).status_code == 401
    assert _get(stack, 8000, sid, headers={"x-podbay-access-token": "0" * 64}).status_code == 403
    # The tenant's API key opens it too; the path form reaches the same server.
    assert _get(stack, 8000, sid, headers={"authorization": f"Bearer {stack.api_key}"}).text == "hello-8000\n"
    r = httpx.get(f"{stack.api_url}/ports/8000-{_label(sid)}/index.txt", headers={"x-podbay-access-token": token})
    assert r.status_code == 200 and r.text == "hello-8000\n"
    # A link with ?podbay_token= is exchanged once for a cookie, which then opens the port.
    r = _get(stack, 8000, sid, path=f"/index.txt?podbay_token={token}")
    assert r.status_code == 303 and r.headers["location"] == "/index.txt"
    cookie = r.headers["set-cookie"].split(";")[0]
    assert _get(stack, 8000, sid, headers={"cookie": cookie}).text == "hello-8000\n"
    # The listing shows it, reachable from outside (it listens on 0.0.0.0).
    ports = {p["port"]: p for p in c.get(f"/v1/sandboxes/{sid}/ports").json()["ports"]}
    assert ports[8000]["listening"] and ports[8000]["reachable"] and not ports[8000]["public"]


def test_a_port_that_starts_listening_later_is_reached(stack: Any, box: Any) -> None:
    c, sid, token = box
    r = _get(stack, 8001, sid, headers={"x-podbay-access-token": token, "accept": "application/json"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_open", r.text
    page = _get(stack, 8001, sid, headers={"x-podbay-access-token": token, "accept": "text/html"})
    assert page.status_code == 502 and "port_not_open" in page.text and page.headers["content-type"].startswith(
        "text/html")
    _serve_http(c, sid, 8001)
    r = until("the later server answers", lambda: (x := _get(stack, 8001, sid, headers={
        "x-podbay-access-token": token})).status_code == 200 and x, 60)
    assert r.text == "hello-8001\n"


def test_a_server_on_the_guests_loopback_only_is_named_in_the_refusal(stack: Any, box: Any) -> None:
    c, sid, token = box
    sh(c, sid, "(setsid python3 -m http.server 8007 --bind 127.0.0.1 --directory /tmp >/dev/null 2>&1 </dev/null &)")
    until("the loopback server listens", lambda: any(
        p["port"] == 8007 for p in c.get(f"/v1/sandboxes/{sid}/ports").json()["ports"]), 60)
    r = _get(stack, 8007, sid, headers={"x-podbay-access-token": token, "accept": "application/json"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_open", r.text
    assert "listens only on 127.0.0.1" in r.json()["error"]["message"], r.text


def test_a_websocket_echo_works(stack: Any, box: Any) -> None:
    c, sid, token = box
    r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/ws_echo.py"}, content=WS_ECHO.encode())
    assert r.status_code == 200, r.text
    sh(c, sid, "(setsid python3 /root/ws_echo.py 8002 >/tmp/ws.log 2>&1 </dev/null &)")
    url = stack.api_url.replace("http://", "ws://") + f"/ports/8002-{_label(sid)}/echo"

    def opened() -> bool:
        try:
            with ws_connect(url, additional_headers={"x-podbay-access-token": token}, open_timeout=30) as ws:
                ws.send("ping")
                return ws.recv(timeout=30) == "ping"
        except Exception:
            return False

    until("the echo server answers", opened, 60)
    with ws_connect(url, additional_headers={"x-podbay-access-token": token}, open_timeout=30) as ws:
        ws.send("hello")
        assert ws.recv(timeout=30) == "hello"
        ws.send(b"\x00\x01binary" * 100)
        assert ws.recv(timeout=30) == b"\x00\x01binary" * 100
    with pytest.raises(InvalidStatus) as refused:
        with ws_connect(url, open_timeout=30):
            pass
    assert refused.value.response.status_code == 401  # no token: the handshake is refused


def test_http2_from_the_client_at_the_edge(stack: Any, box: Any) -> None:
    c, sid, token = box
    sh(c, sid, "head -c 4194304 /dev/urandom > /srv/8000/h2.bin && sha256sum /srv/8000/h2.bin > /srv/8000/h2.sum")
    want = sh(c, sid, "cut -d' ' -f1 /srv/8000/h2.sum").strip()
    headers = {"host": _host(8000, sid), "x-podbay-access-token": token}
    # Prior knowledge: the client speaks HTTP/2 from its first byte (h2c), to the API's HTTP/2 listener.
    with httpx.Client(base_url=stack.api_h2_url, http1=False, http2=True, timeout=120) as h2:
        r = until("the guest's server answers over HTTP/2",
                  lambda: (x := h2.get("/index.txt", headers=headers)).status_code == 200 and x, 60)
        assert r.http_version == "HTTP/2" and r.text == "hello-8000\n"
        r = h2.get(f"/ports/8000-{_label(sid)}/index.txt", headers={"x-podbay-access-token": token})
        assert r.http_version == "HTTP/2" and r.text == "hello-8000\n"
        assert h2.get("/index.txt", headers={"host": _host(8000, sid)}).status_code == 401
        digest = hashlib.sha256()
        with h2.stream("GET", "/h2.bin", headers=headers) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            for chunk in r.iter_raw(1 << 16):
                digest.update(chunk)
        assert digest.hexdigest() == want


def _vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_a_100_mib_download_streams_with_bounded_memory_on_the_edge(stack: Any, box: Any) -> None:
    c, sid, token = box
    sh(c, sid, "head -c 104857600 /dev/zero > /srv/8000/big.bin")
    api = stack.pid("api")
    assert api is not None
    Path(f"/proc/{api}/clear_refs").write_text("5")  # resets the peak resident size (VmHWM) to the current
    before = _vm_kib(api, "VmRSS")
    total = 0
    with httpx.stream("GET", f"{stack.api_url}/big.bin", headers={"host": _host(8000, sid),
                      "x-podbay-access-token": token}, timeout=600) as r:
        assert r.status_code == 200 and r.headers["content-length"] == str(100 << 20)
        for chunk in r.iter_raw(1 << 16):
            total += len(chunk)
    assert total == 100 << 20
    # Streamed, not held: the API's peak grew by far less than the body (a few chunks and buffers).
    assert _vm_kib(api, "VmHWM") - before < 32 << 10, (before, _vm_kib(api, "VmHWM"))


def test_another_tenants_token_or_key_never_opens_the_sandbox(stack: Any, box: Any) -> None:
    c, sid, _ = box
    key = _other_tenant_key(stack)
    assert _get(stack, 8000, sid, headers={"authorization": f"Bearer {key}"}).status_code == 403
    with api_client(stack, key) as other, new_sandbox(other) as theirs:
        their_token = other.get(f"/v1/sandboxes/{theirs}/ports/8000/url").json()["token"]
        assert _get(stack, 8000, sid, headers={"x-podbay-access-token": their_token}).status_code == 403
        # Nor can they read our URL, token or setting.
        assert other.get(f"/v1/sandboxes/{sid}/ports/8000/url").status_code == 404
        assert other.put(f"/v1/sandboxes/{sid}/ports/8000", json={"public": True}).status_code == 404


def test_a_public_port_needs_no_token_and_each_change_is_audited(stack: Any, box: Any) -> None:
    c, sid, _ = box
    assert c.put(f"/v1/sandboxes/{sid}/ports/8000", json={"public": True}).json() == {"port": 8000, "public": True}
    try:
        assert _get(stack, 8000, sid).text == "hello-8000\n"
    finally:
        assert c.put(f"/v1/sandboxes/{sid}/ports/8000", json={"public": False}).status_code == 200
    assert _get(stack, 8000, sid).status_code == 401
    actions = [e["action"] for e in c.get("/v1/audit", params={"sandbox_id": sid}).json()["entries"]]
    assert "sandbox.port.public" in actions and "sandbox.port.private" in actions


def test_a_paused_sandbox_wakes_on_a_request(stack: Any, box: Any) -> None:
    c, sid, token = box
    r = c.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    r = _get(stack, 8000, sid, headers={"x-podbay-access-token": token})
    assert r.status_code == 200 and r.text == "hello-8000\n"
    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"



def test_the_sdk_and_cli_list_ports_and_print_the_url_and_token(stack: Any, box: Any) -> None:
    _, sid, token = box
    from podbay import Sandbox

    sb = Sandbox.connect(sid, api_url=stack.api_url, api_key=stack.api_key)
    assert 8000 in [p.port for p in sb.ports().ports if p.listening]
    assert sb.url(8000).token == token
    env = {**stack.env, "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": stack.api_key}
    exe = Path(sys.executable).with_name("podbay")
    out = subprocess.run([str(exe), "sandbox", "url", sid, "8000"], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out[0].startswith(f"http://8000-{_label(sid)}.localhost:") and out[2].endswith(token)
    out = subprocess.run([str(exe), "sandbox", "ports", sid], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "8000" in out and "private" in out


# Answers /index.txt with "e2b", any other GET with the Host header it got, and a WebSocket handshake with one
# text message: that Host.
HOST_ECHO = r'''
import base64, hashlib, http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        host = self.headers.get("Host", "")
        key = self.headers.get("Sec-WebSocket-Key")
        if key:
            accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept.decode())
            self.end_headers()
            data = host.encode()
            self.wfile.write(bytes([0x81, len(data)]) + data)
            self.wfile.flush()
            while self.rfile.read(1):  # until the client goes
                pass
            self.close_connection = True
            return
        body = b"e2b\n" if self.path == "/index.txt" else host.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
'''


def test_e2b_get_host_and_its_traffic_access_token(stack: Any, box: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import e2b

    _, podbay_sid, _ = box
    domain = stack.env["PODBAY_E2B_DOMAIN"]
    # A podbay sandbox is not opened through E2B's hosts without a token.
    r = httpx.get(f"{stack.api_url}/index.txt", headers={"host": f"8000-{podbay_sid}.{domain}"}, timeout=60)
    assert r.status_code == 403, r.text
    for k, v in {"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_SANDBOX_URL": stack.api_url,
                 "E2B_API_KEY": stack.api_key}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(e2b.SandboxException, match="httpsPorts"):  # refused, not ignored
        e2b.Sandbox.create(template="base", network={"https_ports": [3000]})
    sb = e2b.Sandbox.create(template="base", timeout=600, network={"allow_public_traffic": False,
                                                                   "mask_request_host": "localhost:${PORT}"})
    try:
        assert sb.traffic_access_token
        sb.files.write("/tmp/host_echo.py", HOST_ECHO)
        sb.commands.run("(setsid python3 /tmp/host_echo.py 8003 >/dev/null 2>&1 </dev/null &)")
        host = sb.get_host(8003)
        assert host == f"8003-{sb.sandbox_id}.{domain}"
        tok = {"e2b-traffic-access-token": sb.traffic_access_token}

        def get(headers: dict[str, str], path: str = "/index.txt") -> httpx.Response:
            return httpx.get(f"{stack.api_url}{path}", headers={"host": host, **headers}, timeout=60)

        r = until("E2B's host answers", lambda: (x := get(tok)).status_code == 200 and x, 60)
        assert r.text == "e2b\n"
        assert get({}).status_code == 403
        assert get({"e2b-traffic-access-token": "0" * 64}).status_code == 403
        # maskRequestHost: the guest's server sees that Host, "${PORT}" replaced, over HTTP and WebSocket.
        assert get(tok, "/host").text == "localhost:8003"
        ws_url = stack.api_url.replace("http://", "ws://") + "/ws"
        with ws_connect(ws_url, additional_headers={"e2b-sandbox-id": sb.sandbox_id, "e2b-sandbox-port": "8003",
                                                    **tok}, open_timeout=30) as ws:
            assert ws.recv(timeout=30) == "localhost:8003"
    finally:
        sb.kill()


def test_a_suspended_sandbox_wakes_from_object_storage_on_a_request(stack: Any, box: Any) -> None:
    c, sid, token = box
    r = c.post(f"/v1/sandboxes/{sid}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
    r = _get(stack, 8000, sid, headers={"x-podbay-access-token": token})
    assert r.status_code == 200 and r.text == "hello-8000\n"  # the server's process came back with the guest
    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


# A guest server whose every answer is the start of a chunked stream that never ends (connections kept open).
ENDLESS = r'''
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
kept = []
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n6\r\nstart\n\r\n")
    kept.append(c)
'''


def test_streams_end_when_the_sandbox_is_deleted(stack: Any) -> None:
    """A response streaming from a guest's port, and a streamed exec, end soon after the sandbox is deleted
    (the node cuts what it relays when the sandbox leaves: services/nodeagent/net/ports.py ``PortsProxy.left``),
    rather than hanging while TCP waits for a guest that is gone. The time each took is printed."""
    import threading
    import time

    with api_client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        try:
            sh(c, sid, f"cat > /tmp/endless.py <<'EOF'\n{ENDLESS}\nEOF\n"
                       "(setsid python3 /tmp/endless.py 8100 >/dev/null 2>&1 </dev/null &)")
            headers = {"host": _host(8100, sid), "authorization": f"Bearer {stack.api_key}"}
            until("the endless server listens", lambda: any(
                p["port"] == 8100 and p["listening"] for p in c.get(f"/v1/sandboxes/{sid}/ports").json()["ports"]),
                  60)
            exec_out: list[object] = []

            def streamed_exec() -> None:
                try:
                    with httpx.stream("POST", f"{stack.api_url}/v1/sandboxes/{sid}/exec/stream",
                                      json={"shell": "echo begun; sleep 600"},
                                      headers={"authorization": f"Bearer {stack.api_key}"},
                                      timeout=httpx.Timeout(None, connect=30)) as resp:
                        for line in resp.iter_lines():
                            exec_out.append(line)
                    exec_out.append("ended")
                except httpx.HTTPError as exc:
                    exec_out.append(exc)

            worker = threading.Thread(target=streamed_exec, daemon=True)
            worker.start()
            until("the streamed exec runs", lambda: any("begun" in str(x) for x in exec_out), 120)
            with httpx.stream("GET", f"{stack.api_url}/", headers=headers,
                              timeout=httpx.Timeout(None, connect=30)) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                assert next(lines) == "start"
                t0 = time.monotonic()
                assert c.delete(f"/v1/sandboxes/{sid}").status_code in (200, 202, 204)
                with pytest.raises(httpx.RemoteProtocolError):
                    for _ in lines:
                        pass
                print(f"port stream cut {time.monotonic() - t0:.1f} s after the delete was sent", flush=True)
            worker.join(300)
            assert not worker.is_alive(), "the streamed exec did not end after the delete"
            print(f"streamed exec ended {time.monotonic() - t0:.1f} s after the delete: {exec_out[-1]!r}", flush=True)
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
