"""The default stack's egress reaches a real package index (issue "The default dev stack's egress works"):
a sandbox of the test stack, with an allow rule for the index's hosts, downloads a small package through the
gateway with python3's ``urllib`` (and with ``pip download`` when the template has pip).

Nothing here names an index: its URL comes, at run time, from the installed pip (``PIP_INDEX_URL``, then
``pip config list``, then pip's own default index), and the hosts of its files from the index's own page for
the package, read from the host. When the host itself cannot read that page (no route out, a proxy that
refuses), the test is skipped with the reason. On a network that inspects TLS the guest must trust the
inspecting CA: the stack adds what the host trusts beyond the public roots to every guest (docs/egress.md,
"Guest trust").
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from e2e_http import api_client

pytestmark = pytest.mark.e2e

#: A small, pure-Python package with wheels on any index that mirrors the public one.
_PACKAGE = "six"

#: Runs in the guest: ``python3 -c GUEST_FETCH INDEX_PAGE_URL``: reads the package's index page, then the
#: last wheel it lists, checks the file's sha256 against the link's fragment; prints one JSON object.
GUEST_FETCH = r"""
import hashlib, json, re, sys, urllib.parse, urllib.request
page_url = sys.argv[1]
out = {}
try:
    with urllib.request.urlopen(page_url, timeout=60) as r:
        out["index_status"] = r.status
        page = r.read().decode()
    links = [urllib.parse.urljoin(page_url, h) for h in re.findall(r'href="([^"]+)"', page)]
    wheels = [u for u in links if urllib.parse.urldefrag(u)[0].endswith(".whl")]
    url, frag = urllib.parse.urldefrag(wheels[-1])
    with urllib.request.urlopen(url, timeout=60) as r:
        out["file_status"] = r.status
        data = r.read()
    out["file"] = url.rsplit("/", 1)[-1]
    out["size"] = len(data)
    want = dict(p.split("=", 1) for p in frag.split("&") if "=" in p).get("sha256")
    out["sha256_ok"] = want is not None and hashlib.sha256(data).hexdigest() == want
except Exception as exc:
    out["error"] = repr(exc)
print(json.dumps(out))
"""

#: Where pip's download command takes ``index-url`` from, first wins: the environment, its own section, global.
_PIP_KEYS = (":env:.index-url", "download.index-url", "global.index-url")


def _index_url() -> str:
    """The index the installed pip downloads from: ``index-url`` as ``pip config list`` shows it (environment
    first, then the ``download`` and ``global`` sections), else the default that ``pip download --help``
    names."""
    pip = [sys.executable, "-m", "pip"]
    listed = subprocess.run([*pip, "config", "list"], capture_output=True, text=True, timeout=60).stdout
    values = dict(line.partition("=")[::2] for line in listed.splitlines())
    for key in _PIP_KEYS:
        value = values.get(key, "").strip().strip("'\"").split()
        if value:
            return value[0]
    usage = " ".join(subprocess.run([*pip, "download", "--help"], capture_output=True, text=True,
                                    timeout=60).stdout.split())
    match = re.search(r"index-url <url> .*?\(default (\S+?)\)", usage, re.IGNORECASE)
    if match is None:
        pytest.skip("the installed pip names no package index (PIP_INDEX_URL, pip config, its default)")
    return match.group(1)


def _package_page(index_url: str) -> tuple[str, str]:
    """``(page URL, page text)`` of the package on the index, read from the host; skips the test when the host
    cannot read it (the machine has no way to the index)."""
    page_url = index_url.rstrip("/") + f"/{_PACKAGE}/"
    try:
        with urllib.request.urlopen(page_url, timeout=30) as r:
            return page_url, r.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        pytest.skip(f"this machine cannot reach the package index {index_url} ({exc})")


def _hosts(page_url: str, page: str) -> set[str]:
    """Host names the guest needs: the index's and those of the files its page links to."""
    links = [urllib.parse.urljoin(page_url, h) for h in re.findall(r'href="([^"]+)"', page)]
    hosts = {urllib.parse.urlsplit(u).hostname for u in [page_url, *links]}
    return {h for h in hosts if h}


def test_guest_downloads_a_package_through_the_gateway(stack: Any) -> None:
    index_url = _index_url()
    if urllib.parse.urlsplit(index_url).scheme not in ("http", "https"):
        pytest.skip(f"the installed pip's index {index_url} is not on the network")
    page_url, page = _package_page(index_url)
    hosts = _hosts(page_url, page)
    port = urllib.parse.urlsplit(page_url).port or (443 if page_url.startswith("https:") else 80)
    allow = [{"domain": h, "ports": sorted({port, 443})} for h in sorted(hosts)]
    with api_client(stack) as c:
        sb = c.post("/v1/sandboxes", json={"template": "base", "network": {"allow": allow}})
        assert sb.status_code == 201, sb.text
        sid = sb.json()["id"]
        try:
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["python3", "-c", GUEST_FETCH, page_url]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            got = json.loads(r.json()["stdout"])
            assert "error" not in got, got
            assert got["index_status"] == 200 and got["file_status"] == 200, got
            assert got["file"].endswith(".whl") and got["size"] > 0 and got["sha256_ok"], got

            # pip, where the template has it: the same index, through the same gateway.
            has_pip = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "python3 -m pip --version"})
            if has_pip.status_code == 200 and has_pip.json()["exit_code"] == 0:
                r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": (
                    f"python3 -m pip download --no-deps --disable-pip-version-check -q -d /tmp/pkgs "
                    f"--index-url {shlex.quote(index_url)} {_PACKAGE} && ls /tmp/pkgs")})
                assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
                assert _PACKAGE in r.json()["stdout"], r.text
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
