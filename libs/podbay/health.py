"""Readiness checks shared by every service's ``/readyz``.

``/healthz`` says the process lives and its event loop turns (it answers from that loop). ``/readyz`` says the
process can do its job now: each service lists named checks (its servers answer, its consumers are bound, the
node store is mounted...). A check is an async callable that returns ``None`` when fine or a short reason
string when not; raising or taking longer than ``CHECK_TIMEOUT_S`` counts as not ready with the error as the
reason. Orchestrators (Kubernetes readiness probes, load balancers) stop sending work to a 503 answer.

Answer shape (both 200 and 503): ``{"service": str, "ready": bool, "checks": {name: "ok" | reason}}``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

__all__ = ["Check", "CHECK_TIMEOUT_S", "run_checks", "readiness_response", "nats_check", "pg_check",
           "consumer_check", "mount_check", "task_check"]

Check = Callable[[], Awaitable[str | None]]
CHECK_TIMEOUT_S = 2.0


async def _one(check: Check) -> str:
    try:
        reason = await asyncio.wait_for(check(), timeout=CHECK_TIMEOUT_S)
    except TimeoutError:
        return f"no answer within {CHECK_TIMEOUT_S:g} s"
    except Exception as exc:  # a dependency's client error is the reason, not a crash of the probe
        return f"{type(exc).__name__}: {exc}"[:300]
    return "ok" if reason is None else reason


async def run_checks(checks: dict[str, Check]) -> tuple[bool, dict[str, str]]:
    """Run every check concurrently. Returns ``(all_ok, {name: "ok" | reason})``."""
    names = list(checks)
    results = await asyncio.gather(*(_one(checks[n]) for n in names))
    out = dict(zip(names, results, strict=True))
    return all(r == "ok" for r in results), out


async def readiness_response(service: str, checks: dict[str, Check]) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` for ``/readyz``: 200 when every check passes, else 503 with the reasons."""
    ok, results = await run_checks(checks)
    return (200 if ok else 503), {"service": service, "ready": ok, "checks": results}


def nats_check(bus: Any) -> Check:
    """NATS is connected and JetStream answers (an account-info round trip)."""

    async def check() -> str | None:
        if not bus.nc.is_connected:
            return "NATS not connected"
        await bus.js.account_info()
        return None

    return check


def pg_check(pool: Any) -> Check:
    """PostgreSQL answers ``SELECT 1`` from the service's pool."""

    async def check() -> str | None:
        await pool.fetchval("SELECT 1")
        return None

    return check


def consumer_check(get_sub: Callable[[], Any]) -> Check:
    """The service's durable JetStream consumer is bound: ``get_sub()`` returns the pull subscription (or None
    before it is made) and the server knows its consumer."""

    async def check() -> str | None:
        sub = get_sub()
        if sub is None:
            return "consumer not bound yet"
        info = await sub.consumer_info()
        return None if info is not None else "consumer unknown to the server"

    return check


def mount_check(path: Path) -> Check:
    """``path`` is a mount point (the node's btrfs store)."""

    async def check() -> str | None:
        return None if await asyncio.to_thread(os.path.ismount, path) else f"{path} is not mounted"

    return check


def task_check(what: str, get_task: Callable[[], asyncio.Task[Any] | None]) -> Check:
    """A long-running task of the service (a server, a loop) is still running."""

    async def check() -> str | None:
        task = get_task()
        if task is None:
            return f"{what} not started"
        if task.done():
            return f"{what} stopped"
        return None

    return check
