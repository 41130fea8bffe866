"""How a dev stack starts (podbay.devstack.stack): the servers all at once, then the API, then every other
service at once; a failure is raised only after the other starts have ended, so that stop finds them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from podbay.devstack import stack as stack_mod
from podbay.devstack.stack import SERVICES, Stack, StackPorts


class FakeServer(SimpleNamespace):
    def stop(self, grace_s: float = 10.0) -> int:
        self.stopped = True
        return 0

    def alive(self) -> bool:
        return not getattr(self, "stopped", False)


def _stack(tmp_path: Path) -> Stack:
    return Stack(data_dir=tmp_path, log_dir=tmp_path / "logs", cache_dir=tmp_path, ports=StackPorts.free(),
                 base_env={"PODBAY_CREDENTIAL_KEY": "k" * 44, "PODBAY_INTERNAL_TOKEN": "t" * 40})


def _fake_servers(monkeypatch: pytest.MonkeyPatch, barrier: threading.Barrier, fail: str = "") -> None:
    """start_nats/start_postgres/start_s3 that each wait until all three are starting at the same time (a
    ``BrokenBarrierError`` after 10 s otherwise); ``fail`` names one that then raises."""
    def fake(name: str, **attrs: Any) -> Any:
        def start(data_dir: Path, port: int, **_kw: Any) -> FakeServer:
            barrier.wait()
            if name == fail:
                raise RuntimeError(f"{name} did not start")
            time.sleep(0.2 if fail else 0)  # the others end after the failure
            return FakeServer(name=name, **attrs)
        return start

    monkeypatch.setattr(stack_mod.srv, "start_nats", fake("nats", url="nats://x"))
    monkeypatch.setattr(stack_mod.srv, "start_postgres", fake("postgres", dsn="postgresql://x"))
    monkeypatch.setattr(stack_mod.srv, "start_s3", fake("s3", url="http://s3", access_key="a", secret_key="s"))


def test_the_servers_start_at_once_and_are_kept_in_their_order(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_servers(monkeypatch, threading.Barrier(3, timeout=10))
    st = _stack(tmp_path)
    ready: list[str] = []
    st.start_servers(on_ready=ready.append)
    assert sorted(ready) == ["nats", "postgres", "s3"]
    assert list(st.servers) == ["nats", "postgres", "s3"]  # stop goes in reverse of this order
    assert (st.nats_url, st.pg_dsn, st.s3_url, st.s3_keys) == ("nats://x", "postgresql://x", "http://s3", ("a", "s"))
    assert st.env["PODBAY_PG_DSN"] == "postgresql://x"


def test_a_server_that_fails_is_raised_after_the_others_started_so_stop_finds_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_servers(monkeypatch, threading.Barrier(3, timeout=10), fail="postgres")
    st = _stack(tmp_path)
    ready: list[str] = []
    with pytest.raises(RuntimeError, match="postgres did not start"):
        st.start_servers(on_ready=ready.append)
    assert sorted(ready) == ["nats", "s3"]
    assert list(st.servers) == ["nats", "s3"]
    st.stop()
    assert all(s.stopped for s in st.servers.values())


def test_the_api_starts_first_then_every_other_service_at_once(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class FakeService(SimpleNamespace):
        def start(self) -> None:
            events.append(f"start {self.name}")

        def wait_healthy(self, timeout_s: float) -> None:
            events.append(f"healthy {self.name}")

    st = _stack(tmp_path)
    monkeypatch.setattr(Stack, "_service", lambda self, spec, replica=1, node_id=None: FakeService(
        name=spec.name if replica == 1 else f"{spec.name}-{replica}"))
    st.replicas = {"api": 2}
    ready: list[str] = []
    st.start_services(on_ready=ready.append)
    others = [s.name for s in SERVICES if s.name != "api"]
    assert events[:4] == ["start api", "start api-2", "healthy api", "healthy api-2"]
    assert events[4:] == [f"start {n}" for n in others] + [f"healthy {n}" for n in others]
    assert ready == ["api", "api-2", *others]
    assert list(st.services) == ["api", "api-2", *others]
