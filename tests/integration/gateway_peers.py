"""Helper processes for tests/integration/test_gateway_egress.py, run inside network namespaces with
``ip netns exec`` (not a test module).

``python gateway_peers.py upstream CERT KEY LOG``: HTTPS on 443 and HTTP on 80 that answer every request
with a JSON echo of the headers received; the ``Authorization`` header it received is also sent back in the
response header ``X-Echo-Authorization`` and appended to LOG (so the test can prove the value reached the
destination while the guest saw only the redacted form).

``python gateway_peers.py relay SPEC...``: TCP relays between network namespaces, each SPEC
``LISTEN_NS:PORT=TARGET_NS:PORT`` (``-`` is this process's namespace): it listens on 127.0.0.1:PORT inside
LISTEN_NS and connects each client to 127.0.0.1:PORT inside TARGET_NS (so the gateway, in its own "node"
namespace, reaches the test's PostgreSQL and NATS, and the test reaches the gateway's health port).

``python gateway_peers.py client JSON``: one client operation, result as JSON on stdout:
``{"op": "dns", "server": ip, "name": n, "qtype": "A"}`` -> ``{"rcode", "addrs"}``;
``{"op": "https", "addr", "port", "sni", "path", "cafile"}`` -> ``{"status", "headers", "body"}`` or
``{"error"}``; ``{"op": "http", "addr", "port", "host", "path"}`` likewise (both take ``"headers"`` to send); ``{"op": "raw", "addr",
"port", "send": true}`` -> ``{"closed": bool, "data"}`` (connects, sends a line unless ``send`` is false, and
reads until EOF or the timeout).
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _upstream(cert: str, key: str, log_path: str) -> None:
    lock = threading.Lock()

    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            auth = self.headers.get("Authorization", "")
            if auth:
                with lock, open(log_path, "a") as f:
                    f.write(f"{self.path} {auth}\n")
            body = json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if auth:
                self.send_header("X-Echo-Authorization", auth)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    https = ThreadingHTTPServer(("0.0.0.0", 443), Echo)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    https.socket = ctx.wrap_socket(https.socket, server_side=True)
    plain = ThreadingHTTPServer(("0.0.0.0", 80), Echo)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    print("ready", flush=True)
    https.serve_forever()


def _in_ns(ns: str, fn):  # type: ignore[no-untyped-def]
    """Run ``fn()`` in a fresh thread that first enters network namespace ``ns`` (setns is per thread)."""
    import ctypes

    out: dict = {}

    def run() -> None:
        try:
            if ns != "-":
                libc = ctypes.CDLL(None, use_errno=True)
                with open(f"/var/run/netns/{ns}") as f:
                    if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                        raise OSError(ctypes.get_errno(), f"setns {ns}")
            out["v"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["e"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out["v"]


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _relay(specs: list[str]) -> None:
    def serve(listener: socket.socket, target_ns: str, target_port: int) -> None:
        while True:
            conn, _ = listener.accept()
            try:
                up = _in_ns(target_ns, lambda: socket.create_connection(("127.0.0.1", target_port), timeout=10))
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            threading.Thread(target=_pipe, args=(conn, up), daemon=True).start()
            threading.Thread(target=_pipe, args=(up, conn), daemon=True).start()

    threads = []
    for spec in specs:
        left, right = spec.split("=")
        lns, lport = left.rsplit(":", 1)
        tns, tport = right.rsplit(":", 1)

        def listen(port: int = int(lport)) -> socket.socket:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(128)
            return s

        listener = _in_ns(lns, listen)
        t = threading.Thread(target=serve, args=(listener, tns, int(tport)), daemon=True)
        t.start()
        threads.append(t)
    print("ready", flush=True)
    for t in threads:
        t.join()


def _read_http(sock: socket.socket | ssl.SSLSocket) -> dict:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return {"status": status, "headers": headers, "body": body.decode("utf-8", "replace")}


def _request(host: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nUser-Agent: podbay-test\r\n{extra}"
            "\r\n").encode()


def _client(op: dict) -> dict:
    kind = op["op"]
    if kind == "dns":
        import dns.message
        import dns.query
        import dns.rcode

        q = dns.message.make_query(op["name"], op.get("qtype", "A"))
        r = dns.query.udp(q, op["server"], port=53, timeout=5)
        addrs = [rd.to_text() for rrset in r.answer for rd in rrset]
        return {"rcode": dns.rcode.to_text(r.rcode()), "addrs": addrs}
    timeout = float(op.get("timeout", 8))
    try:
        sock = socket.create_connection((op["addr"], int(op["port"])), timeout=timeout)
    except OSError as exc:
        return {"error": f"connect: {exc}"}
    try:
        if kind == "raw":
            try:
                if op.get("send", True):
                    sock.sendall(b"hello\r\n")
                data = sock.recv(4096)
                return {"closed": data == b"", "data": data.decode("latin-1")}
            except (ConnectionResetError, BrokenPipeError):
                return {"closed": True, "data": ""}
            except TimeoutError:
                return {"closed": False, "data": ""}
        if kind == "https":
            ctx = ssl.create_default_context(cafile=op["cafile"])  # with a cafile: no system roots
            try:
                tsock = ctx.wrap_socket(sock, server_hostname=op["sni"])
            except (ssl.SSLError, OSError) as exc:
                return {"error": f"tls: {type(exc).__name__}: {exc}"}
            issuer = dict(x[0] for x in tsock.getpeercert().get("issuer", ()))
            tsock.sendall(_request(op.get("host", op["sni"]), op.get("path", "/"), op.get("headers")))
            out = _read_http(tsock)
            out["issuer_cn"] = issuer.get("commonName", "")
            return out
        sock.sendall(_request(op["host"], op.get("path", "/"), op.get("headers")))
        return _read_http(sock)
    except (OSError, ssl.SSLError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        sock.close()


if __name__ == "__main__":
    if sys.argv[1] == "upstream":
        _upstream(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "relay":
        _relay(sys.argv[2:])
    else:
        print(json.dumps(_client(json.loads(sys.argv[2]))))
