"""Benchmark: live migration of a running guest (vmmigrate.py), the mechanism behind ``podbay node drain``.

    .venv/bin/python tests/bench/migrate.py --runs 5 --json migrate.json [--dirty-mib 64]

Restores the newest build of the ``base`` template with the VMM driver alone (no stack, confined as the
node agent runs QEMU), starts a guest process that keeps writing to ``--dirty-mib`` MiB of memory, then
migrates the guest back and forth between two VM directories over a loopback TCP connection that the host
opened and handed to QEMU (fd passing, as between two node agents), RAM and disk (block migration) in one
stream. Metrics: ``migrate_total`` (QEMU's total-time), ``migrate_downtime`` (the guest stopped: QEMU's
downtime under pre-copy; from the stop to the stream's end under stop-and-copy of RAM, see
``vmmigrate.precopy_safe``), ``migrate_wall`` (start of the incoming QEMU to the guest running on the
destination), ``migrate_ram_MiB`` (RAM sent, mean) and ``migrate_precopy`` (1 when RAM was pre-copied).
Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import tempfile
import time
from pathlib import Path

from podbay.channel.client import GuestChannel
from podbay.config import get_settings
from podbay.contracts.channel import ExecSpec
from podbay_nodeagent.vm import vmmigrate
from podbay_nodeagent.build.template import TemplateSnapshot
from podbay_nodeagent.vm.vmm import QemuVmm, VmProcess

try:
    from tests.bench._stats import report, summarise
except ImportError:  # run as a script from the repository root
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _stats import report, summarise  # type: ignore[no-redef]


def _newest_template(name: str) -> Path:
    root = get_settings().cache_dir / "templates"
    found = sorted(root.glob(f"{name}-*/template.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no template {name!r} under {root}: run `podbay template build {name}` first")
    return found[-1].parent


def _pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        src = socket.create_connection(srv.getsockname())
        dst, _ = srv.accept()
    finally:
        srv.close()
    return src, dst


async def _dirty(vm: VmProcess, mib: int) -> None:
    ch = await GuestChannel.connect(vm.paths.channel, timeout_s=30)
    try:
        script = (f"setsid python3 -c 'b = bytearray({mib} << 20)\nimport time\nn = 0\nwhile True:\n"
                  "    n += 1\n    for i in range(0, len(b), 4096): b[i] = n & 255\n    time.sleep(0.2)'"
                  " </dev/null >/dev/null 2>&1 &")
        await ch.run(ExecSpec(argv=["sh", "-c", script]))
    finally:
        await ch.close()


async def _migrate(vmm: QemuVmm, vm: VmProcess, dest_dir: Path) -> tuple[VmProcess, vmmigrate.MigrationStats, float]:
    assert vm.config is not None
    shutil.rmtree(dest_dir, ignore_errors=True)
    t0 = time.perf_counter()
    dest = await vmmigrate.start_incoming(vmm, vm.config, dest_dir, disk_size=vmmigrate.disk_size(vm.dir))
    s, d = _pair()
    try:
        with vmm.events(dest, "MIGRATION") as listener:
            await vmmigrate.accept_incoming(vmm, dest, d)
            d.close()
            out = asyncio.ensure_future(vmmigrate.migrate_out(vmm, vm, s, timeout_s=600))
            state = await vmmigrate.wait_incoming(vmm, dest, listener, 600)
            stats = await out
        state = await vmmigrate.arrive(vmm, dest, state, stats.was_running)
    finally:
        s.close()
    assert state == "running", state
    return dest, stats, (time.perf_counter() - t0) * 1000


async def main(runs: int, json_path: str | None, dirty_mib: int) -> None:
    tpl = TemplateSnapshot.load(_newest_template("base"))
    vmm = QemuVmm()
    work = Path(tempfile.mkdtemp(prefix="podbay-bench-migrate-"))
    samples: dict[str, list[float]] = {"migrate_total": [], "migrate_downtime": [], "migrate_wall": []}
    ram: list[float] = []
    precopy: list[bool] = []
    vm = await vmm.restore(tpl.dir, work / "a", tpl.vm_config(get_settings()))
    try:
        await _dirty(vm, dirty_mib)
        await asyncio.sleep(1.0)
        for i in range(runs):
            dest, stats, wall = await _migrate(vmm, vm, work / ("b" if i % 2 == 0 else "a"))
            await vmm.kill(vm)
            vm = dest
            samples["migrate_total"].append(stats.total_ms)
            samples["migrate_downtime"].append(stats.downtime_ms)
            samples["migrate_wall"].append(wall)
            ram.append(stats.ram_bytes / 2**20)
            precopy.append(stats.precopy)
            print(f"run {i + 1}: {'pre-copy' if stats.precopy else 'stop-and-copy of RAM'}, "
                  f"total {stats.total_ms:.0f} ms, downtime {stats.downtime_ms:.1f} ms, "
                  f"RAM {stats.ram_bytes / 2**20:.1f} MiB", flush=True)
    finally:
        await vmm.kill(vm)
        shutil.rmtree(work, ignore_errors=True)
    results = {k: summarise(v) for k, v in samples.items()}
    results["migrate_ram_MiB"] = {"value": round(sum(ram) / len(ram), 1) if ram else None}
    results["migrate_precopy"] = {"value": int(all(precopy)) if precopy else None}
    report(results, json_path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--dirty-mib", type=int, default=64, help="Guest memory a process keeps rewriting.")
    args = ap.parse_args()
    asyncio.run(main(args.runs, args.json_path, args.dirty_mib))
