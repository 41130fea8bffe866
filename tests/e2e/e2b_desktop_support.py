"""What the tests of E2B's desktop SDK against the ``e2b-desktop`` template share (tests/e2e/test_e2b_desktop.py,
tests/security/test_e2b_desktop_stream.py; docs/computer-use.md, "E2B's desktop SDK"): the template's build,
``podbay env --e2b``'s exports, and the first messages of the VNC server through noVNC's WebSocket."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect
from websockets.typing import Subprotocol

from podbay.sdk import Client

__all__ = ["NAME", "PNG_MAGIC", "SCREEN", "build_e2b_desktop", "e2b_exports", "rfb_security_types"]

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
NAME = "e2b-desktop"
#: What the RUN steps need: Debian's mirror (the guest's apt sources), over HTTP.
EGRESS = {"allow": [{"domain": "deb.debian.org", "ports": [80]}]}
#: The resources of podbay's ``desktop`` template (desktop_support.py), so that its install layer, built on
#: chromium resized to these, is the cached one (templates/e2b-desktop/Dockerfile).
MEMORY_MIB = 1024
DISK_MIB = 3072
#: The SDK's default screen (``Sandbox.create(resolution=None)``).
SCREEN = (1024, 768)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def build_e2b_desktop(stack: Any) -> None:
    """Build ``chromium`` and then ``e2b-desktop`` (FROM chromium) on ``stack`` by its dev key (the operator's:
    shared); each build's events are printed (a long build's progress) and its duration (a figure)."""
    def show(e: Any) -> None:
        print(e.model_dump_json(exclude_none=True), flush=True)

    with Client(stack.api_url, stack.api_key, timeout_s=3600) as c:
        c.build_template("chromium", TEMPLATES / "chromium" / "Dockerfile", TEMPLATES / "chromium", egress=EGRESS,
                         on_event=show)
        t0 = time.monotonic()
        tpl = c.build_template(NAME, TEMPLATES / NAME / "Dockerfile", TEMPLATES / NAME, egress=EGRESS,
                               memory_mib=MEMORY_MIB, disk_mib=DISK_MIB, on_event=show)
        print(f"{NAME} build: {time.monotonic() - t0:.1f} s", flush=True)
    assert tpl.memory_mib == MEMORY_MIB


def e2b_exports(stack: Any, config_dir: Path) -> dict[str, str]:
    """What ``eval "$(podbay env --e2b)"`` sets for a client config as ``podbay up`` writes it (the real CLI's
    exports: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, E2B_DOMAIN, SSL_CERT_FILE)."""
    cfg = config_dir / "config.json"
    cfg.write_text(json.dumps({"api_url": stack.api_url, "api_key": stack.api_key, **stack.edge_client()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODBAY_API_", "E2B_"))}
    env["PODBAY_CONFIG"] = str(cfg)
    out = subprocess.run([str(Path(sys.executable).with_name("podbay")), "env", "--e2b"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    exports = dict(shlex.split(line)[1].split("=", 1) for line in out.splitlines() if line.startswith("export "))
    assert {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "SSL_CERT_FILE"} <= set(exports)
    return exports


def rfb_security_types(url: str, headers: dict[str, str] | None = None,
                       password: str | None = None) -> tuple[bytes, list[int], int | None]:
    """Through the WebSocket at ``url`` (websockify's, binary frames; TLS trusted as ``SSL_CERT_FILE`` says):
    the VNC server's RFB version line, the security types it offers after the client's ``RFB 003.008``, and,
    when ``password`` is given and type 2 (VNC authentication) is offered, the SecurityResult of answering its
    challenge with that password (0 accepted, 1 refused) (RFC 6143 §7.1.1-7.1.3, §7.2.2)."""
    buf = bytearray()
    with connect(url, additional_headers=headers or {}, subprotocols=[Subprotocol("binary")],
                 open_timeout=60) as ws:

        def take(n: int) -> bytes:
            while len(buf) < n:
                msg = ws.recv(timeout=60)
                assert isinstance(msg, bytes), msg
                buf.extend(msg)
            out = bytes(buf[:n])
            del buf[:n]
            return out

        version = take(12)
        ws.send(b"RFB 003.008\n")
        count = take(1)[0]
        types = list(take(count)) if count else []
        result = None
        if password is not None and 2 in types:
            ws.send(bytes([2]))
            ws.send(_vnc_response(password, take(16)))
            result = int.from_bytes(take(4), "big")
    return version, types, result


def _vnc_response(password: str, challenge: bytes) -> bytes:
    """VNC authentication's answer: ``challenge`` encrypted with DES under the password's first 8 bytes
    (zero-padded), each byte's bits reversed, as VNC servers expect (RFC 6143 §7.2.2 leaves the key's bit
    order to RFB's history)."""
    from cryptography.hazmat.decrepit.ciphers.algorithms import TripleDES
    from cryptography.hazmat.primitives.ciphers import Cipher, modes

    key = bytes(int(f"{b:08b}"[::-1], 2) for b in password.encode()[:8].ljust(8, b"\0"))
    enc = Cipher(TripleDES(key * 3), modes.ECB()).encryptor()  # three equal keys: single DES
    return enc.update(challenge) + enc.finalize()
