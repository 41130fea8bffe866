"""The dev stack: every service as a real process (the ``stack`` fixture), and ``up``/``status``/``down`` of
podbay.devstack.supervisor with a background supervisor, a second ``up`` and a stale state file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from podbay.config import Settings
from podbay.devstack import supervisor
from podbay.devstack.procs import free_ports, pid_alive, same_process
from podbay.devstack.stack import SERVICES, Stack, StackPorts

pytestmark = pytest.mark.integration


def test_every_service_answers_healthz(stack: Stack) -> None:
    for spec in SERVICES:
        svc = stack.services[spec.name]
        assert svc.alive(), stack.log_tail(spec.name)
        assert httpx.get(f"{svc.url}/healthz", timeout=5).status_code == 200


def test_services_share_one_configuration(stack: Stack) -> None:
    env = stack.env
    assert env["PODBAY_NATS_URL"] == stack.nats_url
    assert env["PODBAY_PG_DSN"] == stack.pg_dsn
    assert env["PODBAY_S3_URL"] == stack.s3_url
    assert env["PODBAY_DATA_DIR"] == str(stack.data_dir)
    assert env["PODBAY_API_PORT"] == str(stack.ports.api)
    assert len(env["PODBAY_INTERNAL_TOKEN"]) >= 32
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    # the gateway's ports, and one credential key for the API (seals) and the gateway (reveals)
    assert env["PODBAY_GATEWAY_PROXY_PORT"] == str(stack.ports.gateway_proxy)
    assert env["PODBAY_GATEWAY_DNS_PORT"] == str(stack.ports.gateway_dns)
    assert len(env["PODBAY_CREDENTIAL_KEY"]) == 44
    assert stack.services["gateway"].argv[0].endswith("/.venv-gateway/bin/podbay-gateway")


def test_dev_key_authenticates(stack: Stack) -> None:
    assert stack.api_key.startswith("pb_")
    authed = httpx.get(f"{stack.api_url}/v1/sandboxes", headers={"authorization": f"Bearer {stack.api_key}"})
    assert authed.status_code == 200, authed.text
    anonymous = httpx.get(f"{stack.api_url}/v1/sandboxes")
    assert anonymous.status_code == 401


def test_killed_service_comes_back_on_restart(stack: Stack) -> None:
    before = stack.pid("scheduler")
    assert before is not None
    stack.kill("scheduler", signal.SIGKILL)
    assert stack.pid("scheduler") is None
    assert not pid_alive(before)
    stack.restart("scheduler")
    after = stack.pid("scheduler")
    assert after is not None and after != before
    assert httpx.get(f"{stack.services['scheduler'].url}/healthz", timeout=5).status_code == 200
    assert "starting scheduler" in stack.log_tail("scheduler", 200)


@pytest.fixture
def dev_settings(test_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """Settings and environment for a separate ``up`` on free ports, with its own client config file."""
    root = test_root / "devstack-up"
    ports = free_ports(8)
    for name, port in zip(("NATS", "PG", "S3"), ports[:3], strict=True):
        monkeypatch.setenv(f"PODBAY_{name}_PORT", str(port))
    for name in ("NATS_URL", "PG_DSN", "S3_URL"):
        monkeypatch.delenv(f"PODBAY_{name}", raising=False)
    monkeypatch.setenv("PODBAY_CONFIG", str(root / "client.json"))
    settings = Settings(
        data_dir=root / "data",
        log_dir=root / "logs",
        cache_dir=Settings().cache_dir,
        api_port=ports[3],
        node_port=ports[4],
        scheduler_port=ports[5],
        snapshotter_port=ports[6],
        warmpool_port=ports[7],
    )
    yield settings
    supervisor.down(settings, purge=True)


def test_up_status_down_with_a_second_up_and_a_stale_state(dev_settings: Settings) -> None:
    assert supervisor.up(dev_settings, detach=True) == 0
    state = supervisor.read_state(dev_settings)
    assert state is not None and state.state == "ready"
    parts = supervisor.status(dev_settings)
    assert [p.name for p in parts] == ["nats", "postgres", "s3", *(s.name for s in SERVICES)]
    assert all(p.answering for p in parts), [p for p in parts if not p.answering]
    config = json.loads(Path(os.environ["PODBAY_CONFIG"]).read_text())
    assert config["api_url"] == f"http://127.0.0.1:{dev_settings.api_port}"
    assert config["api_key"].startswith("pb_")

    # A second up changes nothing.
    assert supervisor.up(dev_settings, detach=True) == 0
    again = supervisor.read_state(dev_settings)
    assert again is not None and again.supervisor_pid == state.supervisor_pid

    # The supervisor dies without cleaning up: status says so, and the next up starts afresh.
    os.kill(state.supervisor_pid, signal.SIGKILL)
    assert not pid_alive(state.supervisor_pid) or _wait_gone(state.supervisor_pid)
    assert all(p.detail != "running" for p in supervisor.status(dev_settings))
    assert supervisor.up(dev_settings, detach=True) == 0
    fresh = supervisor.read_state(dev_settings)
    assert fresh is not None and fresh.supervisor_pid != state.supervisor_pid
    assert not any(same_process(old.pid, old.start_ticks) for old in state.parts if old.pid)
    # Each start replaces the dev key: one live dev key per data directory, the first start's is refused.
    fresh_key = json.loads(Path(os.environ["PODBAY_CONFIG"]).read_text())["api_key"]
    assert fresh_key != config["api_key"]
    url = f"{fresh.api_url}/v1/sandboxes"
    assert httpx.get(url, headers={"authorization": f"Bearer {config['api_key']}"}).status_code == 401
    assert httpx.get(url, headers={"authorization": f"Bearer {fresh_key}"}).status_code == 200

    assert supervisor.down(dev_settings) == 0
    assert supervisor.status(dev_settings) == []
    assert not any(p.pid and pid_alive(p.pid) for p in fresh.parts)
    assert not pid_alive(fresh.supervisor_pid)


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_detached_up_returns_non_zero_when_the_supervisor_fails_to_start(
    dev_settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    # A stale state makes up leave the port check to the background supervisor (its leftovers may hold the
    # ports until it stops them), so the failure happens there and must reach up's return code.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = supervisor.StackState(
        state="ready", supervisor_pid=dead.pid, supervisor_start_ticks=None, started_at=0.0, api_url="http://x",
        data_dir=str(dev_settings.data_dir), log_dir=str(dev_settings.logs), ports=StackPorts(),
    )  # fmt: skip
    dev_settings.data_dir.mkdir(parents=True, exist_ok=True)
    supervisor._write_state(dev_settings, stale)
    nats_port = int(os.environ["PODBAY_NATS_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other_stack:
        other_stack.bind(("127.0.0.1", nats_port))
        other_stack.listen()
        assert supervisor.up(dev_settings, detach=True) == 1
    out = capsys.readouterr().out
    assert f"port {nats_port} (nats) is in use; set PODBAY_NATS_PORT" in out
    assert supervisor.read_state(dev_settings) is None
    assert supervisor.status(dev_settings) == []
