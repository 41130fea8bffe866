"""Schedules against the real stack without a microVM (services/api/schedules/): bad input is refused with
its code and stores nothing; the per-sandbox limit; list, remove, and a deleted sandbox's schedules gone;
a sandbox that cannot wake records ``wake_failed`` with its events and the schedule fires again; two firers
record one run for one fire time (the unique key, real PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import asyncpg
import httpx
import pytest
from access_helpers import new_tenant, sql, template_and_sandbox

from podbay import db
from podbay.bus import connect_bus
from podbay.config import Settings
from podbay.devstack.stack import Stack
from podbay.errors import InvalidCron, InvalidRequest
from podbay.sdk import Client
from podbay.outbox import Relay
from podbay_api.core.context import ApiContext
from podbay_api.schedules.firer import ScheduleFirer

pytestmark = pytest.mark.integration


def _count(stack: Stack, sandbox_id: str) -> int:
    return int(sql(stack, "SELECT count(*) AS n FROM schedules WHERE sandbox_id=$1", sandbox_id)[0]["n"])


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


def test_bad_input_is_refused_with_its_code_and_stores_nothing(stack: Stack) -> None:
    acme, other = new_tenant(stack, "sched"), new_tenant(stack, "sched-other")
    _, sbx = template_and_sandbox(stack, acme, state="suspended")
    _, theirs = template_and_sandbox(stack, other, state="suspended")
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    cases: list[tuple[str, dict[str, object], int, str]] = [
        (sbx, {"cron": "61 * * * *"}, 400, "invalid_cron"),
        (sbx, {"cron": "* * * * * *"}, 400, "invalid_cron"),
        (sbx, {"cron": "0 0 30 2 *"}, 400, "invalid_cron"),
        (sbx, {"cron": "0 7 * * 1-5", "tz": "Europe/Nowhere"}, 400, "unknown_time_zone"),
        (sbx, {"at": soon, "tz": "../../etc/passwd"}, 400, "unknown_time_zone"),
        (sbx, {"at": past}, 400, "time_in_past"),
        (sbx, {"cron": "* * * * *", "at": soon}, 422, "validation_error"),
        (sbx, {"cron": "* * * * *", "command": {"argv": []}}, 422, "validation_error"),
        (sbx, {"cron": "* * * * *", "overlap": "parallel"}, 422, "validation_error"),
        (theirs, {"cron": "* * * * *"}, 404, "not_found"),
        ("sbx_nosuchsandbox", {"cron": "* * * * *"}, 404, "not_found"),
    ]
    with acme.http() as http:
        for sandbox, body, status, code in cases:
            r = http.post(f"/v1/sandboxes/{sandbox}/schedules", json=body)
            assert (r.status_code, _code(r)) == (status, code), (body, r.text)
            assert r.json()["error"]["message"]
        r = http.get(f"/v1/sandboxes/{theirs}/schedules")
        assert r.status_code == 404
    assert _count(stack, sbx) == 0 and _count(stack, theirs) == 0
    sql(stack, "UPDATE sandboxes SET state='deleted' WHERE id=$1", sbx)
    with acme.http() as http:
        r = http.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": "* * * * *"})
        assert (r.status_code, _code(r)) == (409, "invalid_state"), r.text
    assert _count(stack, sbx) == 0


def test_per_sandbox_limit(stack: Stack) -> None:
    acme = new_tenant(stack, "sched")
    _, sbx = template_and_sandbox(stack, acme, state="suspended")
    limit = Settings().schedules_per_sandbox_max
    with acme.http() as http:
        for i in range(limit):
            r = http.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": f"{i % 60} 3 * * *"})
            assert r.status_code == 201, r.text
        r = http.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": "0 4 * * *"})
        assert (r.status_code, _code(r)) == (409, "limit_exceeded"), r.text
        assert r.json()["error"]["details"]["limit"] == limit
    assert _count(stack, sbx) == limit


def test_list_remove_and_a_deleted_sandbox_has_no_schedules(stack: Stack) -> None:
    acme = new_tenant(stack, "sched")
    _, sbx = template_and_sandbox(stack, acme, state="suspended")
    at = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    with acme.http() as http:
        r = http.post(f"/v1/sandboxes/{sbx}/schedules", json={
            "cron": "0 7 * * 1-5", "tz": "Europe/Berlin", "overlap": "queue", "missed": "skip",
            "command": {"argv": ["python3", "/srv/agent/briefing.py"], "env": {"A": "1"}, "cwd": "/srv",
                        "user": "root", "timeout_s": 60}})
        assert r.status_code == 201, r.text
        cron = r.json()
        assert cron["id"].startswith("sch_") and cron["sandbox_id"] == sbx and cron["awake_s"] == 0
        fire = datetime.fromisoformat(cron["next_fire_at"])
        assert fire > datetime.now(UTC) and fire.astimezone(ZoneInfo("Europe/Berlin")).hour == 7
        r = http.post(f"/v1/sandboxes/{sbx}/schedules", json={"at": at.isoformat()})
        assert r.status_code == 201, r.text
        once = r.json()
        assert once["command"] is None and once["awake_s"] == 60
        assert datetime.fromisoformat(once["next_fire_at"]) == at
        listed = http.get(f"/v1/sandboxes/{sbx}/schedules").json()["schedules"]
        assert [s["id"] for s in listed] == [cron["id"], once["id"]]
        assert listed[0]["command"]["argv"] == ["python3", "/srv/agent/briefing.py"] and listed[0]["last_run"] is None
        assert http.get(f"/v1/sandboxes/{sbx}/schedules/{cron['id']}/runs").json() == {"runs": []}
        assert http.delete(f"/v1/sandboxes/{sbx}/schedules/{cron['id']}").status_code == 204
        r = http.delete(f"/v1/sandboxes/{sbx}/schedules/{cron['id']}")
        assert (r.status_code, _code(r)) == (404, "not_found")
        assert [s["id"] for s in http.get(f"/v1/sandboxes/{sbx}/schedules").json()["schedules"]] == [once["id"]]
        # A sandbox that no node runs is deleted by the API at once; its schedules go with it.
        assert http.delete(f"/v1/sandboxes/{sbx}").status_code == 200
    assert _count(stack, sbx) == 0


def _wait_run(stack: Stack, schedule_id: str, states: set[str], timeout_s: float = 60) -> asyncpg.Record:
    deadline = datetime.now(UTC) + timedelta(seconds=timeout_s)
    while datetime.now(UTC) < deadline:
        rows = sql(stack, "SELECT * FROM schedule_runs WHERE schedule_id=$1 ORDER BY fire_at", schedule_id)
        if rows and rows[-1]["state"] in states:
            return rows[-1]
        time.sleep(0.5)
    raise AssertionError(f"no run of {schedule_id} in {states}: {rows}")


def test_a_sandbox_that_cannot_wake_records_wake_failed_and_the_schedule_stays(stack: Stack) -> None:
    acme = new_tenant(stack, "sched")
    _, sbx = template_and_sandbox(stack, acme, state="failed")
    with acme.http() as http:
        # A cron whose own times are a year apart: an every-minute cron also fired on its own when the minute
        # turned during the test, and that extra run (skipped) hid the one the test brought forward.
        r = http.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": "0 3 1 1 *", "command": {"argv": ["true"]}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        # Bring the fire time forward instead of waiting for the minute.
        sql(stack, "UPDATE schedules SET next_fire_at=now() WHERE id=$1", sid)
        run = _wait_run(stack, sid, {"wake_failed"})
        assert run["reason"] == "invalid_state" and run["prior_state"] == "failed" and run["finished_at"]
        got = http.get(f"/v1/sandboxes/{sbx}/schedules/{sid}").json()
        assert got["last_run"]["state"] == "wake_failed"
        assert datetime.fromisoformat(got["next_fire_at"]) > datetime.fromisoformat(run["fire_at"].isoformat())
        runs = http.get(f"/v1/sandboxes/{sbx}/schedules/{sid}/runs").json()["runs"]
        assert [x["state"] for x in runs] == ["wake_failed"]
    events = [r["subject"] for r in sql(stack, "SELECT subject FROM outbox WHERE subject LIKE $1 ORDER BY id",
                                        f"podbay.evt.sandbox.{sbx}.schedule.%")]
    assert events == [f"podbay.evt.sandbox.{sbx}.schedule.fired", f"podbay.evt.sandbox.{sbx}.schedule.finished"]
    # Subscribers see them, and can filter on the dotted type.
    with acme.http() as http:
        def finished_events() -> list[dict[str, object]]:
            r = http.get("/v1/events", params={"sandbox": sbx, "type": "schedule.finished"})
            assert r.status_code == 200, r.text
            return [json.loads(x) for x in r.text.splitlines() if x]
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        while not (got_events := finished_events()):
            assert datetime.now(UTC) < deadline, "schedule.finished not relayed"
            time.sleep(0.5)
        assert [(e["type"], e["data"]["state"], e["data"]["schedule_id"]) for e in got_events] == [
            ("schedule.finished", "wake_failed", sid)]
    # It fires again at its next time.
    sql(stack, "UPDATE schedules SET next_fire_at=now() WHERE id=$1", sid)
    deadline = datetime.now(UTC) + timedelta(seconds=60)
    while len(sql(stack, "SELECT id FROM schedule_runs WHERE schedule_id=$1 AND state='wake_failed'", sid)) < 2:
        assert datetime.now(UTC) < deadline, "the schedule did not fire again"
        time.sleep(0.5)


def test_two_firers_record_one_run_per_fire_time(stack: Stack) -> None:
    acme = new_tenant(stack, "sched")
    _, sbx = template_and_sandbox(stack, acme, state="suspended")
    with acme.http() as http:
        ids = [http.post(f"/v1/sandboxes/{sbx}/schedules", json=body).json()["id"] for body in (
            {"cron": "*/5 * * * *"}, {"at": (datetime.now(UTC) + timedelta(days=1)).isoformat()})]
    asyncio.run(_two_firers(stack, ids))


async def _two_firers(stack: Stack, ids: list[str]) -> None:
    # Far in the future, so the stack's own firer never gets to them.
    fire_at = datetime(2099, 1, 1, tzinfo=UTC)
    pool = await db.connect_pool(stack.pg_dsn, min_size=1, max_size=8)
    bus = await connect_bus(stack.nats_url, name="schedules-test", heartbeat_ttl_s=10)
    try:
        await pool.execute("UPDATE schedules SET next_fire_at=$2 WHERE id = ANY($1::text[])", ids, fire_at)
        firers = []
        for _ in range(2):
            ctx = ApiContext(settings=Settings(), pool=pool, bus=bus, relay=Relay(pool, bus),
                             nodes_http=httpx.AsyncClient())
            firers.append(ScheduleFirer(ctx))
        now = fire_at + timedelta(seconds=1)
        counts = await asyncio.gather(*(f.fire_due(now, only=ids) for f in firers * 3))
        assert sum(counts) == 2
        runs = await pool.fetch("SELECT schedule_id, fire_at, state FROM schedule_runs WHERE schedule_id = ANY($1::text[])"
                                " ORDER BY schedule_id", ids)
        assert sorted((r["schedule_id"], r["fire_at"], r["state"]) for r in runs) == sorted(
            (i, fire_at, "queued") for i in ids)
        after = {r["id"]: r["next_fire_at"] for r in await pool.fetch(
            "SELECT id, next_fire_at FROM schedules WHERE id = ANY($1::text[])", ids)}
        assert after[ids[0]] == fire_at + timedelta(minutes=5) and after[ids[1]] is None
        # Firing the same time again (a replica that read the old next_fire_at) records nothing more.
        await pool.execute("UPDATE schedules SET next_fire_at=$2 WHERE id = ANY($1::text[])", ids, fire_at)
        assert sum(await asyncio.gather(*(f.fire_due(now, only=ids) for f in firers))) == 0
        for f in firers:
            await f.ctx.nodes_http.aclose()
    finally:
        await pool.execute("DELETE FROM schedules WHERE id = ANY($1::text[])", ids)
        await bus.close()
        await pool.close()


def _cli(stack: Stack, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
    return subprocess.run([sys.executable, "-m", "podbay.cli.main", "schedule", *args], capture_output=True,
                          text=True, timeout=60, env={**env, "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": key})


def test_sdk_and_cli_add_list_runs_and_remove(stack: Stack) -> None:
    acme = new_tenant(stack, "sched")
    _, sbx = template_and_sandbox(stack, acme, state="suspended")
    with Client(api_url=stack.api_url, api_key=acme.key) as pb:
        info = pb.schedules.add(sbx, cron="0 7 * * 1-5", tz="Europe/Berlin", command=["python3", "/srv/agent/b.py"],
                                env={"MODE": "daily"}, timeout_s=120)
        assert info.command is not None and info.command.env == {"MODE": "daily"} and info.command.timeout_s == 120
        assert [s.id for s in pb.schedules.list(sbx)] == [info.id]
        assert pb.schedules.runs(sbx, info.id) == []
        with pytest.raises(InvalidCron):
            pb.schedules.add(sbx, cron="0 25 * * *")
        with pytest.raises(InvalidRequest):  # refused locally: neither cron nor at
            pb.schedules.add(sbx)
        pb.schedules.remove(sbx, info.id)
        assert pb.schedules.list(sbx) == []
    out = _cli(stack, acme.key, "add", sbx, "--cron", "0 7 * * 1-5", "--tz", "Europe/Berlin", "--",
               "python3", "/srv/agent/briefing.py", "--verbose")
    assert out.returncode == 0, out.stderr
    sch = out.stdout.split()[0]
    assert sch.startswith("sch_") and "next" in out.stdout
    out = _cli(stack, acme.key, "add", sbx, "--at", "2099-01-01T09:00:00Z")
    assert out.returncode == 0, out.stderr
    listed = _cli(stack, acme.key, "list", sbx)
    assert listed.returncode == 0 and "python3 /srv/agent/briefing.py --verbose" in listed.stdout
    assert "0 7 * * 1-5 Europe/Berlin" in listed.stdout and "(wake only)" in listed.stdout
    runs = _cli(stack, acme.key, "runs", sbx, sch)
    assert runs.returncode == 0 and runs.stdout.splitlines()[0].split()[:2] == ["RUN", "FIRE_AT"]
    bad = _cli(stack, acme.key, "add", sbx, "--cron", "0 7 * *", "--", "true")
    assert bad.returncode == 2 and bad.stderr.strip().endswith("(invalid_cron)"), bad.stderr
    bad = _cli(stack, acme.key, "add", sbx, "--cron", "0 7 * * *", "--tz", "Nowhere/Town")
    assert bad.returncode == 2 and bad.stderr.strip().endswith("(unknown_time_zone)"), bad.stderr
    removed = _cli(stack, acme.key, "rm", sbx, sch)
    assert removed.returncode == 0 and removed.stdout.strip() == sch, removed.stderr
    gone = _cli(stack, acme.key, "rm", sbx, sch)
    assert gone.returncode == 2 and gone.stderr.strip().endswith("(not_found)"), gone.stderr
    assert _count(stack, sbx) == 1


def test_fork_children_have_no_schedules_unless_asked(stack: Stack) -> None:
    acme = new_tenant(stack, "sched")
    _, sbx = template_and_sandbox(stack, acme, state="running")
    node = f"sn-{secrets.token_hex(3)}"
    sql(stack, "INSERT INTO nodes (id, dataplane_url, memory_mib, vcpus, accel, state) VALUES"
               " ($1, 'http://127.0.0.1:1', 1024, 2, 'tcg', 'ready')", node)
    sql(stack, "UPDATE sandboxes SET node_id=$2, generation=1 WHERE id=$1", sbx, node)
    with acme.http() as http:
        kept = http.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": "0 7 * * *", "tz": "Europe/Berlin",
                                                                  "command": {"argv": ["true"]}}).json()
        # Nobody runs the fake node: the forks answer 202 with their children recorded.
        plain = http.post(f"/v1/sandboxes/{sbx}/fork", params={"wait": "false"}, json={"count": 1})
        asked = http.post(f"/v1/sandboxes/{sbx}/fork", params={"wait": "false"}, json={"count": 2,
                                                                                      "schedules": True})
        assert plain.status_code == 202 and asked.status_code == 202, (plain.text, asked.text)
        [child] = [c["sandbox_id"] for c in plain.json()["children"]]
        assert http.get(f"/v1/sandboxes/{child}/schedules").json() == {"schedules": []}
        for kid in [c["sandbox_id"] for c in asked.json()["children"]]:
            [copy] = http.get(f"/v1/sandboxes/{kid}/schedules").json()["schedules"]
            assert copy["id"] != kept["id"] and copy["sandbox_id"] == kid
            assert (copy["cron"], copy["tz"], copy["command"], copy["next_fire_at"]) == (
                kept["cron"], kept["tz"], kept["command"], kept["next_fire_at"])
        # The parent keeps its own.
        assert [s["id"] for s in http.get(f"/v1/sandboxes/{sbx}/schedules").json()["schedules"]] == [kept["id"]]
