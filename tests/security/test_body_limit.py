"""Client vs API: a request body the API would read into memory is bounded (``PODBAY_API_BODY_MAX_MIB``;
services/api/core/bodylimit.py), with or without a key, declared or chunked; streamed routes keep their own
limits (docs/SECURITY.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from access_helpers import second_api

MIB = 1 << 20


def _chunks(total: int, size: int = 64 << 10) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        sent += n
        yield b"a" * n


def test_bodies_over_the_limit_are_refused_before_they_are_read(stack: Any, tmp_path: Path) -> None:
    with second_api(stack, tmp_path / "api.log", PODBAY_API_BODY_MAX_MIB="1") as api:
        auth = {"authorization": f"Bearer {stack.api_key}"}
        for headers in ({}, auth):  # anonymous too: the body used to be read before the key was checked
            r = httpx.post(f"{api}/v1/sandboxes", content=b"a" * (2 * MIB),
                           headers={**headers, "content-type": "application/json"}, timeout=30)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
            # Chunked: no Content-Length to look at; cut off once past the limit.
            r = httpx.post(f"{api}/v1/sandboxes", content=_chunks(2 * MIB),
                           headers={**headers, "content-type": "application/json"}, timeout=30)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        r = httpx.post(f"{api}/e2b/sandboxes", content=b"{" + b" " * (2 * MIB) + b"}",
                       headers={**auth, "content-type": "application/json"}, timeout=30)
        assert r.status_code == 413, r.text
        # Under the limit, the request is the route's as before.
        r = httpx.post(f"{api}/v1/sandboxes", content=b"{bad", headers=auth, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
        # A file upload streams to the guest with limits of its own: not refused here (404: no such sandbox).
        r = httpx.put(f"{api}/v1/sandboxes/sbx_00000000000000000000/files", params={"path": "/tmp/x"},
                      content=_chunks(2 * MIB), headers=auth, timeout=30)
        assert r.status_code == 404, r.text
