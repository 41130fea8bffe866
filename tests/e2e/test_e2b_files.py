"""E2B's file behaviours through the unmodified ``e2b`` SDK against the real stack and microVMs, as E2B's own
suite checks them (packages/python-sdk/tests/sync/sandbox_sync/files): metadata, symlinks, the synchronous
watcher, signed URLs of a ``secure=True`` sandbox. The SDK is pointed at the stack as tests/e2e/test_e2b.py
does it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

e2b = pytest.importorskip("e2b")


@pytest.fixture(scope="module")
def sbx(stack: Any) -> Iterator[Any]:
    env = {"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_SANDBOX_URL": stack.api_url, "E2B_API_KEY": stack.api_key}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    sb = e2b.Sandbox.create(template="base", timeout=600, secure=True)
    try:
        yield sb
    finally:
        try:
            sb.kill()
        finally:
            mp.undo()


def test_file_metadata_on_write_write_files_rename_and_overwrite(sbx: Any) -> None:
    """E2B's metadata tests (test_metadata.py): returned on write (multipart and octet-stream) and by
    write_files, kept by rename, dropped by an overwrite without it, and set out of band as user.e2b.*."""
    meta = {"author": "mish", "purpose": "upload"}
    assert sbx.files.write("m1.txt", "x", metadata=meta).metadata == meta
    assert sbx.files.write("m2.txt", "x", metadata=meta, use_octet_stream=True).metadata == meta
    assert sbx.files.get_info("m2.txt").metadata == meta
    infos = sbx.files.write_files([{"path": "m3.txt", "data": "a"}, {"path": "m4.txt", "data": "b"}],
                                  metadata={"source": "suite"})
    assert [i.metadata for i in infos] == [{"source": "suite"}] * 2
    assert sbx.files.rename("m1.txt", "m1-renamed.txt").metadata == meta
    assert sbx.files.write("m2.txt", "again").metadata is None
    assert sbx.files.get_info("m2.txt").metadata is None
    path = sbx.commands.run("realpath m3.txt").stdout.strip()
    sbx.commands.run(f"python3 -c \"import os; os.setxattr('{path}', 'user.e2b.author', b'out-of-band')\"")
    assert sbx.files.get_info("m3.txt").metadata == {"source": "suite", "author": "out-of-band"}


def test_get_info_of_a_symlink_reports_its_target(sbx: Any) -> None:
    """E2B's test_file_symlink: the link's type is its target's, symlink_target the absolute resolved path."""
    sbx.files.make_dir("link-dir")
    sbx.files.write("link-dir/test.txt", "Hello")
    sbx.commands.run("ln -s test.txt to_file.txt && ln -s /home/user/link-dir to_dir", cwd="link-dir")
    info = sbx.files.get_info("link-dir/to_file.txt")
    assert info.type == e2b.FileType.FILE and info.symlink_target == "/home/user/link-dir/test.txt"
    listed = {e.name: e for e in sbx.files.list("link-dir")}
    assert listed["to_dir"].type == e2b.FileType.DIR and listed["to_dir"].symlink_target == "/home/user/link-dir"
    assert listed["test.txt"].symlink_target is None


def test_sync_watch_sees_a_write_at_once(sbx: Any) -> None:
    """E2B's sync watch tests: get_new_events right after files.write has that write's events (create, chmod,
    write for a new file), recursive ones named from the watched directory."""
    sbx.files.make_dir("w-sync/nested")
    sbx.files.write("w-sync/old.txt", "old")
    handle = sbx.files.watch_dir("w-sync", include_entry=True)
    sbx.files.write("w-sync/old.txt", "new")
    write = next(e for e in handle.get_new_events() if e.type == e2b.FilesystemEventType.WRITE)
    assert write.name == "old.txt" and write.entry.path == "/home/user/w-sync/old.txt"
    sbx.files.write("w-sync/new.txt", "n")
    assert [e.type for e in handle.get_new_events()] == [e2b.FilesystemEventType.CREATE,
                                                        e2b.FilesystemEventType.CHMOD,
                                                        e2b.FilesystemEventType.WRITE]
    handle.stop()
    deep = sbx.files.watch_dir("w-sync", recursive=True)
    sbx.files.write("w-sync/nested/f.txt", "f")
    events = deep.get_new_events()
    assert len(events) == 3 and events[0].type == e2b.FilesystemEventType.CREATE and events[0].name == "nested/f.txt"
    deep.stop()


def test_signed_urls_of_a_secure_sandbox_round_trip_and_expire_as_envds(sbx: Any, stack: Any) -> None:
    """E2B's test_secured.py, with the sandbox's host name (the URL names no sandbox) and no API key."""
    domain = stack.env.get("PODBAY_E2B_DOMAIN", "e2b.podbay.test")
    host = {"Host": f"49983-{sbx.sandbox_id}.{domain}"}
    sbx.files.write("signed.txt", "signed content")
    for url in (sbx.download_url("signed.txt", "user"), sbx.download_url("signed.txt", "user", 120)):
        with urllib.request.urlopen(urllib.request.Request(url, headers=host)) as resp:
            assert resp.status == 200 and resp.read() == b"signed content"
    expired = sbx.download_url("signed.txt", "user", use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(expired, headers=host))
    assert err.value.code == 401
    assert json.loads(err.value.read()) == {"code": 401, "message": "signature is already expired"}
    up = sbx.upload_url("up/via-url.txt", "user", 60)
    body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\nuploaded\r\n--b--\r\n"
    req = urllib.request.Request(up, data=body, method="POST",
                                 headers={**host, "Content-Type": "multipart/form-data; boundary=b"})
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200
    assert sbx.files.read("up/via-url.txt") == "uploaded"


_BY_HOST_SCRIPT = r"""
import json, sys, urllib.error, urllib.request
import e2b

out = {}
sb = e2b.Sandbox.create(template="base", timeout=300, secure=True)
try:
    out["sandbox_id"] = sb.sandbox_id
    out["host_8000"] = sb.get_host(8000)
    out["echo"] = sb.commands.run("echo by-host").stdout
    sb.files.write("signed.txt", "signed content")
    url = sb.download_url("signed.txt", "user", 120)
    out["download_url"] = url
    with urllib.request.urlopen(url) as resp:
        out["download"] = [resp.status, resp.read().decode()]
    try:
        urllib.request.urlopen(sb.download_url("signed.txt", "user", use_signature_expiration=-120))
        out["expired"] = [200, None]
    except urllib.error.HTTPError as err:
        out["expired"] = [err.code, json.loads(err.read())]
    body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\nup\r\n--b--\r\n"
    req = urllib.request.Request(sb.upload_url("via-host.txt", "user", 60), data=body, method="POST",
                                 headers={"Content-Type": "multipart/form-data; boundary=b"})
    with urllib.request.urlopen(req) as resp:
        out["upload"] = resp.status
    out["read_back"] = sb.files.read("via-host.txt")
finally:
    sb.kill()
    print(json.dumps(out))
"""


def test_envd_and_signed_urls_by_host_name_without_e2b_sandbox_url(stack: Any) -> None:
    """E2B's test_secured.py as E2B runs it: no ``E2B_SANDBOX_URL``, so the SDK reaches envd at
    ``https://49983-<sandboxID>.<E2B_DOMAIN>`` (its Rust HTTP client refuses a ``_`` in a host name: the id is
    ``sbx-<hex>`` on E2B's surface) and ``download_url`` / ``upload_url`` are fetched as they are, no API key.

    The SDK runs in a process of its own: its Rust HTTP client reads the trusted roots (``SSL_CERT_FILE``) once
    per process, so after other tests made a client without the edge's CA, this one would not trust the edge."""
    edge = stack.edge_client()
    if not edge["ca_bundle"]:
        pytest.skip("the stack runs no TLS edge of its own")
    env = {k: v for k, v in os.environ.items() if k != "E2B_SANDBOX_URL"}
    env.update({"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_API_KEY": stack.api_key,
                "E2B_DOMAIN": edge["e2b_domain"], "SSL_CERT_FILE": edge["ca_bundle"]})
    run = subprocess.run([sys.executable, "-c", _BY_HOST_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["sandbox_id"].startswith("sbx-") and "_" not in out["host_8000"]
    assert out["echo"] == "by-host\n"
    assert out["download_url"].startswith(f"https://49983-{out['sandbox_id']}.{edge['e2b_domain']}/files?")
    assert out["download"] == [200, "signed content"]
    assert out["expired"] == [401, {"code": 401, "message": "signature is already expired"}]
    assert out["upload"] == 200 and out["read_back"] == "up"
