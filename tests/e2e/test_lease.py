"""Lease and idle policy: an idle sandbox whose lease ran out is paused (or deleted); a busy one is not."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
from e2e_http import api_client as _client

pytestmark = pytest.mark.e2e



def test_lease_expiry_pauses_idle_deletes_when_asked_and_spares_busy(stack: Any) -> None:
    with _client(stack) as c:
        idle = c.post("/v1/sandboxes", json={"template": "base", "lease_s": 10}).json()
        busy = c.post("/v1/sandboxes", json={"template": "base", "lease_s": 10}).json()
        doomed = c.post("/v1/sandboxes", json={"template": "base", "lease_s": 10, "on_lease_expiry": "delete"}).json()
        assert idle["lease_s"] == 10 and idle["on_lease_expiry"] == "pause" and idle["lease_expires_at"]
        ids = [idle["id"], busy["id"], doomed["id"]]
        try:
            r = c.post(f"/v1/sandboxes/{busy['id']}/exec",
                       json={"shell": "setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &"})
            assert r.status_code == 200
            # renewing moves the expiry forward
            before = datetime.fromisoformat(c.get(f"/v1/sandboxes/{idle['id']}").json()["lease_expires_at"])
            r = c.post(f"/v1/sandboxes/{idle['id']}/timeout", json={"lease_s": 10})
            assert r.status_code == 200 and datetime.fromisoformat(r.json()["lease_expires_at"]) >= before
            assert c.post(f"/v1/sandboxes/{idle['id']}/timeout", json={"lease_s": 1}).status_code == 422

            deadline = time.monotonic() + 60
            states: dict[str, str] = {}
            while time.monotonic() < deadline:
                states = {i: c.get(f"/v1/sandboxes/{i}").json()["state"] for i in ids}
                if states[idle["id"]] == "paused" and states[doomed["id"]] == "deleted":
                    break
                time.sleep(1)
            assert states[idle["id"]] == "paused", states
            assert states[doomed["id"]] == "deleted", states
            # the busy one outlived its lease (renewed by its own activity), and still answers
            assert states[busy["id"]] == "running", states
            assert c.post(f"/v1/sandboxes/{busy['id']}/exec", json={"argv": ["true"]}).status_code == 200
            # a paused sandbox resumes as usual, with a fresh lease
            r = c.post(f"/v1/sandboxes/{idle['id']}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running"
        finally:
            for i in ids:
                c.delete(f"/v1/sandboxes/{i}")
