"""The dev stack's NATS cluster (issue 42): ``Stack(nats_servers=3)`` starts three JetStream servers joined
by routes, ``PODBAY_NATS_URL`` lists them, ``podbay status`` records and probes each one, and a member that
is killed and restarted rejoins at its own port. (The cluster under load, with faults: tests/faults.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from podbay.config import Settings
from podbay.devstack import supervisor
from podbay.devstack.servers import S3Endpoint
from podbay.devstack.stack import External, Stack, StackPorts

pytestmark = pytest.mark.timeout(180)


def test_three_nats_servers_are_started_recorded_probed_and_restarted(tmp_path: Path, pg_dsn: str,
                                                                        s3: S3Endpoint) -> None:
    stack = Stack(data_dir=tmp_path / "stack", log_dir=tmp_path / "logs", cache_dir=tmp_path,
                  ports=StackPorts.free(), durable=False, nats_servers=3,
                  external=External(pg_dsn=pg_dsn, s3_url=s3.url, s3_access_key=s3.access_key,
                                    s3_secret_key=s3.secret_key),
                  base_env={**os.environ, "PODBAY_S3_BUCKET": s3.bucket}, s3_bucket=s3.bucket)
    try:
        stack.start_servers()
        assert [n for n in stack.servers if n.startswith("nats")] == ["nats", "nats-2", "nats-3"]
        urls = stack.nats_url.split(",")
        assert urls == [stack.servers[n].url for n in ("nats", "nats-2", "nats-3")]
        assert stack.env["PODBAY_NATS_URL"] == stack.nats_url
        assert urls[0].endswith(f":{stack.ports.nats}")  # the first on the stack's usual port

        settings = Settings(data_dir=stack.data_dir)
        state = supervisor.StackState(state="ready", supervisor_pid=os.getpid(), supervisor_start_ticks=None,
                                      started_at=time.time(), api_url=stack.api_url, data_dir=str(stack.data_dir),
                                      log_dir=str(stack.log_dir), ports=stack.ports)
        supervisor._record(settings, state, stack)  # noqa: SLF001 - what `podbay up` writes to stack.json
        parts = {p.name: p for p in supervisor.status(settings)}
        for i, name in enumerate(("nats", "nats-2", "nats-3")):
            assert parts[name].answering, parts[name]
            assert parts[name].url == urls[i]

        stack.kill("nats-2", signal.SIGKILL)
        stack.restart("nats-2")
        assert stack.servers["nats-2"].alive() and stack.servers["nats-2"].url == urls[1]
        supervisor._record(settings, state, stack)  # noqa: SLF001
        assert {p.name: p for p in supervisor.status(settings)}["nats-2"].answering
    finally:
        stack.stop(grace_s=5.0)
