"""End to end through the HTTP API: a real stack (NATS, PostgreSQL, S3, every service) and real microVMs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from e2e_http import api_client as _client

pytestmark = pytest.mark.e2e



def _other_tenant_key(stack: Any) -> str:
    api = Path(sys.executable).with_name("podbay-api")
    out = subprocess.run([str(api), "create-key", "--tenant", "other-tenant", "--name", "t"], env=stack.env,
                         capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["key"])


async def _events(nats_url: str, sandbox_id: str) -> list[dict[str, Any]]:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(f"podbay.evt.sandbox.{sandbox_id}.*", ordered_consumer=True)
        out: list[dict[str, Any]] = []
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                return out
            out.append(json.loads(msg.data))
    finally:
        await nc.close()


def test_create_exec_files_list_delete_with_events(stack: Any) -> None:
    with _client(stack) as c:
        r = c.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 201, r.text
        sb = r.json()
        sid = sb["id"]
        assert sb["state"] == "running"
        assert sb["generation"] >= 1 and sb["node_id"]

        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", "print(6*7)"]})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == "42\n" and r.json()["exit_code"] == 0

        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "echo oops >&2; exit 3"})
        assert r.json()["exit_code"] == 3 and r.json()["stderr"] == "oops\n"

        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["cat"], "stdin": "from stdin"})
        assert r.json()["stdout"] == "from stdin"

        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["id", "-un"], "user": "user", "cwd": "/home/user"})
        assert r.json()["stdout"] == "user\n"

        payload = os.urandom(5 << 20)
        r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/big.bin"}, content=payload)
        assert r.status_code == 200, r.text
        assert r.json()["size"] == len(payload)
        r = c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/big.bin"})
        assert r.status_code == 200
        assert r.content == payload
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sha256sum", "/tmp/big.bin"]})
        import hashlib

        assert r.json()["stdout"].split()[0] == hashlib.sha256(payload).hexdigest()

        listed = c.get("/v1/sandboxes").json()["sandboxes"]
        assert sid in [s["id"] for s in listed]

        r = c.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "deleted"
        assert sid not in [s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]]

    events = asyncio.run(_events(stack.nats_url, sid))
    types = [e["type"] for e in events]
    assert types == ["created", "started", "deleted"], types
    seqs = [e["data"]["seq"] for e in events]
    assert seqs == sorted(seqs)


def test_exec_stream_yields_output_as_produced(stack: Any) -> None:
    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        try:
            lines: list[tuple[float, dict[str, Any]]] = []
            import time

            with c.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                          json={"argv": ["sh", "-c", "echo a; sleep 1; echo b"]}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line:
                        lines.append((time.monotonic(), json.loads(line)))
            kinds = [e["type"] for _, e in lines]
            assert kinds[0] == "start" and kinds[-1] == "exit"
            outs = [(t, e["data"]) for t, e in lines if e["type"] == "stdout"]
            assert "".join(d for _, d in outs) == "a\nb\n"
            # "a" arrived as its own event, before "b" was written a second later.
            assert outs[0][1] == "a\n"
            assert outs[-1][0] - outs[0][0] > 0.5
            assert lines[-1][1]["exit_code"] == 0

            # Multi-byte characters split across chunks arrive intact (incremental UTF-8 decoding).
            text = ""
            with c.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                          json={"shell": "yes 'é世🚀' | head -n 30000"}) as r:
                for line in r.iter_lines():
                    ev = json.loads(line) if line else {}
                    if ev.get("type") == "stdout":
                        text += ev["data"]
            assert text == "é世🚀\n" * 30000

            # The fuller base: what `user` takes for granted (sudo without a password, curl, git, a `python`
            # command, venv with pip, a compiler), the locale and the time zone.
            # venv with pip, without installing pip (ensurepip's install took about 100 s under TCG): the venv is
            # made, its Python has ensurepip, ensurepip's wheels are in the interpreter's wheel directory (Debian
            # keeps them there), and the pip wheel it installs from runs on the venv's Python.
            venv = ("python -m venv --without-pip /tmp/venv;"
                    " /tmp/venv/bin/python -c 'import sys, ensurepip; print(sys.prefix, ensurepip.version())';"
                    " W=$(python -c 'import sysconfig; print(sysconfig.get_config_var(\"WHEEL_PKG_DIR\"))');"
                    " ls \"$W\"/setuptools-*.whl >/dev/null;"
                    " PYTHONPATH=$(ls \"$W\"/pip-*.whl) /tmp/venv/bin/python -m pip --version;")
            script = ("set -e; sudo -n true; curl --version | head -1; wget --version | head -1; git --version;"
                      f" python --version; {venv}"
                      " gcc --version | head -1; make --version | head -1; date +%Z; cat /etc/timezone;"
                      " . /etc/default/locale; echo LANG=$LANG; sudo -n id -un")
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": script, "user": "user", "cwd": "/home/user"})
            assert r.json()["exit_code"] == 0, r.text
            out = r.json()["stdout"].splitlines()
            assert out[0].startswith("curl ") and out[1].startswith("GNU Wget") and out[2].startswith("git version")
            assert out[3].startswith("Python 3.")
            prefix, bundled = out[4].split()
            assert prefix == "/tmp/venv", out[4]
            assert out[5].startswith(f"pip {bundled} from ") and f"/pip-{bundled}-" in out[5], out[5]
            assert out[6].startswith("gcc ") and out[7].startswith("GNU Make")
            assert out[8:] == ["UTC", "Etc/UTC", "LANG=C.UTF-8", "root"], out
            # The sandbox's own name resolves (sudo looks it up and complained on stderr when it did not), and
            # /etc/hostname is the ordinary file it is on Debian.
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={
                "shell": "sudo -n true; getent hosts $(hostname); hostname -f; stat -c %a /etc/hostname",
                "user": "user"})
            assert r.json()["exit_code"] == 0 and r.json()["stderr"] == "", r.text
            hostname = c.get(f"/v1/sandboxes/{sid}").json()["hostname"]
            assert r.json()["stdout"].split() == ["127.0.1.1", hostname, hostname, "644"], r.text
            # A full file system is 507 no_space, and the partial file is gone.
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "mkdir -p /mnt/tiny &&"
                                                                   " mount -t tmpfs -o size=1m tmpfs /mnt/tiny"})
            assert r.json()["exit_code"] == 0, r.text
            r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/mnt/tiny/big"}, content=b"x" * (2 << 20))
            assert r.status_code == 507 and r.json()["error"]["code"] == "no_space", r.text[:300]
            listing = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "ls -a /mnt/tiny"}).json()["stdout"]
            assert listing.split() == [".", ".."], listing
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_bad_input_gets_clear_errors_and_changes_nothing(stack: Any) -> None:
    with _client(stack) as c:
        before = c.get("/v1/sandboxes").json()["sandboxes"]

        r = c.post("/v1/sandboxes", json={"template": "no-such-template"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = c.post("/v1/sandboxes", json={"template": 12, "bogus": True})
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
        r = c.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
        for metadata in ({"k" * 129: "v"}, {"k": "v" * 1025}, {"": "v"}):
            r = c.post("/v1/sandboxes", json={"template": "base", "metadata": metadata})
            assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
        assert c.get("/v1/sandboxes").json()["sandboxes"] == before

    for headers in ({}, {"authorization": "Bearer pb_00000000_" + "0" * 40}, {"authorization": "Basic x"}):
        r = httpx.get(f"{stack.api_url}/v1/sandboxes", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text

    with _client(stack) as c:
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        r = c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/no/such/file"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        # Neither a directory nor a file without an end (a device would stream until the client gave out).
        for path in ("/tmp", "/dev/zero", "/dev/urandom"):
            with c.stream("GET", f"/v1/sandboxes/{sid}/files", params={"path": path}, timeout=60) as r:
                assert r.status_code == 400, (path, r.status_code)  # before any body: a device's has no end
                assert json.loads(r.read())["error"]["code"] == "invalid_request", path
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": []})
        assert r.status_code == 422

        with _client(stack, _other_tenant_key(stack)) as other:
            assert other.get(f"/v1/sandboxes/{sid}").status_code == 404
            assert other.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}).status_code == 404
            assert other.delete(f"/v1/sandboxes/{sid}").status_code == 404
            assert sid not in [s["id"] for s in other.get("/v1/sandboxes").json()["sandboxes"]]
        # the other tenant's attempts changed nothing
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"

        # a NUL byte cannot be PostgreSQL text: the client's mistake, answered 400, never 500
        for method, url, body in (("GET", "/v1/sandboxes/%00", None), ("DELETE", "/v1/sandboxes/a%00b", None),
                                  ("POST", "/v1/sandboxes/%00/exec", {"argv": ["true"]}),
                                  ("GET", "/v1/operations/%00", None),
                                  ("POST", f"/v1/sandboxes/{sid}/restore", {"snapshot_id": "a\u0000b"})):
            r = c.request(method, url, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (url, r.text)

        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 200
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
        assert r.json()["error"]["details"]["state"] == "deleted"
        r = c.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code == 409
        assert c.get("/v1/sandboxes/sbx_doesnotexist").status_code == 404

