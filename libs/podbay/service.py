"""The common frame of a podbay service process: uvloop, signals, a small HTTP server, clean stop.

``run_service(name, main)`` installs uvloop, runs ``main(stop_event)`` and sets ``stop_event`` on SIGTERM or
SIGINT, so each service shuts down by finishing its own work rather than by being cancelled mid-step.
``serve_http`` runs a FastAPI app on uvicorn inside the service's own loop. ``health_app`` serves
``/healthz`` (liveness), ``/readyz`` (readiness, see :mod:`podbay.health`) and ``/metrics`` (which needs
``PODBAY_METRICS_TOKEN`` when one is set: :mod:`podbay.metricsauth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
import uvloop
from fastapi import FastAPI, Header, Response

from podbay.config import ConfigError, get_settings
from podbay.health import Check, readiness_response
from podbay.metricsauth import metrics_response, token_matches, unauthorized_response
from podbay.telemetry import setup_logging

__all__ = ["run_service", "serve_http", "health_app", "readyz_route", "wait_stop", "run_every"]

log = logging.getLogger("podbay.service")


async def wait_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``, or less when ``stop`` is set meanwhile: the pause of a service's periodic loop.
    Returns whether ``stop`` is set (the loop should end)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


async def run_every(stop: asyncio.Event, seconds: float, step: Callable[[], Awaitable[object]],
                    logger: logging.Logger, failed: str) -> None:
    """A service's periodic loop: ``await step()`` now and then every ``seconds`` until ``stop`` is set. A
    step that raises is logged on ``logger`` with its traceback (message ``failed``) and the loop goes on, so
    one bad pass never ends the service."""
    while not stop.is_set():
        try:
            await step()
        except Exception:
            logger.exception(failed)
        await wait_stop(stop, seconds)


def run_service(name: str, main: Callable[[asyncio.Event], Awaitable[None]], *, log_level: str | None = None,
                use_uvloop: bool = True) -> int:
    """Run ``main(stop)`` on uvloop (or plain asyncio when ``use_uvloop`` is false: mitmproxy runs its own
    servers on the stock loop) until it returns; SIGTERM/SIGINT set ``stop``. Returns an exit code."""
    try:
        get_settings()  # a bad PODBAY_CONFIG_FILE stops the service here, with one clear line
    except ConfigError as exc:
        print(f"podbay-{name}: {exc}", file=sys.stderr)
        return 2
    setup_logging(name, log_level)

    async def _runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        except Exception:
            log.exception("%s failed", name)
            return 1
        log.info("%s stopped", name)
        return 0

    return uvloop.run(_runner()) if use_uvloop else asyncio.run(_runner())


def health_app(name: str, is_healthy: Callable[[], dict[str, Any]],
               ready_checks: dict[str, Check] | None = None) -> FastAPI:
    """A FastAPI app with ``GET /healthz`` (200 when ``is_healthy()['ok']``, else 503), ``GET /readyz`` (200 when
    every one of ``ready_checks`` passes, else 503 with the reasons; no checks = ready) and ``GET /metrics``.
    ``ready_checks`` may be filled in after the app is made (a consumer is bound after the server starts)."""
    app = FastAPI(title=f"podbay-{name}", docs_url=None, redoc_url=None)
    checks = ready_checks if ready_checks is not None else {}
    app.state.ready_checks = checks

    @app.get("/healthz")
    async def healthz() -> Response:
        state = is_healthy()
        return Response(
            json.dumps({"service": name, **state}),
            status_code=200 if state.get("ok") else 503,
            media_type="application/json",
        )

    readyz_route(app, name, checks)

    @app.get("/metrics")
    async def metrics(authorization: str | None = Header(None)) -> Response:
        # Anonymous only while no token is set: the port is loopback unless PODBAY_HEALTH_HOST opens it.
        token = get_settings().metrics_token
        if token and not token_matches(authorization, token):
            return unauthorized_response("send 'Authorization: Bearer <PODBAY_METRICS_TOKEN>'")
        return metrics_response()

    return app


async def serve_http(app: Any, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve ``app`` until ``stop`` is set; raises if the port cannot be bound."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # the service owns signals
    task = asyncio.create_task(server.serve())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        stop_task.cancel()
        exc = task.exception()
        if exc:
            raise exc
        if not server.started:
            raise OSError(f"could not serve HTTP on {host}:{port}")
        return
    server.should_exit = True
    await task


def readyz_route(app: FastAPI, name: str, checks: dict[str, Check]) -> None:
    """Add ``GET /readyz`` over ``checks`` to an app that is not made by :func:`health_app` (the API, the node
    data plane)."""

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        status, body = await readiness_response(name, checks)
        return Response(json.dumps(body), status_code=status, media_type="application/json")
