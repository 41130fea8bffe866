"""HTTP helpers shared by the e2e tests: an API client for the test stack and a shell exec that must succeed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["api_client", "sh", "sh_output"]


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
