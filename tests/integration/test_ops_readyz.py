"""``/readyz`` of the API, the scheduler and the warm-pool service as real processes on real servers: ready
when NATS and PostgreSQL answer (and the scheduler's consumer is bound), 503 with the reason once NATS goes
away; JSON log lines on stderr with ``PODBAY_LOG_FORMAT=json``; a clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from podbay.devstack.procs import free_port
from podbay.devstack.servers import NatsServer, start_nats
from podbay.grants import new_keypair

pytestmark = pytest.mark.integration

# service -> (entry module, port variable)
SERVICES = {
    "api": ("podbay_api.main", "PODBAY_API_PORT"),
    "scheduler": ("podbay_scheduler.main", "PODBAY_SCHEDULER_PORT"),
    "warmpool": ("podbay_warmpool.main", "PODBAY_WARMPOOL_PORT"),
}


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server of this test alone, so that it can be stopped under the services."""
    server = start_nats(tmp_path / "nats", free_port(), log_dir=tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _poll(url: str, want: int, timeout_s: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=5)
            if last.status_code == want:
                return last
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered {want}; last: {last.status_code if last else None} "
                         f"{last.text if last else ''}")


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_readyz_follows_its_dependencies(service: str, own_nats: NatsServer, pg_dsn: str, tmp_path: Path) -> None:
    module, port_var = SERVICES[service]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
    env.update(PODBAY_NATS_URL=own_nats.url, PODBAY_PG_DSN=pg_dsn, PODBAY_DATA_DIR=str(tmp_path / "data"),
               PODBAY_LOG_FORMAT="json", PODBAY_INTERNAL_TOKEN="internal-token-not-in-logs",
               PODBAY_GRANT_SIGNING_KEY=new_keypair()[0],  # the API refuses to start without it
               **{port_var: str(port)})
    stderr_path = tmp_path / f"{service}.stderr"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", f"from {module} import main; main()"], env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        ready = _poll(f"http://127.0.0.1:{port}/readyz", 200).json()
        assert ready["ready"] is True and ready["checks"]["nats"] == "ok" and ready["checks"]["postgres"] == "ok"
        if service == "scheduler":
            assert ready["checks"]["consumer"] == "ok"
        own_nats.stop()
        down = _poll(f"http://127.0.0.1:{port}/readyz", 503).json()
        assert down["ready"] is False and down["checks"]["nats"] != "ok" and down["checks"]["postgres"] == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code in (200, 503)  # answers
        proc.send_signal(signal.SIGTERM)
        # uvicorn (the API) re-raises SIGTERM after its graceful shutdown, which systemd counts as a clean stop.
        assert proc.wait(timeout=60) in ((0, -signal.SIGTERM) if service == "api" else (0,))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(line) for line in stderr_path.read_text().splitlines() if line.startswith("{")]
    assert lines, stderr_path.read_text()
    assert all({"time", "level", "service", "logger", "message"} <= set(line) for line in lines)
    assert "internal-token-not-in-logs" not in stderr_path.read_text()


def test_scheduler_json_lines_carry_the_command_s_sandbox_and_operation(own_nats: NatsServer, pg_dsn: str,
                                                                         tmp_path: Path) -> None:
    """A place command for a sandbox that does not exist is logged (and dropped) with both ids on the line."""
    from podbay.bus import connect_bus
    from podbay.contracts import subjects
    from podbay.contracts.messages import PlaceSandbox, Resources
    from podbay.devstack.procs import run_sync
    from podbay.outbox import new_id

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
    env.update(PODBAY_NATS_URL=own_nats.url, PODBAY_PG_DSN=pg_dsn, PODBAY_LOG_FORMAT="json",
               PODBAY_SCHEDULER_PORT=str(port))
    stderr_path = tmp_path / "scheduler.stderr"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", "from podbay_scheduler.main import main; main()"], env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    sid, op = new_id("sbx"), new_id("op")

    async def publish() -> None:
        bus = await connect_bus(own_nats.url, name="test-ops")
        try:
            cmd = PlaceSandbox(operation_id=op, sandbox_id=sid, tenant_id="t", template="base",
                               resources=Resources(memory_mib=256, vcpus=1))
            await bus.publish_command(subjects.SCHEDULER_PLACE, cmd, msg_id=op)
        finally:
            await bus.close()

    try:
        _poll(f"http://127.0.0.1:{port}/readyz", 200)
        run_sync(publish())
        deadline = time.monotonic() + 60
        found: dict[str, object] | None = None
        while found is None and time.monotonic() < deadline:
            for line in stderr_path.read_text().splitlines():
                if line.startswith("{") and sid in line:
                    found = json.loads(line)
            time.sleep(0.2)
        assert found is not None, stderr_path.read_text()
        assert found["sandbox_id"] == sid and found["operation_id"] == op and found["service"] == "scheduler"
        assert found["level"] == "WARNING" and found["logger"] == "podbay.scheduler"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
