"""`podbay status` probes (libs/podbay/devstack/supervisor.py): a client library that is slow to import does
not count against a server's probe time. On a loaded host, loading nats-py, asyncpg and aiobotocore inside
the probes' 3 s windows made healthy servers show as down."""

from __future__ import annotations

import importlib.abc
import sys
import time
from collections.abc import Iterator

import pytest

from podbay.devstack import supervisor
from podbay.devstack.stack import StackPorts


class _SlowImport(importlib.abc.MetaPathFinder):
    """Makes the first import of ``nats`` take longer than a probe's window (then lets the real one load)."""

    def __init__(self) -> None:
        self.slept = False

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name == "nats" and not self.slept:
            self.slept = True
            time.sleep(3.5)
        return None


@pytest.fixture
def slow_nats_import(monkeypatch: pytest.MonkeyPatch) -> Iterator[_SlowImport]:
    for mod in [m for m in sys.modules if m == "nats" or m.startswith("nats.")]:
        monkeypatch.delitem(sys.modules, mod)
    finder = _SlowImport()
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)


async def test_a_slow_client_import_does_not_make_a_live_server_look_down(nats_url: str,
                                                                          slow_nats_import: _SlowImport) -> None:
    state = supervisor.StackState(state="ready", supervisor_pid=0, supervisor_start_ticks=None, started_at=0.0,
                                  api_url="http://127.0.0.1:1", data_dir="/nonexistent", log_dir="/nonexistent",
                                  ports=StackPorts(), parts=[supervisor.PartRecord(name="nats", kind="server",
                                                                                    url=nats_url)],
                                  env={"PODBAY_NATS_URL": nats_url})
    (status,) = await supervisor._probe_all(state, True)
    assert slow_nats_import.slept
    assert status.answering, status.detail
