"""Benchmark: the guest channel against real microVMs restored from the template snapshot (no stack needed).

    .venv/bin/python tests/bench/channel.py --runs 10 --ops 20 --json channel.json [--workdir DIR]

Each run restores the newest cached template (``<cache_dir>/templates/<name>-*/template.json``, or
``--template-dir``) into a fresh VM directory under ``--workdir`` (put it on btrfs so RAM and disk are
reflinked; elsewhere they are copied, which slows the restore but not the channel), then measures:

- ``restore``: ``QemuVmm.restore`` until the guest runs (QMP ``cont`` answered);
- ``channel_connect_after_restore``: ``GuestChannel.connect`` called right after the restore, until guestd
  answered HELLO;
- ``ping``: one ping round trip (``--ops`` per run);
- ``exec_true``: ``run(ExecSpec(argv=["true"]))`` (``--ops`` per run);
- ``exec_true_timeout``: the same with ``timeout_s=60``, as the node agent's data plane always sends one;
- ``exec_python_print``: ``run(ExecSpec(argv=["python3", "-c", "print(1)"]))`` (``--ops`` per run, at most 5).

The VM is killed and its directory removed after each run.
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
from podbay.contracts.channel import ExecSpec
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


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


async def _one_run(tpl: TemplateSnapshot, vm_dir: Path, ops: int, samples: dict[str, list[float]]) -> None:
    vmm = QemuVmm()
    t0 = time.perf_counter()
    vm = await vmm.restore(tpl.dir, vm_dir, tpl.vm_config(get_settings()))
    samples["restore"].append(_ms(t0))
    try:
        t0 = time.perf_counter()
        ch = await GuestChannel.connect(vm.paths.channel, timeout_s=30)
        samples["channel_connect_after_restore"].append(_ms(t0))
        try:
            await ch.ping()  # warm-up, not counted
            for _ in range(ops):
                t0 = time.perf_counter()
                await ch.ping()
                samples["ping"].append(_ms(t0))
            for _ in range(ops):
                t0 = time.perf_counter()
                _, _, ex = await ch.run(ExecSpec(argv=["true"]))
                samples["exec_true"].append(_ms(t0))
                assert ex.exit_code == 0, ex
            for _ in range(ops):
                t0 = time.perf_counter()
                _, _, ex = await ch.run(ExecSpec(argv=["true"], timeout_s=60))
                samples["exec_true_timeout"].append(_ms(t0))
                assert ex.exit_code == 0, ex
            for _ in range(min(ops, 5)):
                t0 = time.perf_counter()
                out, _, ex = await ch.run(ExecSpec(argv=["python3", "-c", "print(1)"]))
                samples["exec_python_print"].append(_ms(t0))
                assert ex.exit_code == 0 and out == b"1\n", (ex, out)
        finally:
            await ch.close()
    finally:
        await vmm.kill(vm)
        shutil.rmtree(vm_dir, ignore_errors=True)


async def _main(args: argparse.Namespace) -> None:
    tpl_dir = Path(args.template_dir) if args.template_dir else _newest_template(args.template)
    tpl = TemplateSnapshot.load(tpl_dir)
    print(f"template {tpl_dir}")
    keys = ("restore", "channel_connect_after_restore", "ping", "exec_true", "exec_true_timeout", "exec_python_print")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    work = Path(tempfile.mkdtemp(prefix="podbay-bench-channel-", dir=args.workdir))
    try:
        for i in range(args.runs):
            await _one_run(tpl, work / f"vm{i}", args.ops, samples)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report({k: summarise(v) for k, v in samples.items()}, args.json_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="restores to measure (default 10)")
    ap.add_argument("--ops", type=int, default=20, help="pings and execs of true per restore (default 20)")
    ap.add_argument("--template", default="base")
    ap.add_argument("--template-dir", default=None, help="a template directory (default: the newest cached)")
    ap.add_argument("--workdir", default=None, help="where VM directories go (default: the temp dir)")
    ap.add_argument("--json", dest="json_path", default=None)
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
