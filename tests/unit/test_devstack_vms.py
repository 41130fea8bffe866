"""Dev-stack safety on a shared machine: which VMs belong to a data dir (podbay.devstack.vms), the port check
before ``up``, readiness that requires our own process alive, and ``down`` with and without ``purge``."""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podbay.config import Settings
from podbay.devstack import servers, stack, supervisor, vms
from podbay.devstack.procs import free_ports
from podbay.devstack.stack import External, PortInUse, ServiceProcess, ServiceSpec, StackError, StackPorts
from podbay.devstack.vms import find_strays, node_stores, unmount_node_stores


def _proc(proc_root: Path, pid: int, argv: list[str], state: str = "S") -> None:
    entry = proc_root / str(pid)
    entry.mkdir(parents=True)
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "stat").write_text(f"{pid} ({Path(argv[0]).name}) {state} 1 " + "0 " * 40 + "\n")


def _qemu(vm_dir: Path) -> list[str]:
    return [
        "/usr/bin/qemu-system-x86_64", "-M", "microvm",
        "-object", f"memory-backend-file,id=mem,size=512M,mem-path={vm_dir / 'ram'},share=on",
        "-qmp", f"unix:{vm_dir / 'qmp.sock'},server=on,wait=off", "-pidfile", str(vm_dir / "qemu.pid"),
    ]  # fmt: skip


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``pb`` (ours), ``pbch`` (a sibling sharing the prefix) and a fake ``/proc``."""
    return tmp_path / "pb", tmp_path / "pbch", tmp_path / "proc"


def test_a_sibling_dir_with_a_common_prefix_is_not_ours(dirs: tuple[Path, Path, Path]) -> None:
    ours, sibling, proc = dirs
    ours.mkdir()
    _proc(proc, 101, _qemu(sibling / "nodes/n1/store/sandboxes/a"))
    _proc(proc, 102, ["/usr/bin/qemu-system-x86_64", f"-drive=file={sibling}/disk.img"])
    _proc(proc, 103, ["/usr/bin/qemu-system-x86_64", "-name", str(ours) + "ch"])
    assert find_strays(ours, proc_root=proc) == []
    assert find_strays(sibling, proc_root=proc) == [101, 102, 103]


def test_a_path_inside_an_argument_below_the_data_dir_counts(dirs: tuple[Path, Path, Path]) -> None:
    ours, _sibling, proc = dirs
    ours.mkdir()
    _proc(proc, 201, _qemu(ours / "nodes/n1/store/sandboxes/a"))  # mem-path=..., unix:..., -pidfile
    _proc(proc, 202, ["/usr/bin/bwrap", "--bind", f"{ours}/nodes/n1/store/sandboxes/b", "/vm", "qemu-system-x86_64"])
    _proc(proc, 203, ["/usr/bin/python3", "-m", "podbay_nodeagent", str(ours)])  # ours, but not a VM
    _proc(proc, 204, _qemu(ours / "nodes/n1/store/sandboxes/z"), state="Z")  # a zombie is already dead
    _proc(proc, 205, ["/usr/bin/qemu-system-x86_64", "-drive", f"file={ours}/../pb/x/disk.img"])
    assert find_strays(ours, proc_root=proc) == [201, 202, 205]
    assert find_strays(ours, proc_root=proc, qemu_only=True) == [201, 205]  # one pid per VM: no bubblewrap


def test_qemu_pid_files_count_only_when_the_process_names_that_vm_dir(dirs: tuple[Path, Path, Path]) -> None:
    ours, sibling, proc = dirs
    live, recycled = ours / "nodes/n1/store/sandboxes/a", ours / "nodes/n1/store/sandboxes/b"
    for vm_dir, pid in ((live, 301), (recycled, 302)):
        vm_dir.mkdir(parents=True)
        (vm_dir / "qemu.pid").write_text(f"{pid}\n")
    # 301 names its VM dir only inside a chardev option.
    _proc(proc, 301, ["/usr/bin/qemu-system-x86_64", "-chardev", f"file,id=c,path={live}/console.log"])
    # 302 is a pid reused by another stack's VM.
    _proc(proc, 302, _qemu(sibling / "nodes/n1/store/sandboxes/b"))
    assert find_strays(ours, proc_root=proc) == [301]


def test_node_stores_compare_whole_components(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ours = tmp_path / "pb"
    mounts = [ours / "nodes/n1/store", tmp_path / "pbch/nodes/n1/store", ours / "nodes/n1/other", Path("/")]
    monkeypatch.setattr(vms, "_mount_points", lambda: mounts)
    assert node_stores(ours) == [ours / "nodes/n1/store"]


def test_unmount_node_stores_unmounts_and_detaches_loops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ours = tmp_path / "pb"
    (ours / "nodes/n1").mkdir(parents=True)
    (ours / "nodes/n1/store.btrfs").write_bytes(b"")
    store = ours / "nodes/n1/store"
    monkeypatch.setattr(vms, "_mount_points", lambda: [store, tmp_path / "pbch/nodes/n1/store"])
    calls: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        out = f"/dev/loop7: []: ({ours}/nodes/n1/store.btrfs)\n" if argv[:2] == ["losetup", "-j"] else ""
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(vms.subprocess, "run", run)
    assert unmount_node_stores(ours) == [store]
    assert calls == [
        ["umount", str(store)],
        ["losetup", "-j", str(ours / "nodes/n1/store.btrfs")],
        ["losetup", "-d", "/dev/loop7"],
    ]


# --- ports and readiness ---------------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port with a listener on it, as another stack's server would hold it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_taken_port_is_named_with_its_part_and_variable(taken_port: int) -> None:
    names = list(StackPorts.model_fields)
    for field, part, variable in (("nats", "nats", "PODBAY_NATS_PORT"), ("pg", "postgres", "PODBAY_PG_PORT"),
                                  ("node", "nodeagent", "PODBAY_NODE_PORT")):  # fmt: skip
        ports = StackPorts(**dict(zip(names, free_ports(len(names)), strict=True)))
        ports = ports.model_copy(update={field: taken_port})
        with pytest.raises(PortInUse) as err:
            stack.check_ports_free(ports)
        assert str(err.value) == f"port {taken_port} ({part}) is in use; set {variable}"
    # A server given from outside is not bound by the stack.
    ports = ports.model_copy(update={"node": free_ports(1)[0], "nats": taken_port})
    stack.check_ports_free(ports, External(nats_url=f"nats://127.0.0.1:{taken_port}"))


def test_up_fails_with_one_line_when_a_port_is_taken(
    taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = free_ports(7)
    for name, port in zip(("NATS", "PG", "S3"), (taken_port, *ports[:2]), strict=True):
        monkeypatch.setenv(f"PODBAY_{name}_PORT", str(port))
    for name in ("NATS_URL", "PG_DSN", "S3_URL"):
        monkeypatch.delenv(f"PODBAY_{name}", raising=False)
    settings = Settings(data_dir=tmp_path / "data", log_dir=tmp_path / "logs", api_port=ports[2], node_port=ports[3],
                        scheduler_port=ports[4], snapshotter_port=ports[5], warmpool_port=ports[6])  # fmt: skip

    def never(*_: Any) -> int:
        raise AssertionError("must not start a supervisor")

    monkeypatch.setattr(supervisor, "_up_detached", never)
    assert supervisor.up(settings, detach=True) == 1
    out = capsys.readouterr().out
    assert f"port {taken_port} (nats) is in use; set PODBAY_NATS_PORT" in out


class _DyingProc:
    """A Popen stand-in that runs until polled after the probe answered, then has exited with code 1."""

    def __init__(self) -> None:
        self.polls = 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.polls += 1
        if self.polls > 1:
            self.returncode = 1
        return self.returncode


def test_an_answer_does_not_count_when_our_server_has_exited(tmp_path: Path) -> None:
    server = servers.ServerProcess("nats", _DyingProc(), tmp_path / "nats.log", 4222)  # type: ignore[arg-type]

    async def answered_by_someone_else() -> None:
        return None

    with pytest.raises(servers.ServerError, match="exited with code 1"):
        servers._wait_ready(server, answered_by_someone_else, timeout_s=5)


def test_a_healthz_answer_does_not_count_when_our_service_has_exited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = ServiceProcess(ServiceSpec("api", "podbay-api", "api"), ["x"], {}, tmp_path / "api.log", 8080)
    svc.proc = _DyingProc()  # type: ignore[assignment]
    monkeypatch.setattr(ServiceProcess, "healthy", lambda self, timeout_s=1.0: True)
    with pytest.raises(StackError, match="exited with code 1"):
        svc.wait_healthy(5)


def test_a_server_refuses_to_start_on_a_taken_port(taken_port: int, tmp_path: Path) -> None:
    with pytest.raises(servers.ServerError, match=f"port {taken_port} \\(nats\\) is in use"):
        servers.start_nats(tmp_path / "nats", taken_port, log_dir=tmp_path)


# --- VMs survive up and down; purge removes them -----------------------------------------------------------


@pytest.fixture
def vm_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Path]]:
    """Records kill_strays and unmount_node_stores calls; find_strays reports one running VM: its QEMU (11)
    and the bubblewrap confining it (12)."""
    calls: dict[str, list[Path]] = {"kill": [], "unmount": []}

    def kill(data_dir: Path) -> list[int]:
        calls["kill"].append(data_dir)
        return [11, 12]

    def unmount(data_dir: Path) -> list[Path]:
        calls["unmount"].append(data_dir)
        return [data_dir / "nodes/n1/store"]

    for module in (supervisor, stack):
        monkeypatch.setattr(module, "kill_strays", kill)
        monkeypatch.setattr(module, "unmount_node_stores", unmount)
    monkeypatch.setattr(supervisor, "find_strays",
                        lambda data_dir, qemu_only=False: [11] if qemu_only else [11, 12])
    return calls


def _stale(settings: Settings) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = supervisor.StackState(
        state="ready", supervisor_pid=dead.pid, supervisor_start_ticks=None, started_at=0.0, api_url="http://x",
        data_dir=str(settings.data_dir), log_dir=str(settings.logs), ports=StackPorts(),
    )  # fmt: skip
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    supervisor._write_state(settings, state)


def test_down_leaves_vms_running_and_says_so(
    vm_calls: dict[str, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path / "data", log_dir=tmp_path / "logs")
    _stale(settings)
    assert supervisor.down(settings) == 0
    assert vm_calls == {"kill": [], "unmount": []}
    out = capsys.readouterr().out
    # One VM, although two processes (QEMU and its bubblewrap) belong to it.
    assert "1 sandbox VM(s) left running; the next podbay up re-attaches them; podbay down --purge stops them" in out
    assert supervisor.read_state(settings) is None


def test_down_purge_kills_vms_and_unmounts_stores(vm_calls: dict[str, list[Path]], tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", log_dir=tmp_path / "logs")
    _stale(settings)
    assert supervisor.down(settings, purge=True) == 0
    assert vm_calls == {"kill": [settings.data_dir], "unmount": [settings.data_dir]}


def test_stack_stop_keeps_vms_unless_purged(vm_calls: dict[str, list[Path]], tmp_path: Path) -> None:
    running = stack.Stack(data_dir=tmp_path / "data", log_dir=tmp_path / "logs", cache_dir=tmp_path / "cache")
    running.stop()
    assert vm_calls == {"kill": [], "unmount": []}
    running.stop(purge=True)
    assert vm_calls == {"kill": [running.data_dir], "unmount": [running.data_dir]}


def test_cleaning_a_stale_stack_keeps_its_vms(vm_calls: dict[str, list[Path]], tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", log_dir=tmp_path / "logs")
    _stale(settings)
    state = supervisor.read_state(settings)
    assert state is not None
    supervisor._clean_stale(settings, state, supervisor._console(True))
    assert vm_calls == {"kill": [], "unmount": []}


def test_free_ports_are_distinct_below_the_ephemeral_range_and_skip_a_taken_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from podbay.devstack import procs

    lo, _hi = procs._ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    if lo <= 11000:
        pytest.skip("the ephemeral range leaves no room below it: the kernel's pick is used")
    assert all(p < lo for p in ports)  # no port the kernel may give an outgoing connection
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("0.0.0.0", ports[0]))  # noqa: S104
        holder.listen()
        # The taken port is the first candidate drawn: it is skipped, not returned. (The process's record of
        # ports already handed out is emptied first, or it would skip them all.)
        monkeypatch.setattr(procs, "_HANDED_OUT", set())
        monkeypatch.setattr(procs.random, "sample", lambda _pop, _k: [ports[0], *ports[1:4]])
        assert free_ports(3) == ports[1:4]
    finally:
        holder.close()


def test_free_ports_never_hands_out_a_port_twice_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stack picks its services' ports, then its servers' own listeners while those services are not yet
    # listening: drawn in the same order, the second pick must not return the first one's ports again.
    from podbay.devstack import procs

    lo, _hi = procs._ephemeral_range()
    if lo <= 11000:
        pytest.skip("the ephemeral range leaves no room below it: the kernel's pick is used")
    order = random.Random(7).sample(range(procs._PICK_FLOOR, lo), 400)
    monkeypatch.setattr(procs.random, "sample", lambda _pop, _k: list(order))
    first = free_ports(8)
    second = free_ports(8)
    assert not set(first) & set(second)
    assert len(set(second)) == 8
    assert all(p < lo for p in second)
