"""``podbay up | down | status``: the all-in-one dev stack, supervised.

``up`` starts NATS, PostgreSQL and S3, then every service (see :mod:`podbay.devstack.stack`), creates a
development API key with ``podbay-api create-key --tenant dev --name dev --replace`` (revoking the dev key of
the last start: one live dev key per data directory) and saves ``{api_url, api_key}``
with :func:`podbay.clientconfig.save_client_config`. In the foreground it prints each service's log lines
prefixed with its name, restarts a part that dies (with back-off), and on Ctrl-C, SIGTERM or SIGHUP stops
everything in reverse order (SIGTERM, SIGKILL after a grace period). With ``detach=True`` it re-runs itself
as a background supervisor (``python -m podbay.devstack.supervisor``, output in ``<log_dir>/supervisor.log``)
and returns once the stack is ready.

Files in the data dir: ``stack.lock`` is held (``flock``) by the running supervisor and holds its pid, so a
second ``up`` sees a running stack and changes nothing; ``stack.json`` (mode 0600) records pids, ports, urls
and the services' environment for ``status``, ``down`` and ``podbay env``. A ``stack.json`` without a live
supervisor is stale: ``up`` and ``down`` stop whatever it still names and remove it.

Sandbox VMs are not parts of the stack: no path of ``up`` or ``down`` kills them (the node agent leaves them
running on SIGTERM and re-attaches them when it starts again), except ``down(purge=True)``, which also kills
this data dir's VMs and unmounts its node stores. ``up`` first checks that every port it will bind is free.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from pydantic import BaseModel
from rich.console import Console
from rich.text import Text

from podbay.clientconfig import ClientConfig, StackEdge, save_client_config
from podbay.config import Settings
from podbay.devstack import servers as srv
from podbay.devstack.netns import node_ids_for, purge_networks
from podbay.devstack.procs import process_start_ticks, run_sync, same_process, stop_pid, tail
from podbay.devstack.stack import (
    External,
    PortInUse,
    Stack,
    StackPorts,
    check_ports_free,
    find_strays,
    kill_strays,
    unmount_node_stores,
)

__all__ = ["PartStatus", "PartRecord", "StackState", "STATE_FILE", "up", "down", "status", "read_state", "stack_env"]

STATE_FILE = "stack.json"
LOCK_FILE = "stack.lock"
_COLOURS = {"api": "cyan", "scheduler": "magenta", "nodeagent": "green", "snapshotter": "yellow", "warmpool": "blue", "gateway": "red"}
_STOP_GRACE_S = 10.0
_READY_TIMEOUT_S = 600.0


class PartStatus(BaseModel):
    """One part of a running stack as ``status`` sees it; ``answering`` comes from a real client call."""

    name: str
    kind: Literal["server", "service"]
    url: str | None
    pid: int | None
    answering: bool
    detail: str


class PartRecord(BaseModel):
    """A part as recorded in ``stack.json``; ``pid`` is None for an external server."""

    name: str
    kind: Literal["server", "service"]
    url: str
    pid: int | None = None
    start_ticks: int | None = None
    log: str | None = None
    #: The network namespace a node's service runs in (multi-node stacks); probed from inside it.
    netns: str | None = None


class StackState(BaseModel):
    """The content of ``stack.json``."""

    state: Literal["starting", "ready", "stopping"]
    supervisor_pid: int
    supervisor_start_ticks: int | None
    started_at: float
    api_url: str
    data_dir: str
    log_dir: str
    ports: StackPorts
    parts: list[PartRecord] = []
    env: dict[str, str] = {}


# --- state and lock --------------------------------------------------------------------------------------


def read_state(settings: Settings) -> StackState | None:
    """``stack.json`` of ``settings.data_dir``, or None when absent or unreadable."""
    try:
        return StackState.model_validate_json((settings.data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def stack_env(settings: Settings) -> dict[str, str]:
    """The ``PODBAY_*`` and ``AWS_*`` variables of the running stack (for ``podbay env``); empty if none."""
    state = read_state(settings)
    if state is None:
        return {}
    return {k: v for k, v in state.env.items() if k.startswith(("PODBAY_", "AWS_"))}


def _write_state(settings: Settings, state: StackState) -> None:
    srv._save_json(settings.data_dir / STATE_FILE, state.model_dump(mode="json"))


def _lock_held(settings: Settings) -> bool:
    path = settings.data_dir / LOCK_FILE
    if not path.exists():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def _lock_pid(settings: Settings) -> int | None:
    try:
        return int((settings.data_dir / LOCK_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def _hold_lock(settings: Settings) -> Iterator[bool]:
    """Yields True while this process holds the stack lock, False if another process has it."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(settings.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield True
    finally:
        os.close(fd)


def _clean_stale(settings: Settings, state: StackState, console: Console) -> None:
    """Stop what a dead supervisor's ``stack.json`` still names (reverse order), then remove the file. Sandbox
    VMs are left running."""
    for part in reversed(state.parts):
        if part.pid and same_process(part.pid, part.start_ticks):
            console.print(f"stopping leftover {part.name} (pid {part.pid})")
            first = signal.SIGINT if part.name == "postgres" else signal.SIGTERM
            stop_pid(part.pid, part.start_ticks, grace_s=_STOP_GRACE_S, first_signal=first)
    # Sandbox VMs are not parts: the node agent leaves them running and the next one re-attaches them.
    (settings.data_dir / STATE_FILE).unlink(missing_ok=True)


# --- up --------------------------------------------------------------------------------------------------


class _StopRequested(BaseException):
    """Raised by the signal handler to abort a start-up in progress."""


def _console(daemon: bool) -> Console:
    if daemon:
        return Console(file=sys.stdout, no_color=True, highlight=False, soft_wrap=True)
    return Console(highlight=False, soft_wrap=True)


def _settings_env(settings: Settings) -> dict[str, str]:
    """Explicitly set settings as ``PODBAY_*`` variables, so a re-executed supervisor sees the same ones."""
    env = {f"PODBAY_{k.upper()}": str(v) for k, v in settings.model_dump(exclude_unset=True).items() if v is not None}
    env.update(PODBAY_DATA_DIR=str(settings.data_dir), PODBAY_LOG_DIR=str(settings.logs),
               PODBAY_CACHE_DIR=str(settings.cache_dir))  # fmt: skip
    return env


def _external(settings: Settings) -> External:
    ext = External.from_env()
    explicit = settings.model_fields_set
    return External(
        nats_url=settings.nats_url if "nats_url" in explicit else ext.nats_url,
        pg_dsn=settings.pg_dsn if "pg_dsn" in explicit else ext.pg_dsn,
        s3_url=settings.s3_url if "s3_url" in explicit else ext.s3_url,
        s3_access_key=ext.s3_access_key,
        s3_secret_key=ext.s3_secret_key,
    )


def up(settings: Settings, *, detach: bool = False, _daemon: bool = False) -> int:
    """Start the dev stack for ``settings`` (see the module docstring). Returns the process exit code:
    0 when it ran and was stopped, or is ready (``detach``), or was already running; 1 when start-up failed."""
    console = _console(_daemon)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings.logs.mkdir(parents=True, exist_ok=True)
    if _lock_held(settings):
        state = read_state(settings)
        where = f" (API {state.api_url}, supervisor pid {state.supervisor_pid})" if state else ""
        console.print(f"podbay stack already running{where}; nothing changed")
        return 0
    if read_state(settings) is None:
        # Checked here too (Stack.start checks again) so that the user sees the reason in this terminal; with
        # a stale state the ports may still be held by its leftovers, which the supervisor stops first.
        try:
            check_ports_free(StackPorts.from_settings(settings), _external(settings))
        except PortInUse as exc:
            console.print(Text(f"podbay up failed: {exc}", style="bold red"))
            return 1
    if detach:
        return _up_detached(settings, console)
    with _hold_lock(settings) as held:
        if not held:
            console.print("podbay stack already running; nothing changed")
            return 0
        return _run(settings, console, daemon=_daemon)


def _run(settings: Settings, console: Console, *, daemon: bool) -> int:
    stale = read_state(settings)
    if stale is not None:
        console.print(f"found a stale {STATE_FILE} (supervisor pid {stale.supervisor_pid} is gone); cleaning up")
        _clean_stale(settings, stale, console)
    stack = Stack(
        data_dir=settings.data_dir, log_dir=settings.logs, cache_dir=settings.cache_dir,
        ports=StackPorts.from_settings(settings), external=_external(settings),
        node_ids=node_ids_for(settings.nodes) if settings.nodes > 1 else [],
        nats_servers=settings.nats_servers,
        # On unless the environment or the config file says otherwise (the stack is one user's).
        webhook_allow_private=(settings.webhook_allow_private
                               if "webhook_allow_private" in settings.model_fields_set else True),
    )  # fmt: skip
    me = os.getpid()
    state = StackState(
        state="starting", supervisor_pid=me, supervisor_start_ticks=process_start_ticks(me), started_at=time.time(),
        api_url=stack.api_url, data_dir=str(settings.data_dir), log_dir=str(settings.logs), ports=stack.ports,
    )  # fmt: skip
    _write_state(settings, state)
    stopping = threading.Event()
    starting = True

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        if starting:
            raise _StopRequested(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    follower = None if daemon else _LogFollower(console, {n: stack.log_path(n) for n in stack.service_names()})
    try:
        if follower:
            follower.start()

        def ready(name: str) -> None:
            url = _url_of(stack, name)
            console.print(f"[bold]{name}[/bold] ready" + (f" at {url}" if url else ""))
            _record(settings, state, stack)

        try:
            stack.start(on_ready=ready)
            # One live dev key per data directory: each start replaces the one the last start saved.
            stack.create_api_key("dev", "dev", replace=True)
            edge = StackEdge(**{k: v or None for k, v in stack.edge_client().items()})
            path = save_client_config(ClientConfig(api_url=stack.api_url, api_key=stack.api_key), edge)
        except _StopRequested:
            stack.stop(grace_s=5.0)
            console.print("start-up interrupted; stopped")
            return 1
        except Exception as exc:  # noqa: BLE001 - any start-up failure is reported the same way
            console.print(Text(f"podbay up failed: {exc}", style="bold red"))
            stack.stop(grace_s=5.0)
            return 1
        starting = False
        state.state = "ready"
        _record(settings, state, stack)
        console.print(f"podbay stack ready: API {stack.api_url}, key saved to {path}, logs in {settings.logs}")
        _supervise(stack, settings, state, console, stopping)
        console.print("stopping the podbay stack")
        state.state = "stopping"
        _write_state(settings, state)
        stack.stop(grace_s=_STOP_GRACE_S)
        console.print("stopped")
        return 0
    finally:
        starting = False
        if follower:
            follower.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        (settings.data_dir / STATE_FILE).unlink(missing_ok=True)


def _url_of(stack: Stack, name: str) -> str:
    if name == "nats" or name.startswith("nats-"):
        # A cluster's server: its own URL (the stack's PODBAY_NATS_URL lists them all).
        server = stack.servers.get(name)
        return server.url if isinstance(server, srv.NatsServer) else stack.nats_url
    if name == "postgres":
        return stack.pg_dsn.split("@")[-1]
    if name == "s3":
        return stack.s3_url
    if name == "openbao":
        return stack.openbao_addr
    svc = stack.services.get(name)
    return svc.url if svc else ""


def _record(settings: Settings, state: StackState, stack: Stack) -> None:
    parts: list[PartRecord] = []
    cluster = [n for n in stack.servers if n.startswith("nats-")]
    for name in ("nats", *cluster, "postgres", "s3", "openbao"):
        server = stack.servers.get(name)
        url = _url_of(stack, name)
        if server is not None:
            parts.append(PartRecord(name=name, kind="server", url=url, pid=server.pid,
                                    start_ticks=process_start_ticks(server.pid), log=str(server.log_path)))  # fmt: skip
        elif url:
            parts.append(PartRecord(name=name, kind="server", url=url))
    for svc in stack.services.values():
        if svc.pid:
            parts.append(PartRecord(name=svc.name, kind="service", url=svc.url, pid=svc.pid,
                                    start_ticks=svc.start_ticks, log=str(svc.log_path), netns=svc.netns))  # fmt: skip
    state.parts, state.env = parts, dict(stack.env)
    _write_state(settings, state)


def _supervise(
    stack: Stack, settings: Settings, state: StackState, console: Console, stopping: threading.Event
) -> None:
    """Until a stop signal: restart a part that exits, waiting 1, 2, 4 ... 60 s between failed attempts."""
    backoff: dict[str, float] = {}
    next_try: dict[str, float] = {}
    while not stopping.wait(0.5):
        for name in stack.part_names():
            part: Any = stack.servers.get(name) or stack.services.get(name)
            if part.alive() or time.monotonic() < next_try.get(name, 0.0):
                continue
            code = part.proc.returncode if part.proc else None
            console.print(Text(f"{name} exited (code {code}); last lines of its log:\n{stack.log_tail(name, 20)}",
                               style="red"))  # fmt: skip
            try:
                stack.restart(name)
            except Exception as exc:  # noqa: BLE001 - keep supervising the others; retry later
                backoff[name] = min(60.0, backoff.get(name, 0.5) * 2)
                next_try[name] = time.monotonic() + backoff[name]
                console.print(Text(f"restarting {name} failed ({exc}); next try in {backoff[name]:.0f} s", style="red"))
            else:
                backoff.pop(name, None)
                console.print(f"{name} restarted (pid {stack.pid(name)})")
                _record(settings, state, stack)
            if stopping.is_set():
                return


class _LogFollower(threading.Thread):
    """Prints new lines of the services' log files, each prefixed with the service's name in its colour."""

    def __init__(self, console: Console, logs: dict[str, Path]) -> None:
        super().__init__(name="podbay-log-follower", daemon=True)
        self._console, self._logs = console, logs
        self._offsets = {name: (path.stat().st_size if path.exists() else 0) for name, path in logs.items()}
        self._partial: dict[str, str] = {}
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)
        self._poll()

    def run(self) -> None:
        while not self._halt.wait(0.2):
            self._poll()

    def _poll(self) -> None:
        width = max(len(n) for n in self._logs)
        for name, path in self._logs.items():
            try:
                with open(path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    if size < self._offsets[name]:
                        self._offsets[name] = 0
                    fh.seek(self._offsets[name])
                    chunk = fh.read(1 << 20)
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self._offsets[name] += len(chunk)
            lines = (self._partial.pop(name, "") + chunk.decode("utf-8", "replace")).split("\n")
            if lines[-1]:
                self._partial[name] = lines[-1]
            for line in lines[:-1]:
                if not line.strip():
                    continue
                prefix = Text(f"{name:<{width}} | ", style=_COLOURS.get(re.split("[-@]", name)[0], "dim"))
                self._console.print(prefix + Text(line))


def _up_detached(settings: Settings, console: Console) -> int:
    log = settings.logs / "supervisor.log"
    env = {**os.environ, **_settings_env(settings)}
    with open(log, "ab") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "podbay.devstack.supervisor"], env=env, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd="/",
        )  # fmt: skip
    console.print(f"starting the podbay stack in the background (supervisor pid {child.pid}, log {log})")
    deadline = time.monotonic() + _READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            code = child.poll()
            if code is not None:
                console.print(tail(log, 40))
                return code
            state = read_state(settings)
            if state is not None and state.state == "ready" and state.supervisor_pid == child.pid:
                console.print(f"podbay stack ready: API {state.api_url}; `podbay down` stops it")
                return 0
            time.sleep(0.2)
        console.print(f"the stack was not ready within {_READY_TIMEOUT_S:.0f} s; stopping it\n{tail(log, 40)}")
    except KeyboardInterrupt:
        console.print("interrupted; stopping the background supervisor")
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
    return 1


# --- down and status -------------------------------------------------------------------------------------


def down(settings: Settings, *, purge: bool = False) -> int:
    """Stop the stack of ``settings.data_dir``: SIGTERM to its supervisor, which stops every part in reverse
    order; if it does not finish within two minutes, SIGKILL it and stop the parts directly. A stale state
    is cleaned up. Returns 0 when no server or service of the stack runs any more, 1 otherwise.

    Sandbox VMs keep running (the next ``up`` re-attaches them) and their node store stays mounted; one line
    says how many were left. With ``purge`` this data dir's VMs are killed (:func:`kill_strays`), its
    node stores unmounted, their loop devices detached (:func:`unmount_node_stores`), and its host network
    (nftables table, node namespaces, bridge) removed (:func:`purge_networks`).
    """
    console = Console(highlight=False, soft_wrap=True)
    code = _stop_supervisor(settings, console)
    vms = len(find_strays(settings.data_dir, qemu_only=True))  # one per VM (not its bubblewrap too)
    if purge:
        kill_strays(settings.data_dir)
        stores = unmount_node_stores(settings.data_dir)
        nets = purge_networks(settings.data_dir)
        console.print(f"{vms} sandbox VM(s) stopped, {len(stores)} node store(s) unmounted"
                      + (", network rules, namespaces and bridge removed" if nets else ""))
        return code
    if find_strays(settings.data_dir):  # a VM, or a bubblewrap still holding the store
        console.print(f"{vms} sandbox VM(s) left running; the next podbay up re-attaches them; "
                      "podbay down --purge stops them")  # fmt: skip
    elif code == 0:
        # Neither a VM nor the node agent uses the stores any more; the next up mounts them again.
        unmount_node_stores(settings.data_dir)
    return code


def _stop_supervisor(settings: Settings, console: Console) -> int:
    state = read_state(settings)
    if not _lock_held(settings):
        if state is None:
            console.print("podbay stack is not running")
            return 0
        _clean_stale(settings, state, console)
        console.print("cleaned up a stale podbay stack")
        return 0
    pid = state.supervisor_pid if state else _lock_pid(settings)
    ticks = state.supervisor_start_ticks if state else None
    if pid is None:
        console.print(Text("the stack lock is held but names no supervisor pid", style="red"))
        return 1
    console.print(f"stopping the podbay stack (supervisor pid {pid})")
    gone = stop_pid(pid, ticks, grace_s=120.0, first_signal=signal.SIGTERM)
    leftover = read_state(settings)
    if leftover is not None:
        _clean_stale(settings, leftover, console)
    if not gone or _lock_held(settings):
        console.print(Text("the supervisor did not stop", style="red"))
        return 1
    console.print("stopped")
    return 0


def status(settings: Settings) -> list[PartStatus]:
    """Each recorded part of the stack with its pid and whether a real client call answers (NATS JetStream
    account info, PostgreSQL ``SELECT 1``, S3 ``list_buckets``, ``GET /healthz``). Empty when no stack runs."""
    state = read_state(settings)
    if state is None:
        return []
    supervised = _lock_held(settings)
    return run_sync(_probe_all(state, supervised))


async def _probe_all(state: StackState, supervised: bool) -> list[PartStatus]:
    import asyncio

    import httpx

    # The probes' client libraries load here, before any probe's 3 s starts: an import blocks the event loop
    # (nats-py, asyncpg and aiobotocore took 3.3 s together on a loaded 2-core host), and loaded inside the
    # probes it made all three time out at once and report healthy servers as down.
    import aiobotocore.session  # noqa: F401  # imported early on purpose (comment above)
    import asyncpg  # noqa: F401  # imported early on purpose (comment above)
    import nats  # noqa: F401  # imported early on purpose (comment above)

    async def probe(part: PartRecord) -> PartStatus:
        running = part.pid is None or same_process(part.pid, part.start_ticks)
        env = state.env
        try:
            if not running:
                raise RuntimeError("process not running")
            if part.name == "nats":
                await asyncio.wait_for(srv.probe_nats(env.get("PODBAY_NATS_URL", part.url)), 3)
            elif part.name.startswith("nats-"):  # one server of a cluster, at its own URL
                await asyncio.wait_for(srv.probe_nats(part.url), 3)
            elif part.name == "postgres":
                await asyncio.wait_for(srv.probe_postgres(env["PODBAY_PG_DSN"]), 3)
            elif part.name == "s3":
                await asyncio.wait_for(srv.probe_s3(part.url, env.get("AWS_ACCESS_KEY_ID", ""),
                                                    env.get("AWS_SECRET_ACCESS_KEY", "")), 3)  # fmt: skip
            elif part.name == "openbao":
                from podbay.devstack.openbao import probe_openbao

                await asyncio.wait_for(probe_openbao(part.url, env.get("PODBAY_OPENBAO_TOKEN", "")), 3)
            elif part.netns:
                # A node's service in its own network namespace: ask from inside it.
                argv = ["nsenter", f"--net=/run/netns/{part.netns}", "--", "curl", "-s", "-o", "/dev/null",
                        "-w", "%{http_code}", "-m", "3", f"{part.url}/healthz"]
                done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=10,
                                               check=False)
                if done.stdout.strip() != "200":
                    raise RuntimeError(f"/healthz answered {done.stdout.strip() or 'nothing'} in {part.netns}")
            else:
                async with httpx.AsyncClient(timeout=3) as client:
                    resp = await client.get(f"{part.url}/healthz")
                if resp.status_code != 200:
                    raise RuntimeError(f"/healthz answered {resp.status_code}")
        except Exception as exc:  # noqa: BLE001 - reported per part
            detail = str(exc) or type(exc).__name__
            return PartStatus(name=part.name, kind=part.kind, url=part.url, pid=part.pid if running else None,
                              answering=False, detail=detail)  # fmt: skip
        detail = "external" if part.pid is None else ("running" if supervised else "running, no supervisor")
        return PartStatus(name=part.name, kind=part.kind, url=part.url, pid=part.pid, answering=True, detail=detail)

    return list(await asyncio.gather(*(probe(p) for p in state.parts)))


def _daemon_main() -> int:
    """Entry of the background supervisor that ``up(detach=True)`` starts."""
    return up(Settings(), detach=False, _daemon=True)


if __name__ == "__main__":
    sys.exit(_daemon_main())
