"""Process helpers shared by the dev-stack servers, the supervisor and the test fixtures.

Linux only: liveness and identity come from ``/proc``. A pid alone is not an identity (pids are reused), so
every recorded process is a ``(pid, start_ticks)`` pair, where ``start_ticks`` is field 22 of
``/proc/<pid>/stat`` (clock ticks after boot). :func:`same_process` compares both before anything is signalled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "find_binary",
    "free_port",
    "free_ports",
    "port_is_free",
    "process_start_ticks",
    "same_process",
    "pid_alive",
    "signal_process",
    "stop_process",
    "stop_pid",
    "tail",
    "run_sync",
]

T = TypeVar("T")


def find_binary(name: str) -> Path:
    """The executable ``name``: first next to ``sys.executable`` (the venv's bin), then on ``PATH``.

    Raises ``FileNotFoundError`` when neither has it.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH")


#: Where test stacks' ports are drawn from when the kernel's ephemeral range leaves room below it.
_PICK_FLOOR = 10000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (``net.ipv4.ip_local_port_range``; Linux's default)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (another process may take it; see :func:`free_ports`)."""
    return free_ports(1, host)[0]


#: Every port :func:`free_ports` has handed out in this process. A stack chooses its services' ports first and
#: its servers' own listeners (weed's master, volume, filer and gRPC ports, OpenBao, replicas) later, while
#: those services are not yet listening; a port handed out once is never handed out again, so the later
#: choice cannot take a port the earlier one reserved (seen: weed's master gRPC on the scheduler's port).
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()  # stacks start their servers on threads


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on every address, chosen below the kernel's ephemeral range.

    Why not the kernel's pick (``bind(0)``): that draws from the ephemeral range, where every outgoing
    connection also takes its local port, so on a busy host a port chosen that way was seen taken by a
    connection before the server bound it (a gateway on ``0.0.0.0`` failed with EADDRINUSE). The kernel never
    hands out ports below the range on its own, so those collide only with explicit binds. Each candidate is
    bound on ``0.0.0.0`` (so no address holds it) with SO_REUSEADDR (as servers bind), and all stay bound until
    every port is chosen, so none repeats. Falls back to the kernel's pick when the range leaves no room.
    No port is handed out twice in one process (:data:`_HANDED_OUT`), even after its probe closed.
    ``host`` is kept for callers; the check covers every address."""
    with _HANDED_OUT_LOCK:
        ports = _pick_ports(count, host)
        _HANDED_OUT.update(ports)
        return ports


def _pick_ports(count: int, host: str) -> list[int]:
    lo, _hi = _ephemeral_range()
    socks: list[socket.socket] = []
    skipped: list[socket.socket] = []  # kernel picks already handed out, held so they are not picked again
    try:
        if lo - _PICK_FLOOR >= 1000:
            for port in random.sample(range(_PICK_FLOOR, lo), min(lo - _PICK_FLOOR, 64 * count + 64)):
                if len(socks) == count:
                    break
                if port in _HANDED_OUT:
                    continue
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("0.0.0.0", port))  # noqa: S104 - a probe, closed before use
                except OSError:
                    sock.close()
                    continue
                socks.append(sock)
        while len(socks) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            (skipped if int(sock.getsockname()[1]) in _HANDED_OUT else socks).append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in (*socks, *skipped):
            sock.close()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind ``port`` on ``host`` now (with SO_REUSEADDR, as servers do, so that
    connections left in TIME_WAIT by a stopped server do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks after boot), or None if there is no such pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after the last ')' are fixed.
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[19])


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return raw[raw.rindex(")") + 2 :].split()[0] != "Z"


def same_process(pid: int | None, start_ticks: int | None) -> bool:
    """True when ``pid`` is alive and is the very process recorded with ``start_ticks``."""
    if not pid or not pid_alive(pid):
        return False
    return start_ticks is None or process_start_ticks(pid) == start_ticks


def signal_process(pid: int, sig: int, start_ticks: int | None = None) -> bool:
    """Send ``sig`` to ``pid`` if it is still the recorded process; returns whether it was sent."""
    if not same_process(pid, start_ticks):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_process(
    proc: subprocess.Popen[Any], *, grace_s: float = 10.0, first_signal: int = signal.SIGTERM
) -> int | None:
    """Stop a child: ``first_signal``, wait up to ``grace_s`` seconds, then SIGKILL. Returns its exit code."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        proc.send_signal(first_signal)
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)
    except ProcessLookupError:
        return proc.wait(timeout=10)


def stop_pid(
    pid: int, start_ticks: int | None, *, grace_s: float = 10.0, first_signal: int = signal.SIGTERM
) -> bool:
    """Like :func:`stop_process` for a process that is not our child; returns whether it is gone."""
    if not signal_process(pid, first_signal, start_ticks):
        return True
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not same_process(pid, start_ticks):
            return True
        time.sleep(0.05)
    signal_process(pid, signal.SIGKILL, start_ticks)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not same_process(pid, start_ticks):
            return True
        time.sleep(0.05)
    return False


def tail(path: Path, lines: int = 40, *, start: int = 0) -> str:
    """The last ``lines`` lines of a text file after byte ``start`` (at most its last 64 KiB), or ``""`` if it
    does not exist."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(start if start <= size else 0, size - 65536))
            data = fh.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, even when this thread already runs an event loop.

    With a running loop (e.g. a sync helper called from async test code) it runs on a fresh loop in a worker
    thread, since a loop cannot be re-entered.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
