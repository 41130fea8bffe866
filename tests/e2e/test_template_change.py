"""Sandboxes outlive a change of their node's template build (they keep the build they were made from).

A "newer build" is faked without building: a private build cache holds a copy of the current template whose
``template.json`` carries another key (links to the node store's files, so nothing large is copied), and the
node agent restarts on that cache. The shared build cache is left alone (other stacks read it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_snapshots import _client, _sh

pytestmark = pytest.mark.e2e

_FILES = ("state", "ram", "disk.img", "vmlinuz", "initrd.img")


def _base_digest(c: httpx.Client) -> str:
    return next(t["digest"] for t in c.get("/v1/templates").json()["templates"] if t["name"] == "base")


@contextmanager
def _newer_build(stack: Any, tmp_path: Path, current: str) -> Iterator[str]:
    """Restart the node agent on a build cache whose only ``base`` is ``current`` under a new key; yields that
    key and puts the node agent back on the shared cache afterwards."""
    [store_tpl] = Path(stack.data_dir).glob(f"nodes/*/store/templates/base/{current}")
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in Path(stack.cache_dir).iterdir():  # accel probes, kernels, images: the same as before
        if entry.name != "templates":
            (cache / entry.name).symlink_to(entry)
    meta = json.loads((store_tpl / "template.json").read_text())
    key = hashlib.sha256(f"newer build of {current}".encode()).hexdigest()
    fake = cache / "templates" / f"base-{key[:16]}"
    fake.mkdir(parents=True)
    for name in _FILES:
        (fake / name).symlink_to(store_tpl / name)
    (fake / "template.json").write_text(json.dumps({**meta, "key": key}))
    svc = stack.services["nodeagent"]
    before = svc.env
    svc.env = {**before, "PODBAY_CACHE_DIR": str(cache)}
    stack.restart("nodeagent")
    try:
        yield key
    finally:
        svc.env = before
        stack.restart("nodeagent")


def test_sandbox_restores_and_forks_after_the_template_build_changes(stack: Any, tmp_path: Path) -> None:
    with _client(stack) as c:
        old = _base_digest(c)
        sid = c.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
        children: list[str] = []
        try:
            _sh(c, sid, "echo before > /root/mark.txt")
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
            assert r.status_code == 201, r.text
            snap = r.json()["id"]
            _sh(c, sid, "echo after > /root/mark.txt")
            with _newer_build(stack, tmp_path, old) as new:
                assert _base_digest(c) == new  # new creates get the newer build
                info = c.get(f"/v1/sandboxes/{sid}").json()
                assert info["state"] == "running", info  # re-attached: no template needed

                r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot_id": snap})
                assert r.status_code == 200, r.text
                info = r.json()
                assert info["state"] == "running", info
                assert _sh(c, sid, "cat /root/mark.txt") == "before\n"

                r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1, "snapshot_id": snap})
                assert r.status_code == 200, r.text
                children = [ch["sandbox_id"] for ch in r.json()["children"]]
                assert [ch["state"] for ch in r.json()["children"]] == ["running"], r.text
                assert _sh(c, children[0], "cat /root/mark.txt") == "before\n"
        finally:
            for s in [sid, *children]:
                c.delete(f"/v1/sandboxes/{s}")
