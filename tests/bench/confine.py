"""Benchmark: what confining QEMU (bubblewrap + setpriv as the VMM user, confine.py) costs a restore.

    .venv/bin/python tests/bench/confine.py --runs 10 --json confine.json

Restores the newest build of the ``base`` template from the build cache with the VMM driver alone (no
stack), alternating confined and unconfined runs so that both see the same machine load. Metrics:
``restore_confined`` / ``restore_unconfined`` (``QemuVmm.restore`` until the guest runs) and
``restore_to_ping_confined`` / ``restore_to_ping_unconfined`` (until guestd answered a ping). Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from podbay.channel.client import GuestChannel
from podbay.config import get_settings
from podbay_nodeagent.vm import confine
from podbay_nodeagent.build.template import TemplateSnapshot
from podbay_nodeagent.vm.vmm import QemuVmm

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


async def _one(vmm: QemuVmm, tpl: TemplateSnapshot, vm_dir: Path, label: str, samples: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    vm = await vmm.restore(tpl.dir, vm_dir, tpl.vm_config(get_settings()))
    samples[f"restore_{label}"].append((time.perf_counter() - t0) * 1000)
    try:
        ch = await GuestChannel.connect(vm.paths.channel, timeout_s=30)
        try:
            await ch.ping()
            samples[f"restore_to_ping_{label}"].append((time.perf_counter() - t0) * 1000)
        finally:
            await ch.close()
    finally:
        await vmm.kill(vm)


async def _main(runs: int, json_path: str | None) -> None:
    tpl = TemplateSnapshot.load(_newest_template("base"))
    vmms = {"confined": QemuVmm(confinement=confine.Confinement.prepare(get_settings().vmm_user)),
            "unconfined": QemuVmm(confinement=None)}
    samples: dict[str, list[float]] = {f"{m}_{k}": [] for m in ("restore", "restore_to_ping") for k in vmms}
    work = Path(tempfile.mkdtemp(prefix="podbay-bench-confine-", dir=tpl.dir.parent))
    try:
        for i in range(runs + 1):  # the first round warms the page cache and is not counted
            for label, vmm in vmms.items():
                scratch: dict[str, list[float]] = {k: [] for k in samples}
                await _one(vmm, tpl, work / f"{label}-{i}", label, scratch if i == 0 else samples)
                shutil.rmtree(work / f"{label}-{i}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report({k: summarise(v) for k, v in samples.items()}, json_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    asyncio.run(_main(args.runs, args.json))


if __name__ == "__main__":
    main()
