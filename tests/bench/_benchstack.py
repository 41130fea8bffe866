"""A stack of the benchmark's own (real processes in a temporary directory on free ports, as the tests and
``create.py`` start one), for benchmarks that otherwise talk to a running stack (``podbay up``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from podbay.config import Settings
from podbay.devstack.stack import External, Stack, StackPorts, kill_strays

__all__ = ["own_stack"]


@contextmanager
def own_stack(extra_env: dict[str, str] | None = None) -> Iterator[Stack]:
    """Start a stack with an API key (``stack.api_url``, ``stack.api_key``); stop and remove it on exit.
    Servers given by ``PODBAY_NATS_URL``/``PODBAY_PG_DSN``/``PODBAY_S3_URL`` are used instead of started."""
    root = Path(tempfile.mkdtemp(prefix="podbay-bench-"))
    os.chmod(root, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
    stack = Stack(data_dir=root / "stack", log_dir=root / "stack" / "logs", cache_dir=Settings().cache_dir,
                  ports=StackPorts.free(), external=External.from_env(), durable=False,
                  base_env={**os.environ, **(extra_env or {})})
    try:
        stack.start()
        stack.create_api_key(Settings().operator_tenant, "bench")  # pools of shared templates (base) are the operator's
        yield stack
    finally:
        stack.stop(purge=True)
        kill_strays(root / "stack")
        shutil.rmtree(root, ignore_errors=True)
