"""The replicated control plane the fault tests break (issue 42, "faults"): a 3-server NATS JetStream cluster
(R3 streams and KV), a PostgreSQL of its own (one test restarts it), the session's S3, two processes each of
api, scheduler and warmpool, and simulated node agents (:mod:`podbay.devstack.simnode`) instead of QEMU, so a
fault costs seconds, not VM boots. One such fleet per module (the ``fleet`` fixture in conftest.py); :class:`Load` drives creates and
deletes through both APIs while a test breaks something, and :func:`check_invariants` asserts what must hold
afterwards."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import asyncpg
import httpx

from podbay.bus import Bus
from podbay.contracts import subjects
from podbay.devstack.servers import NatsServer
from podbay.devstack.simnode import SimFleet
from podbay.devstack.stack import Stack

NODES = 4
TEMPLATE = "faults"


@dataclass
class Fleet:
    """The running fault fleet: the stack (servers and control plane), the simulated nodes, a pool and a bus
    of the test's own, and the tenant's API key."""

    stack: Stack
    sim: SimFleet
    pool: asyncpg.Pool
    bus: Bus
    key: str
    tenant_id: str
    #: Every Idempotency-Key any load of the module sent (the tenant's sandboxes must all come from one).
    sent_keys: set[str] = field(default_factory=set)


def _code(r: httpx.Response) -> str:
    """The podbay error code of an answer (``{"error": {"code": ...}}``), or ``""``."""
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


@dataclass
class Op:
    """One client operation as the client saw it: which kind, its attempts' outcomes (status code or error
    name), when it started and when it was acknowledged (monotonic s; None: never), and the sandbox."""

    kind: str
    key: str
    started: float
    attempts: list[str] = field(default_factory=list)
    acked: float | None = None
    sandbox_id: str | None = None
    final: int | None = None
    #: The podbay error codes of the failed attempts' answers, in order (what a 503 was).
    codes: list[str] = field(default_factory=list)


class Load:
    """``workers`` clients, each creating a sandbox (with an ``Idempotency-Key``), waiting until it runs and
    deleting it, over and over, each request to the next API process in turn. A failed attempt (an error
    status or a broken connection) is retried, with the same key, on the other API, for up to ``retry_s``;
    every attempt's outcome is kept in :attr:`ops`."""

    def __init__(self, fleet: Fleet, *, workers: int = 4, retry_s: float = 60.0, pause_s: float = 0.05) -> None:
        self.fleet = fleet
        self.urls = fleet.stack.api_urls
        self.workers = workers
        self.retry_s = retry_s
        self.pause_s = pause_s
        self.ops: list[Op] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._turn = 0
        self._client = httpx.AsyncClient(headers={"Authorization": f"Bearer {fleet.key}"},
                                         timeout=httpx.Timeout(30.0, connect=3.0))

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._worker(), name=f"load-{i}") for i in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Start no new operation; let those in flight finish (their retries included)."""
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks)
            self._tasks = []
        await self._client.aclose()

    def _next_url(self) -> str:
        self._turn += 1
        return self.urls[self._turn % len(self.urls)]

    async def _call(self, op: Op, method: str, path: str, ok: set[int], **kw: object) -> httpx.Response | None:
        deadline = time.monotonic() + self.retry_s
        while time.monotonic() < deadline:
            try:
                r = await self._client.request(method, self._next_url() + path, **kw)  # type: ignore[arg-type]
            except httpx.HTTPError as exc:
                op.attempts.append(type(exc).__name__)
            else:
                op.attempts.append(str(r.status_code))
                if r.status_code >= 400:
                    op.codes.append(_code(r) or "?")
                if r.status_code in ok:
                    return r
                if (r.status_code < 500 and r.status_code not in (408, 429)) or _code(r) == "sandbox_failed":
                    op.final = r.status_code  # a clear refusal or failure: no retry changes it
                    return None
            await asyncio.sleep(0.2)
        return None

    async def _worker(self) -> None:
        while not self._stop.is_set():
            key = uuid.uuid4().hex
            self.fleet.sent_keys.add(key)
            op = Op("create", key, time.monotonic())
            self.ops.append(op)
            r = await self._call(op, "POST", "/v1/sandboxes", {201, 202}, json={"template": TEMPLATE},
                                 headers={"Idempotency-Key": key})
            if r is None:
                continue
            op.sandbox_id, op.final = r.json()["id"], r.status_code
            # Running before the delete (an answer of 202 means the start was not seen within the wait).
            while r.json()["state"] != "running" and time.monotonic() < op.started + self.retry_s:
                await asyncio.sleep(0.2)
                r2 = await self._call(op, "GET", f"/v1/sandboxes/{op.sandbox_id}", {200})
                r = r2 if r2 is not None else r
            if r.json()["state"] != "running":
                continue  # never acknowledged as running: check_invariants reports it
            op.acked = time.monotonic()
            dop = Op("delete", key, time.monotonic(), sandbox_id=op.sandbox_id)
            self.ops.append(dop)
            # 409 invalid_state on a retry: the first attempt deleted it and its answer was lost.
            r = await self._call(dop, "DELETE", f"/v1/sandboxes/{op.sandbox_id}", {200, 202, 409})
            if r is not None:
                dop.final, dop.acked = r.status_code, time.monotonic()
            await asyncio.sleep(self.pause_s)

    async def progress(self, since: float, creates: int = 5, timeout_s: float = 120.0) -> bool:
        """Wait until ``creates`` creates started at or after ``since`` (monotonic s) were acknowledged: the
        fleet works again. False when ``timeout_s`` passed first (a liveness bound, not a timing goal)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(1 for o in self.acked("create") if o.started >= since) >= creates:
                return True
            await asyncio.sleep(0.2)
        return False

    # --- figures ----------------------------------------------------------------------------------------------

    def acked(self, kind: str) -> list[Op]:
        return [o for o in self.ops if o.kind == kind and o.acked is not None]

    def recovery_s(self, fault_at: float) -> float:
        """From the fault to the acknowledgement of the first create started after it (s); inf: none was."""
        after = [o.acked - fault_at for o in self.acked("create") if o.started >= fault_at and o.acked]
        return min(after, default=float("inf"))

    def longest_gap_s(self, since: float) -> float:
        """The longest time without any acknowledgement, from ``since`` to the last one (s)."""
        times = sorted([since, *(o.acked for o in self.ops if o.acked is not None and o.acked >= since)])
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    def errors(self) -> Counter[str]:
        """Attempts that failed, by outcome (status code or exception name), over all operations."""
        return Counter(a for o in self.ops for a in o.attempts if a not in ("200", "201", "202"))


async def check_invariants(fleet: Fleet, load: Load, settle_s: float = 30.0) -> dict[str, int]:
    """After ``load`` stopped: every acknowledged create made exactly one sandbox, which ran once (one start on
    one node), and every acknowledged delete left it ``deleted`` and on no node; no idempotency key made two
    sandboxes and no sandbox of the tenant is stuck ``pending``/``starting``/``deleting`` once ``settle_s``
    passed. Returns the counts (acked creates and deletes, lost, doubled) for the report."""
    creates, deletes = load.acked("create"), load.acked("delete")
    deadline = time.monotonic() + settle_s
    while True:
        rows = {r["id"]: r for r in await fleet.pool.fetch(
            "SELECT s.id, s.state, s.node_id, s.generation, k.key FROM sandboxes s"
            " LEFT JOIN idempotency_keys k ON k.sandbox_id = s.id WHERE s.tenant_id = $1", fleet.tenant_id)}
        busy = [r for r in rows.values() if r["state"] in ("pending", "starting", "deleting")]
        if not busy or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert not busy, f"sandboxes left in flight: {[dict(r) for r in busy][:5]}"
    # One sandbox per key, and each sandbox came from a key the client sent (no create the client did not ask).
    by_key = Counter(r["key"] for r in rows.values())
    sent = fleet.sent_keys
    doubled = sum(n - 1 for n in by_key.values() if n > 1)
    assert doubled == 0, f"keys with more than one sandbox: {[k for k, n in by_key.items() if n > 1][:5]}"
    assert all(r["key"] in sent for r in rows.values()), "a sandbox of the tenant no create of the load asked for"
    lost = 0
    for op in creates:
        row = rows.get(op.sandbox_id or "")
        if row is None or row["key"] != op.key:
            lost += 1
            continue
        # Ran exactly once: one (node, generation) start among the simulated nodes.
        assert len(fleet.sim.started[op.sandbox_id or ""]) == 1, (op, fleet.sim.started[op.sandbox_id or ""])
    for op in deletes:
        row = rows.get(op.sandbox_id or "")
        if row is None or row["state"] != "deleted":
            lost += 1
    running_twice = [s for s, starts in fleet.sim.started.items() if len(starts) > 1]
    on_nodes = Counter(s for n in fleet.sim.nodes.values() for s in n.running)
    assert not running_twice and all(v == 1 for v in on_nodes.values()), (running_twice, on_nodes.most_common(3))
    deleted_ids = {op.sandbox_id for op in deletes}
    assert not deleted_ids & set(on_nodes), "a deleted sandbox still runs on a node"
    assert lost == 0, f"{lost} acknowledged operation(s) not done"
    # Every operation ended acknowledged or with a clear answer (a 4xx), never silently given up.
    unanswered = [o for o in load.ops if o.acked is None and o.final is None]
    assert not unanswered, f"operations that got no answer within {load.retry_s} s: {unanswered[:3]}"
    return {"creates_acked": len(creates), "deletes_acked": len(deletes), "lost": lost, "doubled": doubled}


#: One established TCP socket in ``ss -tnpH`` output: local port, peer port and the owning pid.
_SS_LINE = re.compile(r":(?P<local>\d+)\s+\S+:(?P<peer>\d+)\s+users:\(.*?pid=(?P<pid>\d+)")


class RoutePartition:
    """Cut one NATS server's routes to the other members while its client connections stay up: the
    partition of issue 42 where a server is alive (it answers its clients' pings) but alone.

    Everything runs on loopback, so the cut is by TCP port, in an nftables table of its own (``inet
    podbay_faults_<hex>``, hook ``output``, which loopback packets pass once): every packet to or from the
    server's route port (``member.cluster_port``: the route connections the others opened to it), every packet
    of the route connections the server itself opened to the others' route ports (their ephemeral ports read
    from ``ss -tnp`` by the server's pid), and every new connection to a route port (a reconnect would
    otherwise open a fresh, uncut route; the other members' routes between them stay up). Each is answered
    with a TCP reset rather than dropped: with silent drops, once (a load average of 25) the cluster had no
    working stream for minutes after the heal and the module's next tests failed (TCP's retransmission backoff
    and the servers' 2-minute route pings are what notice a healed silent route); with resets the routes fail
    at once, every reconnect is refused while the cut lasts, and they come back within a second or so of
    :meth:`heal`. The server's own client connections are untouched. Needs root, ``nft`` and ``ss``
    (scripts/setup.sh)."""

    def __init__(self, victim: NatsServer) -> None:
        if victim.member is None:
            raise ValueError(f"{victim.name} is not a member of a cluster")
        self.victim = victim
        self.own_port = victim.member.cluster_port
        self.other_ports = sorted(p for p in victim.member.route_ports if p != self.own_port)
        self.table = f"podbay_faults_{os.urandom(3).hex()}"
        self.cut_connections = 0

    def _routes(self) -> tuple[list[tuple[int, int]], int]:
        """``(ephemeral port, peer route port)`` of each route connection the victim opened, and how many the
        others opened to its route port (which of two servers keeps the connection between them varies)."""
        out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
        found, inbound = [], 0
        for line in out.splitlines():
            m = _SS_LINE.search(line)
            if m and int(m["pid"]) == self.victim.pid:
                if int(m["peer"]) in self.other_ports:
                    found.append((int(m["local"]), int(m["peer"])))
                elif int(m["local"]) == self.own_port:
                    inbound += 1
        return found, inbound

    def cut(self) -> None:
        """Install the table (one ``nft -f`` transaction, so the cut starts at once)."""
        routes, inbound = self._routes()
        #: Route connections the cut broke (opened by the victim or to it).
        self.cut_connections = len(routes) + inbound
        others = ", ".join(str(p) for p in self.other_ports)
        rules = [f"tcp dport {self.own_port} reject with tcp reset", f"tcp sport {self.own_port} reject with tcp reset",
                 f"tcp dport {{ {others} }} tcp flags & (syn | ack) == syn reject with tcp reset"]
        for local, peer in routes:
            rules += [f"tcp sport {local} tcp dport {peer} reject with tcp reset",
                      f"tcp sport {peer} tcp dport {local} reject with tcp reset"]
        body = "\n".join(f"    {r}" for r in rules)
        script = (f"table inet {self.table} {{\n  chain out {{\n    type filter hook output priority -10;"
                  f" policy accept;\n{body}\n  }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True, capture_output=True, timeout=30)

    def heal(self) -> None:
        """Delete the table (idempotent)."""
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True, check=False, timeout=30)


async def all_current(fleet: Fleet, timeout_s: float = 60.0) -> None:
    """Wait until both streams have a leader and both other replicas are current again (a restarted or cut-off
    server caught up). Raises AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            infos = [await fleet.bus.js.stream_info(s) for s in (subjects.CMD_STREAM, subjects.EVT_STREAM)]
            if all(i.cluster and i.cluster.leader and len(i.cluster.replicas or []) == 2
                   and all(p.current and not p.offline for p in i.cluster.replicas or []) for i in infos):
                return
        except Exception:  # noqa: BLE001 - no leader yet
            pass
        assert time.monotonic() < deadline, "the cluster's streams did not get all three replicas current again"
        await asyncio.sleep(0.5)
