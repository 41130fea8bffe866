"""SDK request shapes of suspend, resume (with fallback) and auto-resume, against an httpx mock transport."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import httpx
import pytest

from podbay.errors import SnapshotCorrupt
from podbay.sdk import AsyncClient, Client

SID = "sbx_1"


def _info(state: str) -> dict[str, object]:
    now = datetime.now(UTC).isoformat()
    return {"id": SID, "template": "base", "state": state, "desired_state": "running", "node_id": None,
            "generation": 2, "memory_mib": 256, "vcpus": 1, "hostname": "h", "metadata": {}, "created_at": now,
            "updated_at": now}


def _mock(seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        path = req.url.path
        if path.endswith("/suspend"):
            return httpx.Response(200, json=_info("suspended"))
        if path.endswith("/resume"):
            if req.url.params.get("fallback") != "true":
                return httpx.Response(502, json={"error": {"code": "snapshot_corrupt", "message": "chunk abc failed "
                                                           "its checksum", "details": {"operation_id": "op_1"}}})
            return httpx.Response(200, json=_info("running"))
        if path.endswith("/exec"):
            return httpx.Response(200, json={"stdout": "", "stderr": "", "exit_code": 0, "duration_ms": 1.0,
                                             "timed_out": False})
        if path.endswith("/files/stat"):
            return httpx.Response(200, json={"path": "/x", "name": "x", "type": "file", "size": 1, "mode": 0o644,
                                             "mtime": 0.0})
        return httpx.Response(200, json=_info("running"))

    return httpx.MockTransport(handler)


def test_suspend_resume_and_fallback_request_shapes() -> None:
    seen: list[httpx.Request] = []
    with Client("http://api.test", "pb_k_s", transport=_mock(seen)) as c:
        assert c.suspend_sandbox(SID).state == "suspended"
        assert seen[-1].method == "POST" and seen[-1].url.path == f"/v1/sandboxes/{SID}/suspend"
        assert dict(seen[-1].url.params) == {"wait": "true"}
        with pytest.raises(SnapshotCorrupt, match="checksum") as err:
            c.resume_sandbox(SID)
        assert err.value.details["operation_id"] == "op_1"
        assert c.resume_sandbox(SID, fallback=True, wait=False).state == "running"
        assert dict(seen[-1].url.params) == {"wait": "false", "fallback": "true"}


def test_auto_resume_marks_exec_and_file_calls_only() -> None:
    seen: list[httpx.Request] = []
    with Client("http://api.test", "pb_k_s", transport=_mock(seen), auto_resume=True) as c:
        c.exec(SID, "true")
        assert seen[-1].url.params.get("auto_resume") == "true"
        c.stat_file(SID, "/x")
        assert seen[-1].url.params.get("auto_resume") == "true"
        c.get_sandbox(SID)
        assert "auto_resume" not in seen[-1].url.params
    with Client("http://api.test", "pb_k_s", transport=_mock(seen)) as c:
        c.exec(SID, "true")
        assert "auto_resume" not in seen[-1].url.params


def test_async_client_suspends_and_auto_resumes() -> None:
    seen: list[httpx.Request] = []

    async def run() -> None:
        async with AsyncClient("http://api.test", "pb_k_s", transport=_mock(seen), auto_resume=True) as c:
            assert (await c.suspend_sandbox(SID)).state == "suspended"
            await c.exec(SID, ["true"])
            assert seen[-1].url.params.get("auto_resume") == "true"
            assert json.loads(seen[-1].content)["argv"] == ["true"]

    asyncio.run(run())


def test_a_failed_suspend_raises_suspend_failed() -> None:
    from podbay.errors import Conflict, SuspendFailed

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"code": "suspend_failed", "message": "promotion failed: S3 down",
                                                   "details": {"operation_id": "op_9"}}})

    with Client("http://api.test", "pb_k_s", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SuspendFailed, match="S3 down") as err:
            c.suspend_sandbox(SID)
    assert isinstance(err.value, Conflict) and err.value.details["operation_id"] == "op_9"
