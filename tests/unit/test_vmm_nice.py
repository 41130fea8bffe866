"""``vmm.set_nice``: every thread of a process, not only its main thread (Linux keeps nice per thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podbay_nodeagent.vm.vmm import set_nice


def _nices(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        # Field 19 of stat is nice; the comm field (2) may hold spaces, so split after its closing paren.
        out.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
    return out


@pytest.fixture
def threaded() -> subprocess.Popen[bytes]:
    code = ("import threading, time, sys\n"
            "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    yield p
    p.kill()
    p.wait()


def test_set_nice_changes_every_thread(threaded: subprocess.Popen[bytes]) -> None:
    assert len(_nices(threaded.pid)) == 4
    assert set_nice(threaded.pid, 7) == 4
    assert _nices(threaded.pid) == [7, 7, 7, 7]


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs CAP_SYS_NICE")
def test_set_nice_can_lower_it_again(threaded: subprocess.Popen[bytes]) -> None:
    set_nice(threaded.pid, 12)
    set_nice(threaded.pid, 0)
    assert _nices(threaded.pid) == [0, 0, 0, 0]


def test_set_nice_of_a_gone_process_raises() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        set_nice(p.pid, 5)
