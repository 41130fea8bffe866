"""``podbay events --follow`` (the real CLI, as a subprocess) against the real stack and one microVM: it sees a
sandbox's created, started, paused, resumed and deleted events in order, and a follower killed and started
again with the same ``--resume`` name continues after the last event it printed (no loss, no repeat)."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from podbay.sdk import Client

pytestmark = pytest.mark.e2e

TYPES = ["created", "started", "paused", "resumed", "deleted"]


class Follower:
    """``podbay events --follow --resume NAME --json`` with its stdout lines in a queue."""

    def __init__(self, stack: Any, key: str, config: Path) -> None:
        exe = Path(sys.executable).with_name("podbay")
        env = {**os.environ, "PODBAY_API_URL": stack.api_url, "PODBAY_API_KEY": key, "PODBAY_CONFIG": str(config)}
        args = [str(exe), "events", "--follow", "--resume", "e2e", "--json"]
        for t in TYPES:
            args += ["--type", t]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def next(self, timeout_s: float = 120.0) -> dict[str, Any]:
        try:
            return json.loads(self.lines.get(timeout=timeout_s))  # type: ignore[no-any-return]
        except queue.Empty:
            err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
            raise AssertionError(f"no event line within {timeout_s} s; exit={self.proc.poll()} {err}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def test_cli_follow_sees_lifecycle_in_order_and_resumes(stack: Any, tmp_path: Path) -> None:
    # A tenant of its own, so that only this test's sandbox shows up in the stream.
    saved = stack.api_key, stack.tenant_id
    try:
        key = stack.create_api_key(f"events-{secrets.token_hex(4)}", "test")
    finally:
        stack.api_key, stack.tenant_id = saved
    config = tmp_path / "podbay" / "config.json"
    pos_file = tmp_path / "podbay" / "events" / "e2e.pos"
    seen: list[dict[str, Any]] = []
    first = Follower(stack, key, config)
    second: Follower | None = None
    with Client(stack.api_url, key) as c:
        sid: str | None = None
        try:
            sid = c.create_sandbox(template="base").id
            seen += [first.next(), first.next()]
            c.pause_sandbox(sid)
            seen.append(first.next())
            # Killed only once it has stored the position of what it printed last.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and pos_file.read_text().strip() != str(seen[-1]["seq"]):
                time.sleep(0.05)
            first.kill()
            # Events while nobody follows.
            c.resume_sandbox(sid)
            c.delete_sandbox(sid)
            sid = None
            second = Follower(stack, key, config)
            seen += [second.next(), second.next()]
            # It stores the position right after printing its line: give it that moment before the kill.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and pos_file.read_text().strip() != str(seen[-1]["seq"]):
                time.sleep(0.05)
        finally:
            first.kill()
            if second is not None:
                second.kill()
            if sid is not None:
                c.delete_sandbox(sid)
    assert [e["type"] for e in seen] == TYPES
    assert len({e["sandbox_id"] for e in seen}) == 1
    seqs = [e["seq"] for e in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # Nothing after 'deleted' was pending for the second follower (no repeat of what the first printed).
    assert second is not None and second.lines.empty()
    assert pos_file.read_text().strip() == str(seqs[-1])
