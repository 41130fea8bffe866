"""Schedules with real microVMs (services/api/schedules/): a suspended sandbox wakes at its time, runs its
command, keeps exit code and output (PostgreSQL and the object store), and is suspended again with the
command's file in its snapshot; a paused sandbox whose RAM was released returns to paused, and a fire while
its run still goes is skipped; SIGKILL of the firing API across a fire time gives one run after a restart;
SIGKILL mid-run leaves the run interrupted and the sandbox put back.

Fire times are brought forward (``at`` a few seconds ahead, or ``next_fire_at`` set in PostgreSQL) rather
than waiting for a cron minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from podbay.config import Settings
from podbay.objstore import open_store
from e2e_http import api_client, sh, until, new_sandbox

pytestmark = pytest.mark.e2e

RUN_DEADLINE_S = 240.0


def _sql(stack: Any, query: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(stack.pg_dsn)
        try:
            return list(await conn.fetch(query, *args))
        finally:
            await conn.close()

    return asyncio.run(run())


def _in(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def _runs(c: httpx.Client, sid: str, sch: str) -> list[dict[str, Any]]:
    r = c.get(f"/v1/sandboxes/{sid}/schedules/{sch}/runs")
    assert r.status_code == 200, r.text
    return list(r.json()["runs"])


def _finished_run(c: httpx.Client, sid: str, sch: str, n: int = 1) -> list[dict[str, Any]]:
    """Wait until ``n`` runs of the schedule have finished (not queued or running); all runs, newest first."""
    def done() -> list[dict[str, Any]] | None:
        runs = _runs(c, sid, sch)
        finished = [r for r in runs if r["state"] not in ("queued", "running")]
        return runs if len(finished) >= n else None
    return list(until(f"{n} finished run(s) of {sch}", done, RUN_DEADLINE_S))


def _qemu_for(sid: str) -> bool:
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes()
                if b"qemu" in cmd and sid.encode() in cmd:
                    return True
    return False


def test_suspended_sandbox_wakes_runs_and_is_suspended_again_with_the_file(stack: Any) -> None:
    with api_client(stack, timeout_s=600) as c, new_sandbox(c) as sid:
        r = c.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
        r = c.post(f"/v1/sandboxes/{sid}/schedules", json={"at": _in(3), "command": {
            "argv": ["sh", "-c", "echo hello from $GREETING; echo oops >&2; date +%s > /root/scheduled-ran; exit 3"],
            "env": {"GREETING": "schedule"}, "cwd": "/root", "timeout_s": 60}})
        assert r.status_code == 201, r.text
        sch = r.json()["id"]
        [run] = _finished_run(c, sid, sch)
        assert run["state"] == "failed" and run["reason"] == "exit_code" and run["exit_code"] == 3, run
        assert run["stdout_head"] == "hello from schedule\n" and run["stderr_head"] == "oops\n", run
        assert run["stdout_tail"] is None and run["stdout_bytes"] == len("hello from schedule\n")
        assert run["prior_state"] == "suspended" and run["command_started_at"] and run["awake_at"]
        assert run["output_key"], run
        # Back to suspended (with a new full snapshot) before the run counted as finished.
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "suspended"
        assert not _qemu_for(sid)
        listed = c.get(f"/v1/sandboxes/{sid}/schedules").json()["schedules"]
        assert listed[0]["next_fire_at"] is None and listed[0]["last_run"]["exit_code"] == 3

        async def whole_output() -> tuple[bytes | None, bytes | None]:
            os.environ.setdefault("AWS_ACCESS_KEY_ID", stack.env["AWS_ACCESS_KEY_ID"])
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", stack.env["AWS_SECRET_ACCESS_KEY"])
            s3 = Settings(s3_url=stack.env["PODBAY_S3_URL"], s3_bucket=stack.env["PODBAY_S3_BUCKET"])
            async with open_store(s3) as st:
                return await st.get(f"{run['output_key']}/stdout"), await st.get(f"{run['output_key']}/stderr")
        assert asyncio.run(whole_output()) == (b"hello from schedule\n", b"oops\n")
        events = [r["subject"].rsplit(".", 2)[-2:] for r in _sql(
            stack, "SELECT subject FROM outbox WHERE subject LIKE $1 ORDER BY id", f"podbay.evt.sandbox.{sid}.%")]
        types = [".".join(e) if e[0] == "schedule" else e[1] for e in events]
        fired, finished = types.index("schedule.fired"), types.index("schedule.finished")
        assert fired < types.index("resuming") < types.index("suspended", fired) < finished, types
        # The file the command wrote is in the snapshot the sandbox was suspended to.
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert sh(c, sid, "cat /root/scheduled-ran").strip().isdigit()


def test_paused_sandbox_returns_to_paused_and_an_overlapping_fire_is_skipped(stack: Any) -> None:
    with api_client(stack, timeout_s=600) as c, new_sandbox(c) as sid:
        r = c.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 200 and r.json()["state"] == "paused", r.text
        # The stack releases a paused sandbox's RAM after PODBAY_PAUSED_RELEASE_S (QEMU exits).
        until("the paused sandbox's RAM released", lambda: not _qemu_for(sid), 120)
        r = c.post(f"/v1/sandboxes/{sid}/schedules", json={
            "cron": "0 0 1 1 *", "command": {"argv": ["sh", "-c", "sleep 8; echo done >> /root/paused-runs"]}})
        assert r.status_code == 201, r.text
        sch = r.json()["id"]
        assert r.json()["overlap"] == "skip"
        _sql(stack, "UPDATE schedules SET next_fire_at=now() WHERE id=$1", sch)
        until("the command started", lambda: any(x["command_started_at"] for x in _runs(c, sid, sch)), RUN_DEADLINE_S)
        # A second fire time comes while the first run still sleeps: skipped under the default policy.
        _sql(stack, "UPDATE schedules SET next_fire_at=now() WHERE id=$1", sch)
        runs = _finished_run(c, sid, sch, n=2)
        by_state = {x["state"]: x for x in runs}
        assert sorted(by_state) == ["skipped", "succeeded"], runs
        assert by_state["skipped"]["reason"] == "overlap" and by_state["skipped"]["started_at"] is None
        assert by_state["succeeded"]["prior_state"] == "paused" and by_state["succeeded"]["exit_code"] == 0
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200, r.text
        assert sh(c, sid, "cat /root/paused-runs") == "done\n"


def test_sigkill_of_the_firer_across_a_fire_time_runs_once(stack: Any) -> None:
    with api_client(stack, timeout_s=600) as c, new_sandbox(c) as sid:
        r = c.post(f"/v1/sandboxes/{sid}/schedules", json={
            "at": _in(8), "command": {"argv": ["sh", "-c", "echo fired >> /root/fires"]}})
        assert r.status_code == 201, r.text
        sch, fire_at = r.json()["id"], datetime.fromisoformat(r.json()["next_fire_at"])
        stack.kill("api", signal.SIGKILL)
        time.sleep(max(0.0, (fire_at - datetime.now(UTC)).total_seconds()) + 2)
        stack.restart("api")
        runs = _finished_run(c, sid, sch)
        assert [x["state"] for x in runs] == ["succeeded"], runs
        assert sh(c, sid, "cat /root/fires") == "fired\n"
        assert len(_sql(stack, "SELECT id FROM schedule_runs WHERE schedule_id=$1", sch)) == 1


def test_sigkill_mid_run_leaves_it_interrupted_and_the_sandbox_put_back(stack: Any) -> None:
    with api_client(stack, timeout_s=600) as c, new_sandbox(c) as sid:
        assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        r = c.post(f"/v1/sandboxes/{sid}/schedules", json={"at": _in(2), "command": {"argv": ["sleep", "600"]}})
        assert r.status_code == 201, r.text
        sch = r.json()["id"]
        until("the command started", lambda: any(x["command_started_at"] for x in _runs(c, sid, sch)), RUN_DEADLINE_S)
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        stack.kill("api", signal.SIGKILL)
        stack.restart("api")
        [run] = _finished_run(c, sid, sch)
        assert run["state"] == "interrupted" and run["prior_state"] == "paused", run
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
