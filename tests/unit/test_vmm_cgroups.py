"""Per-sandbox bounds: the cgroup values of a QEMU (services/nodeagent/vm/cgroups.py) and the tc commands of its tap
(services/nodeagent/net/network.py), with the real cgroup v2 mount and a real tap where this host has them."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from podbay.config import Settings
from podbay_nodeagent.net import network
from podbay_nodeagent.vm.cgroups import SLICE, VmCgroups, cgroup_name, cgroup_values, from_settings
from podbay_nodeagent.net.network import SandboxNetwork, create_tap, tc_rate_batches

MIB = 1024 * 1024


def test_values_follow_the_sandbox_size() -> None:
    v = cgroup_values(vcpus=1, memory_mib=256, tb_mib=64, cpu_headroom_percent=50, memory_overhead_mib=256,
                      pids_max=128)
    assert v == {"cpu.max": "150000 100000", "cpu.weight": "100", "memory.max": str(576 * MIB),
                 "pids.max": "128", "io.weight": "default 100"}
    v = cgroup_values(vcpus=4, memory_mib=2048, tb_mib=0, cpu_headroom_percent=25, memory_overhead_mib=128,
                      pids_max=64, io_max="rbps=1000 wbps=2000", io_device="259:0")
    assert v["cpu.max"] == "500000 100000" and v["cpu.weight"] == "400"
    assert v["memory.max"] == str((2048 + 128) * MIB)
    assert v["io.max"] == "259:0 rbps=1000 wbps=2000"
    assert "io.max" not in cgroup_values(vcpus=1, memory_mib=1, tb_mib=0, cpu_headroom_percent=0,
                                         memory_overhead_mib=64, pids_max=16, io_max="rbps=1", io_device=None)
    assert cgroup_values(vcpus=200, memory_mib=1, tb_mib=0, cpu_headroom_percent=0, memory_overhead_mib=64,
                         pids_max=16)["cpu.weight"] == "10000"


def test_settings_feed_the_values(tmp_path: Path) -> None:
    slice_, params = from_settings(Settings(data_dir=tmp_path, vmm_cpu_headroom_percent=10, vmm_pids_max=99,
                                            vmm_memory_overhead_mib=300, cgroup_root=tmp_path / "cg"))
    assert slice_.root == tmp_path / "cg" and slice_.enabled
    assert params == {"cpu_headroom_percent": 10, "memory_overhead_mib": 300, "pids_max": 99, "io_max": ""}
    assert not from_settings(Settings(data_dir=tmp_path, vmm_cgroups=False))[0].setup()


def test_cgroup_names_are_one_safe_component() -> None:
    assert cgroup_name(Path("/x/sbx_abc"), 42) == "sbx_abc-42"
    assert "/" not in cgroup_name(Path("/x/a b:c"), 1) and cgroup_name(Path("/x/a b:c"), 1) == "a_b_c-1"


def _fake_root(tmp_path: Path, controllers: str) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    return root


def test_only_enabled_controllers_are_written(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = _fake_root(tmp_path, "cpu memory hugetlb")
    cg = VmCgroups(root)
    values = cgroup_values(vcpus=2, memory_mib=512, tb_mib=64, cpu_headroom_percent=50, memory_overhead_mib=256,
                           pids_max=128)
    with caplog.at_level(logging.WARNING):
        path = cg.place("vm-7", 7, values)
        cg.place("vm-8", 8, values)
    assert path == root / SLICE / "vm-7"
    assert (root / SLICE / "cgroup.subtree_control").read_text() == "+memory"  # the last one written
    assert (path / "cpu.max").read_text() == "300000 100000"
    assert (path / "memory.max").read_text() == str(832 * MIB)
    assert not (path / "pids.max").exists() and not (path / "io.weight").exists()
    assert (path / "cgroup.procs").read_text() == "7"
    assert [r.message for r in caplog.records if "lacks controller" in r.message] == [
        f"cgroup v2 at {root} lacks controller(s) pids, io: those limits are skipped"]  # once


def test_without_cgroup_v2_nothing_is_placed_and_it_says_so_once(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    cg = VmCgroups(tmp_path)  # no cgroup.controllers: a v1 host
    with caplog.at_level(logging.WARNING):
        assert cg.place("vm-1", 1, {"cpu.max": "1 2"}) is None
        assert cg.place("vm-2", 2, {"cpu.max": "1 2"}) is None
    assert len([r for r in caplog.records if "no cgroup v2" in r.message]) == 1
    assert not (tmp_path / SLICE).exists()


def _v2_root() -> Path | None:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists() and os.access(root, os.W_OK):
            return root
    return None


@pytest.mark.skipif(_v2_root() is None, reason="needs a writable cgroup v2 mount")
def test_a_process_lands_in_its_own_cgroup_and_its_cgroup_goes(tmp_path: Path) -> None:
    root = _v2_root()
    assert root is not None
    cg = VmCgroups(root)
    proc = subprocess.Popen(["sleep", "60"])
    name = cgroup_name(tmp_path, proc.pid)
    try:
        path = cg.place(name, proc.pid, {"pids.max": "16", "cpu.max": "50000 100000"})
        assert path is not None
        assert Path(f"/proc/{proc.pid}/cgroup").read_text().strip().endswith(f"/{SLICE}/{name}")
        for file, value in (("pids.max", "16"), ("cpu.max", "50000 100000")):
            if file.split(".")[0] in cg.controllers:
                assert (path / file).read_text().strip() == value
        cg.remove(name)
        assert path.exists()  # a cgroup with a process stays
    finally:
        proc.kill()
        proc.wait()
    for _ in range(50):
        cg.remove(name)
        if not (root / SLICE / name).exists():
            break
        time.sleep(0.02)
    assert not (root / SLICE / name).exists()
    # A leftover of a QEMU that exited while no agent ran is reaped.
    (root / SLICE / f"{name}-left").mkdir()
    assert f"{name}-left" in cg.reap()


def test_tc_commands_limit_both_directions() -> None:
    to_guest, from_guest = tc_rate_batches("pbt0", 1000)
    assert to_guest == "qdisc replace dev pbt0 root tbf rate 1000mbit burst 1250000 latency 50ms\n"
    assert from_guest == (
        "qdisc replace dev pbt0 ingress\n"
        "filter add dev pbt0 parent ffff: pref 1 protocol all u32 match u32 0 0 "
        "action police rate 1000mbit burst 1250000 conform-exceed drop\n")
    assert "burst 32768 " in tc_rate_batches("pbt0", 1)[0]  # at least 32 KiB


def test_a_missing_tc_part_is_logged_once_and_not_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    net = SandboxNetwork(Settings(data_dir=tmp_path, sandbox_cidr="10.99.0.0/24", sandbox_net_rate_mbit=100))
    inputs: list[str] = []

    def fake_run(argv: list[str], *, input: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        inputs.append(input)
        fails = "police" in input
        err = "Error: Failed to load TC action module.\nCommand failed -:3\n" if fails else ""
        return subprocess.CompletedProcess(argv, 1 if fails else 0, "", err)

    monkeypatch.setattr(network.subprocess, "run", fake_run)
    with caplog.at_level(logging.WARNING):
        for tap in ("pbt0", "pbt1", "pbt2"):
            net.limit_rate(tap)
    assert "police" in inputs[0] and all("police" not in i and "tbf" in i for i in inputs[1:])
    assert len([r for r in caplog.records if "not limited" in r.message]) == 1
    net.settings = Settings(data_dir=tmp_path, sandbox_cidr="10.99.0.0/24", sandbox_net_rate_mbit=0)
    net.limit_rate("pbt3")
    assert len(inputs) == 3  # 0: unlimited, tc is not run


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/net/tun").exists(), reason="needs root and /dev/net/tun")
def test_a_real_tap_gets_its_rate(tmp_path: Path) -> None:
    net = SandboxNetwork(Settings(data_dir=tmp_path, sandbox_cidr="10.99.0.0/24", sandbox_net_rate_mbit=250))
    name = f"pbrt{os.getpid() % 100000}"
    fd = create_tap(name)
    try:
        net.limit_rate(name)
        shown = subprocess.run(["tc", "qdisc", "show", "dev", name], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 250Mbit" in shown
        if net._tc_ok["from_guest"]:  # a kernel with the police action (not every one has it)
            filters = subprocess.run(["tc", "filter", "show", "dev", name, "ingress"], capture_output=True,
                                     text=True).stdout
            assert "police" in filters
    finally:
        os.close(fd)
