"""SDK event iterators (filters on the wire, keep-alive lines, reconnect from the last position while
following), webhook signatures, and the CLI's stored positions; all without a server."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from podbay.cli import events as cli_events
from podbay.errors import InvalidRequest
from podbay.sdk import AsyncClient, Client
from podbay.sdk import _events as sdk_events
from podbay.webhooks import signature_header, verify_signature


def _line(seq: int, typ: str) -> str:
    return json.dumps({"seq": seq, "id": f"evt_{seq}", "type": typ, "sandbox_id": "sbx_1", "tenant_id": "ten_1",
                       "at": datetime.now(UTC).isoformat(), "data": {"seq": seq}}) + "\n"


class Script:
    """Answers successive ``GET /v1/events`` with the given bodies and records each request."""

    def __init__(self, *bodies: str) -> None:
        self.bodies = list(bodies)
        self.seen: list[httpx.Request] = []

    def __call__(self, req: httpx.Request) -> httpx.Response:
        self.seen.append(req)
        return httpx.Response(200, text=self.bodies.pop(0), headers={"content-type": "application/x-ndjson"})


@pytest.fixture(autouse=True)
def _no_reconnect_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk_events, "RECONNECT_S", 0.0)


def test_follow_reconnects_after_the_last_seq_seen_without_repeats() -> None:
    # The first response drops after two events (and a keep-alive line); the second continues.
    script = Script(_line(7, "created") + "\n" + _line(9, "started"), _line(12, "paused"))
    with Client("http://api", "k", transport=httpx.MockTransport(script)) as c:
        it = c.events(sandbox=["sbx_1", "sbx_2"], types=["created", "paused"], after=3, follow=True)
        got = [next(it) for _ in range(3)]
    assert [(e.seq, e.type) for e in got] == [(7, "created"), (9, "started"), (12, "paused")]
    q0, q1 = (r.url.params for r in script.seen)
    assert q0.get_list("sandbox") == ["sbx_1", "sbx_2"] and q0.get_list("type") == ["created", "paused"]
    assert (q0["after"], q0["follow"]) == ("3", "true")
    assert q1["after"] == "9"


def test_without_follow_one_response_and_done() -> None:
    script = Script(_line(1, "created") + _line(2, "deleted"))
    with Client("http://api", "k", transport=httpx.MockTransport(script)) as c:
        assert [e.seq for e in c.events()] == [1, 2]
        with pytest.raises(InvalidRequest):
            list(c.events(sandbox="bad id"))
    assert len(script.seen) == 1 and "after" not in script.seen[0].url.params
    assert script.seen[0].url.params["follow"] == "false"


def test_async_iterator_reconnects_too() -> None:
    script = Script(_line(4, "created"), _line(5, "started"))

    async def go() -> list[int]:
        async with AsyncClient("http://api", "k", transport=httpx.MockTransport(script)) as c:
            out = []
            async for e in c.events(follow=True):
                out.append(e.seq)
                if len(out) == 2:
                    break
            return out

    assert asyncio.run(go()) == [4, 5]
    assert script.seen[1].url.params["after"] == "4"


def test_signature_verifies_and_refuses_tampering_and_old_timestamps() -> None:
    body = b'{"type":"paused"}'
    header = signature_header("whsec_a", body, timestamp=1_700_000_000)
    assert header.startswith("t=1700000000,v1=")
    assert verify_signature("whsec_a", header, body, now=1_700_000_100)
    assert not verify_signature("whsec_a", header, body + b" ", now=1_700_000_100)
    assert not verify_signature("whsec_b", header, body, now=1_700_000_100)
    assert not verify_signature("whsec_a", header, body, now=1_700_000_000 + 301)
    assert not verify_signature("whsec_a", "garbage", body)
    # Several v1 values (a receiver rotating secrets) pass when one matches.
    two = header.replace("v1=", "v1=00,v1=")
    assert verify_signature("whsec_a", two, body, now=1_700_000_000)


def test_cli_position_file_round_trip_and_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PODBAY_CONFIG", str(tmp_path / "cfg" / "config.json"))
    path = cli_events.position_file("follower-1")
    assert path == tmp_path / "cfg" / "events" / "follower-1.pos"
    assert cli_events.read_position(path) is None
    cli_events.write_position(path, 42)
    cli_events.write_position(path, 43)
    assert cli_events.read_position(path) == 43
    path.write_text("x")
    with pytest.raises(InvalidRequest):
        cli_events.read_position(path)
    for bad in ("../up", "", "a/b", "x" * 65):
        with pytest.raises(InvalidRequest):
            cli_events.position_file(bad)


def test_sandbox_events_are_scoped_to_the_sandbox() -> None:
    now = datetime.now(UTC).isoformat()
    info = {"id": "sbx_1", "template": "base", "state": "running", "desired_state": "running", "node_id": None,
            "generation": 1, "memory_mib": 256, "vcpus": 1, "hostname": "h", "metadata": {}, "created_at": now,
            "updated_at": now}
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/v1/events":
            return httpx.Response(200, text=_line(3, "paused"))
        return httpx.Response(200, json=info)

    from podbay.sdk import AsyncSandbox

    async def go() -> list[str]:
        async with AsyncClient("http://api", "k", transport=httpx.MockTransport(handler)) as c:
            sb = await AsyncSandbox.connect("sbx_1", client=c)
            return [e.type async for e in sb.events(types=["paused"])]

    assert asyncio.run(go()) == ["paused"]
    assert seen[-1].url.params.get_list("sandbox") == ["sbx_1"] and seen[-1].url.params["type"] == "paused"


def test_a_type_podbay_does_not_emit_gets_a_note_naming_the_types(capsys: pytest.CaptureFixture[str]) -> None:
    cli_events.note_unknown_types(["paused", "schedule.fired"])
    assert capsys.readouterr().err == ""
    cli_events.note_unknown_types(["bogus"])
    err = capsys.readouterr().err
    assert err.startswith("note: podbay emits no event of type 'bogus'") and "created, started" in err
    cli_events.note_unknown_types(["NOPE"])  # malformed: the request's own error says so, alone
    assert capsys.readouterr().err == ""
