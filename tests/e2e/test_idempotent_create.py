"""Idempotent create end to end (services/api/services/idempotency.py): two creates sent at once with one
``Idempotency-Key`` and one body make one sandbox and both answer with it; a retry later answers with it as it
is now; the key with another body is 422 ``idempotency_key_reused`` and makes nothing. One create (a warm
claim or a restore on the session stack), no boot."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from e2e_http import api_client

pytestmark = pytest.mark.e2e


async def _create_twice(stack: Any, body: dict[str, Any], key: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=stack.api_url, headers={"authorization": f"Bearer {stack.api_key}",
                                                                  "Idempotency-Key": key}, timeout=300.0) as c:
        return list(await asyncio.gather(*(c.post("/v1/sandboxes", json=body) for _ in range(2))))


def test_one_key_makes_one_sandbox_and_another_body_is_refused(stack: Any) -> None:
    key = str(uuid.uuid4())
    marker = {"idem": key[:8]}
    body = {"template": "base", "metadata": marker}
    first, second = asyncio.run(_create_twice(stack, body, key))
    with api_client(stack) as c:
        ids = {r.json().get("id") for r in (first, second)}
        try:
            assert first.status_code == second.status_code == 201, (first.text, second.text)
            assert len(ids) == 1 and first.json()["state"] == second.json()["state"] == "running"
            sid = first.json()["id"]
            mine = [s for s in c.get("/v1/sandboxes").json()["sandboxes"] if s["metadata"] == marker]
            assert [s["id"] for s in mine] == [sid]

            r = c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": key})
            assert r.status_code == 201 and r.json()["id"] == sid and r.json()["state"] == "running", r.text

            r = c.post("/v1/sandboxes", json={**body, "metadata": {**marker, "other": "1"}},
                       headers={"Idempotency-Key": key})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "idempotency_key_reused"
            assert r.json()["error"]["details"]["sandbox_id"] == sid
            r = c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "not a key"})
            assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
            listed = [s for s in c.get("/v1/sandboxes").json()["sandboxes"] if s["metadata"].get("idem") == key[:8]]
            assert [s["id"] for s in listed] == [sid]
        finally:
            for sid in ids - {None}:
                c.delete(f"/v1/sandboxes/{sid}")
