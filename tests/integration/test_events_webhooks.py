"""Event subscribers against the real stack (NATS, PostgreSQL, the API process; no microVM): the event
stream's tenant isolation, filters, follow and resume, the CLI's ``--resume``, and webhook delivery
(signature, retry after a 500, one delivery with several deliverers, no delivery to non-public addresses
unless ``PODBAY_WEBHOOK_ALLOW_PRIVATE``, which the test stack turns on for its loopback receivers)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from access_helpers import Tenant, second_api, template_and_sandbox

from podbay import db
from podbay.bus import connect_bus
from podbay.contracts import subjects
from podbay.devstack.stack import Stack
from podbay.outbox import Relay, emit_sandbox_event
from podbay.sdk import Client
from podbay.webhooks import ALLOW_PRIVATE_SETTING, Deliverer, resolve_host, verify_signature

pytestmark = pytest.mark.integration




def emit(stack: Stack, *events: tuple[str, str]) -> None:
    """Commit ``(sandbox id, type)`` events through the outbox (tenant from the sandbox row) and relay them."""

    async def run() -> None:
        pool = await db.connect_pool(stack.pg_dsn, min_size=1, max_size=2)
        bus = await connect_bus(stack.nats_url, name="test-events")
        try:
            for sbx, typ in events:
                async with pool.acquire() as conn, conn.transaction():
                    await emit_sandbox_event(conn, sbx, typ, state=typ)
            await Relay(pool, bus).flush()
        finally:
            await bus.close()
            await pool.close()

    asyncio.run(run())


def wait_until(cond: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def listed(t: Tenant, **params: Any) -> list[dict[str, Any]]:
    with t.http() as http:
        r = http.get("/v1/events", params={**params, "follow": "false"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_events_are_tenant_scoped_and_filtered(stack: Stack, acme: Tenant, other: Tenant) -> None:
    _, a1 = template_and_sandbox(stack, acme)
    _, a2 = template_and_sandbox(stack, acme)
    _, b1 = template_and_sandbox(stack, other)
    emit(stack, (a1, "created"), (b1, "created"), (a1, "paused"), (a2, "resumed"), (b1, "paused"), (a1, "deleted"))
    mine = listed(acme, sandbox=[a1, a2])
    assert [(e["sandbox_id"], e["type"]) for e in mine] == [(a1, "created"), (a1, "paused"), (a2, "resumed"),
                                                           (a1, "deleted")]
    assert [e["seq"] for e in mine] == sorted(e["seq"] for e in mine) and len({e["seq"] for e in mine}) == 4
    # Everything acme sees, unfiltered, is acme's; the other tenant's sandbox never shows up.
    everything = listed(acme)
    assert everything and all(e["tenant_id"] == acme.tenant_id for e in everything)
    assert b1 not in {e["sandbox_id"] for e in everything}
    assert listed(other, sandbox=a1) == []
    assert [e["type"] for e in listed(other, sandbox=b1)] == ["created", "paused"]
    # Type filters (repeatable), and a position.
    assert [e["type"] for e in listed(acme, sandbox=a1, type=["paused", "deleted"])] == ["paused", "deleted"]
    assert [e["type"] for e in listed(acme, sandbox=[a1, a2], after=mine[1]["seq"])] == ["resumed", "deleted"]
    with acme.http() as http:
        by_header = http.get("/v1/events", params={"sandbox": a1}, headers={"Last-Event-ID": str(mine[0]["seq"])})
        assert [json.loads(x)["type"] for x in by_header.text.splitlines() if x] == ["paused", "deleted"]
        for params, headers, status in (({"type": "Paused!"}, {}, 400), ({"sandbox": "a b"}, {}, 400),
                                        ({"after": "-1"}, {}, 422), ({}, {"Last-Event-ID": "abc"}, 400)):
            r = http.get("/v1/events", params=params, headers=headers)
            assert r.status_code == status, (params, r.text)
            assert r.json()["error"]["code"] in ("invalid_request", "validation_error")
    with httpx.Client(base_url=stack.api_url) as anon:
        assert anon.get("/v1/events").status_code == 401


def _read_events(resp: httpx.Response, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in resp.iter_lines():
        if line.strip():
            out.append(json.loads(line))
            if len(out) == n:
                return out
    raise AssertionError(f"stream ended after {len(out)} of {n} events")


def _ephemeral_consumers(stack: Stack) -> int:
    async def run() -> int:
        bus = await connect_bus(stack.nats_url, name="test-events-consumers")
        try:
            return (await bus.js.stream_info(subjects.EVT_STREAM)).state.consumer_count
        finally:
            await bus.close()

    return asyncio.run(run())


def test_follow_then_resume_from_position_has_no_loss_and_no_repeat(stack: Stack, acme: Tenant) -> None:
    _, sbx = template_and_sandbox(stack, acme)
    before = _ephemeral_consumers(stack)
    with acme.http() as http, http.stream("GET", "/v1/events", params={"sandbox": sbx, "follow": "true"},
                                          timeout=httpx.Timeout(30, read=60)) as resp:
        assert resp.status_code == 200
        # Live: events committed after the subscriber started reach it.
        emit(stack, (sbx, "created"), (sbx, "started"), (sbx, "paused"))
        first = _read_events(resp, 3)
    assert [e["type"] for e in first] == ["created", "started", "paused"]
    # The request's consumer goes away with the client.
    wait_until(lambda: _ephemeral_consumers(stack) <= before, "the follower's consumer to be deleted")
    emit(stack, (sbx, "resumed"), (sbx, "paused"), (sbx, "deleted"))
    with acme.http() as http, http.stream("GET", "/v1/events", params={
            "sandbox": sbx, "follow": "true", "after": first[-1]["seq"]}, timeout=httpx.Timeout(30, read=60)) as resp:
        rest = _read_events(resp, 3)
    assert [e["type"] for e in rest] == ["resumed", "paused", "deleted"]
    seqs = [e["seq"] for e in first + rest]
    assert seqs == sorted(seqs) and len(set(seqs)) == 6
    assert [e["data"]["seq"] for e in first + rest] == [1, 2, 3, 4, 5, 6]
    # The SDK's iterator yields the same events as models.
    with Client(stack.api_url, acme.key) as c:
        got = list(c.events(sandbox=sbx, after=first[0]["seq"]))
    assert [(e.seq, e.type) for e in got] == [(e["seq"], e["type"]) for e in (first + rest)[1:]]


def _cli(stack: Stack, tenant: Tenant, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": tenant.key,
           "PODBAY_CONFIG": str(config)}
    return subprocess.run([str(Path(sys.executable).parent / "podbay"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_cli_events_resume_continues_after_the_last_printed(stack: Stack, acme: Tenant, tmp_path: Path) -> None:
    _, sbx = template_and_sandbox(stack, acme)
    emit(stack, (sbx, "created"), (sbx, "started"))
    cfg = tmp_path / "podbay" / "config.json"
    one = _cli(stack, acme, cfg, "events", "--sandbox", sbx, "--resume", "ci")
    assert one.returncode == 0, one.stderr
    lines = one.stdout.splitlines()
    assert [ln.split("\t")[3] for ln in lines] == ["created", "started"]
    assert (tmp_path / "podbay" / "events" / "ci.pos").read_text().strip() == lines[-1].split("\t")[0]
    emit(stack, (sbx, "paused"))
    two = _cli(stack, acme, cfg, "events", "--sandbox", sbx, "--resume", "ci", "--json")
    assert two.returncode == 0, two.stderr
    assert [json.loads(x)["type"] for x in two.stdout.splitlines()] == ["paused"]
    bad = _cli(stack, acme, cfg, "events", "--type", "NOPE")
    assert bad.returncode == 2 and bad.stderr.startswith("error: invalid event type")
    bad = _cli(stack, acme, cfg, "events", "--resume", "../x")
    assert bad.returncode == 2 and "invalid --resume name" in bad.stderr


class Receiver:
    """A local HTTP endpoint that records POSTs and answers from a script (then 200)."""

    def __init__(self, script: list[int] | None = None) -> None:
        self.requests: list[tuple[dict[str, str], bytes, int]] = []
        self.script = list(script or [])
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with outer.lock:
                    status = outer.script.pop(0) if outer.script else 200
                    outer.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def test_webhook_signed_retried_after_500_and_state_recorded(stack: Stack, acme: Tenant, other: Tenant,
                                                            receiver: Receiver, tmp_path: Path) -> None:
    receiver.script = [500]
    _, sbx = template_and_sandbox(stack, acme)
    _, theirs = template_and_sandbox(stack, other)
    with acme.http() as http:
        r = http.post("/v1/webhooks", json={"url": receiver.url, "types": ["paused"]})
        assert r.status_code == 201, r.text
        hook = r.json()
        assert hook["secret"].startswith("whsec_")
        listed_hooks = http.get("/v1/webhooks").json()["webhooks"]
        assert [h["id"] for h in listed_hooks] == [hook["id"]] and hook["secret"] not in json.dumps(listed_hooks)
        for bad in ({"url": "ftp://x"}, {"url": receiver.url, "types": ["No!"]}, {"url": "http://x", "extra": 1}):
            assert http.post("/v1/webhooks", json=bad).status_code == 422
    emit(stack, (sbx, "started"), (theirs, "paused"), (sbx, "paused"))
    wait_until(lambda: len(receiver.requests) >= 2, "a retried delivery")
    (h1, b1, s1), (h2, b2, s2) = receiver.requests[:2]
    assert (s1, s2) == (500, 200)
    assert b1 == b2 and h1["podbay-event-id"] == h2["podbay-event-id"]
    body = json.loads(b2)
    assert body["type"] == "paused" and body["sandbox_id"] == sbx and body["tenant_id"] == acme.tenant_id
    assert str(body["seq"]) == h2["podbay-event-seq"]
    assert verify_signature(hook["secret"], h2["podbay-signature"], b2)
    assert not verify_signature(hook["secret"], h2["podbay-signature"], b2 + b" ")
    assert not verify_signature("whsec_other", h2["podbay-signature"], b2)

    def recorded() -> dict[str, Any] | None:
        with acme.http() as http:
            h = http.get("/v1/webhooks").json()["webhooks"][0]
        return h if h["deliveries"] == 1 else None

    state = wait_until(recorded, "the delivery state")
    assert state["last_status"] == 200 and state["last_attempts"] == 2 and state["failures"] == 0
    assert state["last_event_seq"] == body["seq"] and state["last_error"] is None
    # The CLI shows it; deleting stops deliveries (the other tenant cannot delete it).
    cfg = tmp_path / "config.json"
    out = _cli(stack, acme, cfg, "webhook", "list")
    assert out.returncode == 0 and hook["id"] in out.stdout and "200" in out.stdout, out.stderr
    with other.http() as http:
        assert http.delete(f"/v1/webhooks/{hook['id']}").status_code == 404
    assert _cli(stack, acme, cfg, "webhook", "rm", hook["id"]).returncode == 0
    with acme.http() as http:
        assert http.get("/v1/webhooks").json()["webhooks"] == []
    assert len(receiver.requests) == 2  # the other tenant's and the 'started' events were never sent here


def test_several_deliverers_deliver_each_event_once(stack: Stack, acme: Tenant, receiver: Receiver,
                                                    tmp_path: Path) -> None:
    _, sbx = template_and_sandbox(stack, acme)
    added = _cli(stack, acme, tmp_path / "config.json", "webhook", "add", receiver.url, "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["secret"].startswith("whsec_")
    n = 12

    async def run() -> None:
        # Two more deliverers beside the API process's own, sharing its durable consumer.
        pool = await db.connect_pool(stack.pg_dsn, min_size=1, max_size=4)
        buses = [await connect_bus(stack.nats_url, name=f"test-deliverer-{i}") for i in range(2)]
        stop = asyncio.Event()
        # Like the stack's API, they may reach the loopback receiver.
        tasks = [asyncio.create_task(Deliverer(pool, b, backoff_s=0.1, allow_private=True).run(stop)) for b in buses]
        try:
            await asyncio.to_thread(emit, stack, *[(sbx, t) for t in ["paused", "resumed"] * (n // 2)])
            deadline = time.monotonic() + 60
            while len(receiver.requests) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            # Until the shared consumer has nothing pending or unacked, a duplicate could still come.
            while time.monotonic() < deadline:
                info = await buses[0].js.consumer_info(subjects.EVT_STREAM, "webhooks")
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for b in buses:
                await b.close()
            await pool.close()

    asyncio.run(run())
    ids = [h["podbay-event-id"] for h, _, _ in receiver.requests]
    assert len(ids) == n and len(set(ids)) == n
    seqs = [json.loads(b)["seq"] for _, b, _ in receiver.requests]
    assert len(set(seqs)) == n


@pytest.fixture(scope="module")
def public_only_api(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The production default (non-public destinations refused), no deliverer or firer of its own: the stack's
    # API delivers.
    with second_api(stack, tmp_path_factory.mktemp("public-only-api") / "api.log",
                    **{ALLOW_PRIVATE_SETTING: "0", "PODBAY_WEBHOOKS_ENABLED": "0",
                       "PODBAY_SCHEDULES_ENABLED": "0"}) as url:
        yield url


def test_webhook_to_a_non_public_address_is_refused_unless_allowed(stack: Stack, acme: Tenant,
                                                                   public_only_api: str) -> None:
    with httpx.Client(base_url=public_only_api, headers={"authorization": f"Bearer {acme.key}"},
                      timeout=30) as http:
        for url, host in (("http://169.254.169.254/x", "169.254.169.254"), ("http://127.0.0.1:1/x", "127.0.0.1"),
                          ("http://[::1]/x", "::1"), ("http://localhost/x", "localhost")):
            r = http.post("/v1/webhooks", json={"url": url})
            assert r.status_code == 422, (url, r.text)
            err = r.json()["error"]
            assert err["code"] == "validation_error", err
            assert host in err["message"] and ALLOW_PRIVATE_SETTING in err["message"], err
            assert err["details"]["setting"] == ALLOW_PRIVATE_SETTING and err["details"]["host"] == host
        assert http.get("/v1/webhooks").json()["webhooks"] == []  # nothing was stored
        public = http.post("/v1/webhooks", json={"url": "https://hooks.example.com/podbay"})
        assert public.status_code == 201, public.text
        assert http.delete(f"/v1/webhooks/{public.json()['id']}").status_code == 200
    # The stack's API has the setting on (a dev stack's receivers listen on loopback).
    with acme.http() as http:
        allowed = http.post("/v1/webhooks", json={"url": "http://127.0.0.1:1/x"})
        assert allowed.status_code == 201, allowed.text
        assert http.delete(f"/v1/webhooks/{allowed.json()['id']}").status_code == 200


def test_delivery_to_a_name_resolving_to_loopback_is_refused_when_off(stack: Stack, acme: Tenant,
                                                                      public_only_api: str,
                                                                      receiver: Receiver) -> None:
    port = int(receiver.url.split(":")[2].split("/")[0])
    # A name the API cannot judge at registration; it points at loopback only when resolved, as an
    # attacker's DNS name would. The last step is the system resolver's answer for "localhost".
    name = "hooks.podbay.test"

    async def resolver(host: str, p: int) -> list[str]:
        return await resolve_host("localhost" if host == name else host, p)

    with httpx.Client(base_url=public_only_api, headers={"authorization": f"Bearer {acme.key}"},
                      timeout=30) as http:
        r = http.post("/v1/webhooks", json={"url": f"http://{name}:{port}/hook"})
        assert r.status_code == 201, r.text
        hook_id = r.json()["id"]
    event = {"id": "evt_ssrf", "type": "paused", "tenant_id": acme.tenant_id, "sandbox_id": "sbx_ssrf"}
    acked: list[str] = []

    async def done(**_: Any) -> None:
        acked.append("done")

    msg = SimpleNamespace(data=json.dumps(event).encode(), metadata=SimpleNamespace(sequence=SimpleNamespace(
        stream=424242)), ack=done, nak=done, term=done)

    async def run() -> None:
        pool = await db.connect_pool(stack.pg_dsn, min_size=1, max_size=2)
        bus = await connect_bus(stack.nats_url, name="test-refusing-deliverer")
        try:
            await Deliverer(pool, bus, max_attempts=3, backoff_s=0.01, resolver=resolver).handle(msg)  # type: ignore[arg-type]
        finally:
            await bus.close()
            await pool.close()

    asyncio.run(run())
    assert acked == ["done"]
    assert receiver.requests == []  # not one connection to the loopback receiver
    with acme.http() as http:
        hook = next(h for h in http.get("/v1/webhooks").json()["webhooks"] if h["id"] == hook_id)
        http.delete(f"/v1/webhooks/{hook_id}")
    assert (hook["deliveries"], hook["failures"], hook["last_status"], hook["last_attempts"]) == (0, 1, None, 1)
    assert hook["last_event_seq"] == 424242
    assert hook["last_error"].startswith(tuple(f"refused: {name} resolves to {a}, a loopback address"
                                              for a in ("127.0.0.1", "::1"))), hook["last_error"]
    assert ALLOW_PRIVATE_SETTING in hook["last_error"]
