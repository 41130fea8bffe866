"""Helpers shared by the e2e tests: an API client for a test stack, a shell exec that must succeed, a bounded
wait, and a stack of a test module's own."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays
from podbay.egress_ranges import TEST_PEER_NETS

__all__ = ["api_client", "sh", "sh_output", "until", "own_stack"]


def api_client(stack: Any, key: str | None = None, *, timeout_s: float = 300.0) -> httpx.Client:
    """An ``httpx.Client`` on the stack's API with a bearer key (the stack's own unless ``key``)."""
    return httpx.Client(base_url=stack.api_url, headers={"authorization": f"Bearer {key or stack.api_key}"},
                        timeout=timeout_s)


def sh(c: httpx.Client, sid: str, script: str) -> str:
    """Run ``script`` through the guest's shell; assert HTTP 200 and exit code 0; return stdout."""
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": script})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.text
    return str(r.json()["stdout"])


def sh_output(c: httpx.Client, sid: str, script: str) -> str:
    """Run ``script`` through the guest's shell; assert HTTP 200 only (any exit code); return stdout."""
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"shell": script})
    assert r.status_code == 200, r.text
    return str(r.json()["stdout"])


@contextlib.contextmanager
def new_sandbox(c: httpx.Client, template: str = "base") -> Iterator[str]:
    """A new sandbox of ``template`` (asserting the create answered 201), deleted afterwards."""
    r = c.post("/v1/sandboxes", json={"template": template})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    try:
        yield sid
    finally:
        c.delete(f"/v1/sandboxes/{sid}")


def until(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    """Call ``check`` every ``every_s`` seconds until it returns something truthy (returned); raise
    ``AssertionError`` naming ``what`` and the last value after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")


@contextlib.contextmanager
def own_stack(test_root: Path, env: dict[str, str], *, prefix: str = "s") -> Iterator[Stack]:
    """A single-node stack of its own (data directory under ``test_root``, its own servers unless
    ``PODBAY_*_URL`` name external ones, free ports) with ``env`` over the environment and a dev API key;
    purged (VMs, store, host network) on exit. For tests that need settings the session ``stack`` lacks. Like
    the session stack, it allow-lists two documentation ranges for egress (``TEST_PEER_NETS``: test peers)."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=test_root))  # short: UNIX socket paths below it
    os.chmod(data_dir, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    running = Stack(data_dir=data_dir, log_dir=data_dir / "logs", cache_dir=Settings().cache_dir,
                    ports=StackPorts.free(), external=External.from_env(), durable=False,
                    base_env={**os.environ, "PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS": os.environ.get(
                        "PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS", TEST_PEER_NETS), **env})
    try:
        running.start()
        running.create_api_key("dev", "dev")
        yield running
    finally:
        running.stop(purge=True)
        kill_strays(data_dir)
