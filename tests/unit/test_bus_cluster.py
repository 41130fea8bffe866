"""A replicated bus (issue 42), the pure parts: the server list of PODBAY_NATS_URL, the replicas of podbay's
streams and buckets by cluster size, the dev stack's count of NATS servers, and a cluster's server names and
routes as nats-server is started with them. The cluster itself runs in tests/faults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from podbay.bus import nats_servers, stream_replicas
from podbay.config import Settings
from podbay.devstack import servers as srv
from podbay.devstack.stack import Stack, StackError, StackPorts


def test_the_nats_url_may_list_several_servers() -> None:
    assert nats_servers("nats://a:4222") == ["nats://a:4222"]
    assert nats_servers(" nats://a:4222, nats://b:4222,,nats://c:4222 ") == [
        "nats://a:4222", "nats://b:4222", "nats://c:4222"]
    with pytest.raises(ValueError):
        nats_servers(" , ")


def test_streams_get_three_replicas_on_a_cluster_of_three_or_more() -> None:
    assert stream_replicas(0, 1) == 1
    assert stream_replicas(0, 2) == 1  # two servers: R3 could not be placed, R2 would lose its majority
    assert stream_replicas(0, 3) == 3
    assert stream_replicas(0, 5) == 3
    assert stream_replicas(1, 3) == 1  # the setting wins
    assert stream_replicas(9, 3) == 5  # JetStream's bound
    assert Settings(nats_url="nats://a:1,nats://b:2").nats_replicas == 0


def _stack(tmp_path: Path, **kw: Any) -> Stack:
    return Stack(data_dir=tmp_path, log_dir=tmp_path, cache_dir=tmp_path, ports=StackPorts.free(), **kw)


def test_the_dev_stack_starts_one_nats_server_unless_told_three(tmp_path: Path) -> None:
    assert _stack(tmp_path, base_env={}).nats_server_count() == 1
    assert _stack(tmp_path, base_env={"PODBAY_NATS_SERVERS": "3"}).nats_server_count() == 3
    assert _stack(tmp_path, base_env={"PODBAY_NATS_SERVERS": "1"}, nats_servers=3).nats_server_count() == 3
    for bad in ("2", "6", "x"):
        with pytest.raises(StackError):
            _stack(tmp_path, base_env={"PODBAY_NATS_SERVERS": bad}).nats_server_count()


def test_a_cluster_member_is_started_with_its_name_and_every_route(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def spawn(name: str, argv: list[str], log_path: Path, **_: Any) -> tuple[Any, int]:
        seen.append(argv)
        raise RuntimeError("not started in a unit test")

    monkeypatch.setattr(srv, "_spawn", spawn)
    monkeypatch.setattr(srv, "_check_port", lambda *_: None)
    with pytest.raises(RuntimeError):
        srv.start_nats_cluster(tmp_path, [4001, 4002, 4003], [6001, 6002, 6003])
    argv = seen[0]
    assert argv[argv.index("-n") + 1] == "nats" and argv[argv.index("--cluster_name") + 1] == "podbay"
    assert argv[argv.index("--cluster") + 1] == "nats://127.0.0.1:6001"
    assert argv[argv.index("--routes") + 1] == "nats://127.0.0.1:6001,nats://127.0.0.1:6002,nats://127.0.0.1:6003"
    assert [srv.nats_server_name(i) for i in range(3)] == ["nats", "nats-2", "nats-3"]
