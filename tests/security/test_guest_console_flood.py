"""Guest vs host: a guest that floods its serial console leaves a console log within its cap, and the node
(here: the driver's event loop and the guest's channel) stays responsive (services/nodeagent/vm/console.py).

A real microVM restored from the base template writes 16 MiB to /dev/ttyS0; QEMU's serial port is a socket
the node agent reads into console.log, rotated at PODBAY_CONSOLE_LOG_MAX_KIB (1 MiB) with one older file kept,
and rate-limited at PODBAY_CONSOLE_LOG_RATE_KIB_S (64 KiB/s) after a burst of the cap.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from podbay.channel.client import GuestChannel
from podbay.config import Settings
from podbay.contracts.channel import ExecSpec
from podbay_nodeagent.vm.console import ConsoleLimits
from podbay_nodeagent.build.template import prepare_template
from podbay_nodeagent.vm.vmm import QemuVmm

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None or os.geteuid() != 0,
                       reason="needs root and qemu-system-x86_64"),
]

FLOOD = 16 * 1024 * 1024
CAP = 1024 * 1024


async def test_a_16_mib_console_flood_stays_within_the_cap(tmp_path: Path) -> None:
    template = await prepare_template("base", Settings())
    vmm = QemuVmm(console_limits=ConsoleLimits(max_bytes=CAP, rate_bytes_s=64 * 1024))
    vm = await vmm.restore(template.dir, tmp_path / "vm", template.vm_config())
    ch: GuestChannel | None = None
    lag = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:  # the node agent's loop runs the console pump: it must keep its pace
        nonlocal lag
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.05)
            lag = max(lag, time.monotonic() - t - 0.05)

    try:
        ch = await GuestChannel.connect(vm.paths.channel, timeout_s=60)
        tick = asyncio.create_task(ticker())
        flood = asyncio.create_task(ch.run(ExecSpec(
            shell=f"head -c {FLOOD} /dev/zero | tr '\\0' 'x' > /dev/ttyS0; echo done", user="root",
            timeout_s=1500)))
        pings = []
        while not flood.done():
            t = time.monotonic()
            await asyncio.wait_for(ch.ping(), 30)  # the guest's channel answers during the flood
            pings.append(time.monotonic() - t)
            await asyncio.sleep(2.0)
        out, err, exit_ = await flood
        stop.set()
        await tick
        assert exit_.exit_code == 0, err
        assert out.strip() == b"done"
        log = vm.paths.console
        rotated = log.with_name("console.log.1")
        size, older = log.stat().st_size, rotated.stat().st_size if rotated.exists() else 0
        print(f"console.log {size} B, console.log.1 {older} B after a {FLOOD} B flood; "
              f"ping max {max(pings, default=0):.3f} s, loop lag max {lag:.3f} s")
        assert size <= CAP and older <= CAP
        assert b"console bytes dropped" in log.read_bytes() + (rotated.read_bytes() if older else b"")
        assert lag < 1.0
    finally:
        stop.set()
        if ch is not None:
            await ch.close()
        await vmm.kill(vm)
