"""Fakes a node agent's operation modules run against in unit tests, and a fixture that wires them up.

- :class:`FakeVmm` implements :class:`podbay_nodeagent.vm.vmm.Vmm`: no QEMU; each VM is a record with a run state
  (``running``, ``paused``, ``postmigrate``) and an exit event. Every call lands in ``calls`` as
  ``(operation, vm directory name)``; :meth:`FakeVmm.fail_next` makes the next call of an operation raise,
  :meth:`FakeVmm.crash` ends a VM as if QEMU died on its own. Snapshots write ``state``, ``ram`` and
  ``disk.img`` files, and a restore refuses a directory without ``state``, as ``QemuVmm`` does. The real
  ``VmDriver`` and ``VmHandle`` run on top of it.
- :class:`FakeGuest` stands in for guestd behind every channel: ``GuestChannel.connect`` is replaced by
  :meth:`FakeGuest.connect` (the seam the node agent connects through), which hands out :class:`FakeChannel`
  objects that record each call in ``FakeGuest.calls`` as ``(sandbox directory name, operation)``.
- :class:`FakeDb` stands in for the asyncpg pool: rows of ``sandboxes``, ``snapshots``, ``operations`` and
  ``warm_slots`` as dicts, transactions that roll back (a copy of the rows taken at the start), and
  ``podbay.lifecycle.apply`` replaced by :meth:`FakeDb.apply`, which fences by state, generation and node as the
  real UPDATE does, moves the row along ``podbay.lifecycle``'s transition table and records a
  :class:`Transition`. A statement it does not know fails the test (``AssertionError``), so a module that
  starts issuing new SQL gets its fake answer written here rather than a silent ``None``.
- :class:`FakeNet`, :class:`FakeVolumes`, :class:`FakeBus`, :class:`FakeRelay`: the node's network (with real
  file descriptors standing in for taps, so a leaked one is seen), volumes, NATS and outbox relay.

The real-VM behaviour of the same modules is covered by tests/e2e; these tests pin what each operation asks of
the VMM, the guest and the database, in which order, and what it leaves behind when a step fails.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from podbay import lifecycle
from podbay.channel.client import GuestChannel
from podbay.config import Settings
from podbay.contracts.channel import AfterRestoreResult, ExecExit, ExecSpec, GuestNet
from podbay.contracts.egress import NetBinding
from podbay.contracts.states import OperationState, SandboxState
from podbay.lifecycle import OperationOutcome, SandboxEvent, Verb
from podbay_nodeagent.ops import warm as warm_module
from podbay_nodeagent.ops.sandboxes import SandboxManager
from podbay_nodeagent.storage.store import NodeStore
from podbay_nodeagent.build.template import MACHINE, TemplateSnapshot
from podbay_nodeagent.vm.vmdriver import TemplateImage, VmDriver
from podbay_nodeagent.vm.vmm import SnapshotResult, VmConfig, VmGone, Vmm, VmPaths, VmProcess, VmStartError

NODE = "node-1"
TEMPLATE = "base"
DIGEST = "d" * 64

# ----------------------------------------------------------------------------------------------------- VMM


@dataclass
class _Vm:
    process: VmProcess
    status: str
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None


class FakeVmm(Vmm):
    """A VMM without QEMU (module docstring). ``calls``: ``(operation, vm directory name)`` in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.vms: dict[int, _Vm] = {}
        self.nice: dict[int, int] = {}
        self._failures: dict[str, BaseException] = {}
        self._pids = itertools.count(4000)

    # -- scripting

    def fail_next(self, op: str, exc: BaseException | None = None) -> None:
        """Make the next call of ``op`` (``restore``, ``pause``, ``snapshot_full``, ...) raise ``exc``."""
        self._failures[op] = exc or VmStartError(f"fake {op} failed")

    def ops(self, vm_dir: str | None = None) -> list[str]:
        """The operations called so far, of one VM directory when ``vm_dir`` (its name) is given."""
        return [op for op, d in self.calls if vm_dir is None or d == vm_dir]

    def crash(self, process: VmProcess, code: int = -11) -> None:
        """End ``process`` as if its QEMU died on its own (exit status ``code``)."""
        self._end(self.vms[process.pid], code)

    def alive(self) -> list[VmProcess]:
        return [v.process for v in self.vms.values() if not v.exited.is_set()]

    def status_of(self, process: VmProcess) -> str:
        return self.vms[process.pid].status

    # -- helpers

    def _call(self, op: str, where: Path) -> None:
        self.calls.append((op, where.name))
        exc = self._failures.pop(op, None)
        if exc is not None:
            raise exc

    def _vm(self, process: VmProcess) -> _Vm:
        vm = self.vms.get(process.pid)
        if vm is None or vm.exited.is_set():
            raise VmGone(f"fake VM {process.pid} is not running")
        return vm

    def _start(self, vm_dir: Path, config: VmConfig | None, status: str) -> VmProcess:
        paths = VmPaths(vm_dir)
        paths.run.mkdir(parents=True, exist_ok=True)
        for f in (paths.ram, paths.disk):
            f.touch()
        process = VmProcess(paths=paths, pid=next(self._pids), config=config, qmp=None)
        paths.pidfile.write_text(str(process.pid))
        self.vms[process.pid] = _Vm(process, status)
        return process

    def _end(self, vm: _Vm, code: int | None) -> None:
        if not vm.exited.is_set():
            vm.exit_code = code
            vm.status = "shutdown"
            vm.exited.set()

    # -- the interface

    async def boot(self, config: VmConfig, vm_dir: Path, *, tap_fd: int | None = None) -> VmProcess:
        self._call("boot", vm_dir)
        if not (vm_dir / "disk.img").exists():
            raise VmStartError(f"no disk image at {vm_dir / 'disk.img'}")
        return self._start(vm_dir, config, "running")

    async def restore(self, snapshot_dir: Path, vm_dir: Path, config: VmConfig, *, paused: bool = False,
                      tap_fd: int | None = None) -> VmProcess:
        self._call("restore_paused" if paused else "restore", vm_dir)
        if not (snapshot_dir / "state").exists():
            raise VmStartError(f"no snapshot state at {snapshot_dir / 'state'}")
        return self._start(vm_dir, config, "paused" if paused else "running")

    async def snapshot_full(self, vm: VmProcess, dest_dir: Path, *, leave_stopped: bool = False) -> SnapshotResult:
        self._call("snapshot_full", vm.paths.dir)
        state = self._vm(vm)
        dest_dir.mkdir(parents=True, exist_ok=True)
        for name in ("state", "ram", "disk.img"):
            (dest_dir / name).write_bytes(b"snap")
        if leave_stopped or state.status != "running":
            state.status = "postmigrate"
        return SnapshotResult(dir=dest_dir, state=dest_dir / "state", ram=dest_dir / "ram",
                              disk=dest_dir / "disk.img", paused_ms=1.0, copy_mode="reflink")

    async def attach(self, vm_dir: Path, config: VmConfig | None = None) -> VmProcess:
        self._call("attach", vm_dir)
        for vm in self.vms.values():
            if vm.process.paths.dir == vm_dir and not vm.exited.is_set():
                return vm.process
        raise VmGone(f"no running QEMU for {vm_dir}")

    async def pause(self, vm: VmProcess) -> None:
        self._call("pause", vm.paths.dir)
        self._vm(vm).status = "paused"

    async def resume(self, vm: VmProcess) -> None:
        self._call("resume", vm.paths.dir)
        self._vm(vm).status = "running"

    async def stop(self, vm: VmProcess, timeout_s: float = 5.0) -> None:
        self._call("stop", vm.paths.dir)
        self._end(self.vms[vm.pid], 0)

    async def kill(self, vm: VmProcess) -> None:
        self._call("kill", vm.paths.dir)
        self._end(self.vms[vm.pid], -9)

    def is_alive(self, vm: VmProcess) -> bool:
        return not self.vms[vm.pid].exited.is_set()

    async def wait_exit(self, vm: VmProcess, timeout_s: float | None = None) -> int | None:
        state = self.vms[vm.pid]
        await asyncio.wait_for(state.exited.wait(), timeout_s)
        return state.exit_code

    async def query_status(self, vm: VmProcess) -> str:
        self._call("query_status", vm.paths.dir)
        return self._vm(vm).status

    async def start_incoming(self, config: VmConfig, paths: VmPaths, *, tap_fd: int | None = None) -> VmProcess:
        self._call("start_incoming", paths.dir)
        return self._start(paths.dir, config, "inmigrate")

    async def execute(self, vm: VmProcess, cmd: str, args: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> Any:
        self._call(f"execute:{cmd}", vm.paths.dir)
        self._vm(vm)
        return {}

    async def give_fd(self, vm: VmProcess, fd: int, name: str) -> None:
        self._call("give_fd", vm.paths.dir)

    def events(self, vm: VmProcess, *names: str) -> AbstractContextManager[AsyncIterable[Mapping[str, Any]]]:
        raise NotImplementedError("no QMP events in the fake")

    async def detach(self, vm: VmProcess) -> None:
        self._call("detach", vm.paths.dir)

    async def set_nice(self, vm: VmProcess, nice: int) -> None:
        self._call(f"set_nice:{nice}", vm.paths.dir)
        self.nice[vm.pid] = nice


# --------------------------------------------------------------------------------------------------- guest


class FakeChannel:
    """One connection to a fake guestd; what it is asked goes to ``guest.calls``."""

    def __init__(self, guest: FakeGuest, vm_dir: str) -> None:
        self.guest = guest
        self.vm_dir = vm_dir
        self.after_restores: list[dict[str, Any]] = []
        self._closed = False

    async def _op(self, op: str) -> None:
        self.guest.calls.append((self.vm_dir, op))
        if self._closed:
            raise ConnectionResetError("fake channel closed")
        exc = self.guest.failures.pop(op, None)
        if exc is not None:
            raise exc

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        self.guest.calls.append((self.vm_dir, "close"))
        self._closed = True

    async def after_restore(self, **kwargs: Any) -> AfterRestoreResult:
        await self._op("after_restore")
        self.after_restores.append(kwargs)
        return AfterRestoreResult(hostname=kwargs.get("hostname") or "", entropy_credited="seed" in kwargs,
                                  crng_reseeded=self.guest.crng_reseeded and "seed" in kwargs,
                                  clock_set="time_ns" in kwargs)

    async def run(self, spec: ExecSpec, **kwargs: Any) -> tuple[bytes, bytes, ExecExit]:
        await self._op("run:" + " ".join(spec.argv or []))
        return b"", b"", ExecExit(exit_code=0, pid=1)

    async def freeze(self, mounts: list[str] | None = None, *, timeout_s: float = 30.0) -> list[str]:
        await self._op("freeze")
        return mounts or ["/"]

    async def thaw(self, mounts: list[str] | None = None) -> list[str]:
        await self._op("thaw")
        return mounts or ["/"]

    async def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        await self._op("ping")
        return {"version": "fake"}


class FakeGuest:
    """guestd behind every channel socket. ``calls``: ``(vm directory name, operation)``; ``failures``: the
    next call of an operation (``connect``, ``after_restore``, ``run:true``, ...) raises the exception given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.failures: dict[str, BaseException] = {}
        self.channels: list[FakeChannel] = []
        self.crng_reseeded = True
        #: each connect's ``timeout_s``, in order
        self.connect_timeouts: list[float] = []
        #: called at each connect, before it answers (a test's way to change the world meanwhile)
        self.on_connect: Callable[[], None] | None = None

    async def connect(self, socket_path: Path, *, timeout_s: float = 10.0) -> FakeChannel:
        vm_dir = socket_path.parent.parent.name  # <vm_dir>/run/channel.sock
        self.calls.append((vm_dir, "connect"))
        self.connect_timeouts.append(timeout_s)
        if self.on_connect is not None:
            self.on_connect()
        exc = self.failures.pop("connect", None)
        if exc is not None:
            raise exc
        channel = FakeChannel(self, vm_dir)
        self.channels.append(channel)
        return channel

    def ops(self, vm_dir: str) -> list[str]:
        return [op for d, op in self.calls if d == vm_dir]


# ------------------------------------------------------------------------------------------------ database


@dataclass
class Transition:
    """One ``lifecycle.apply`` (or the warm start's ``STARTED_SQL``): what was asked and whether the fence let
    it through. ``to`` is the state the row moved to (None when refused)."""

    sandbox_id: str
    verb: Verb
    applied: bool
    to: str | None
    operation: OperationOutcome | None
    event: str | None
    #: its transaction rolled back afterwards
    rolled_back: bool = False


class FakeDb:
    """The asyncpg pool and its connections, over rows kept as dicts (module docstring)."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.warm_slots: dict[str, dict[str, Any]] = {}
        self.warm_targets: dict[str, int] = {}
        self.e2b: dict[str, dict[str, Any]] = {}  # e2b_sandboxes rows by sandbox id
        self.transitions: list[Transition] = []
        self.events: list[tuple[str, str]] = []  # (sandbox id, event type) written to the outbox
        self.statements: list[str] = []
        self._order = itertools.count()
        self._in_tx = 0

    # -- rows

    def add_sandbox(self, sandbox_id: str, state: str, *, generation: int = 1, node_id: str | None = NODE,
                    **cols: Any) -> dict[str, Any]:
        row = {"id": sandbox_id, "state": state, "generation": generation, "node_id": node_id,
               "tenant_id": "tnt_1", "template": TEMPLATE, "template_digest": DIGEST,
               "hostname": f"sbx-{sandbox_id[4:16]}", "memory_mib": 256, "vcpus": 1,
               "suspended_snapshot_id": None, "failure_reason": None, "disk_mib": None, **cols}
        self.sandboxes[sandbox_id] = row
        return row

    def add_snapshot(self, snapshot_id: str, sandbox_id: str, *, kind: str = "full", state: str = "creating",
                     **cols: Any) -> dict[str, Any]:
        row = {"id": snapshot_id, "sandbox_id": sandbox_id, "kind": kind, "state": state, "promotion": "none",
               "promotion_error": None, "order": next(self._order), "node_id": NODE, **cols}
        self.snapshots[snapshot_id] = row
        return row

    def add_operation(self, operation_id: str) -> None:
        self.operations[operation_id] = {"id": operation_id, "state": "pending", "error_message": None}

    def state(self, sandbox_id: str) -> str:
        return str(self.sandboxes[sandbox_id]["state"])

    def verbs(self, sandbox_id: str) -> list[Verb]:
        """The transitions asked for ``sandbox_id`` that the fence let through, in order."""
        return [t.verb for t in self.transitions if t.sandbox_id == sandbox_id and t.applied and not t.rolled_back]

    # -- lifecycle.apply

    async def apply(self, conn: Any, sandbox_id: str, verb: Verb, *, states: Any, generation: int | None = None,
                    node: Any = lifecycle.ANY_NODE, set_node: Any = lifecycle.KEEP,
                    values: Mapping[str, object] | None = None, operation: Any = None,
                    event: SandboxEvent | None = None, **_: Any) -> dict[str, Any] | None:
        assert self._in_tx, f"lifecycle.apply({verb}) outside a transaction"
        if states is None:
            froms = None
        elif isinstance(states, str):
            froms = {SandboxState(states)}
        else:
            froms = {SandboxState(s) for s in states}
        if froms is not None:
            lifecycle.targets(verb, froms)  # raises InvalidState as the real one does
        row = self.sandboxes.get(sandbox_id)
        ok = (row is not None and (froms is None or row["state"] in froms)
              and (generation is None or row["generation"] == generation)
              and (node is lifecycle.ANY_NODE or row["node_id"] == node))
        if isinstance(operation, OperationOutcome) and (ok or operation.always):
            self._outcome(operation)
        if not ok or row is None:
            self.transitions.append(Transition(sandbox_id, verb, False, None, operation, None))
            return None
        row["state"] = str(lifecycle.next_state(row["state"], verb))
        if set_node is not lifecycle.KEEP:
            row["node_id"] = set_node
        row.update(values or {})
        if event is not None:
            self.events.append((sandbox_id, event.type))
        self.transitions.append(Transition(sandbox_id, verb, True, row["state"], operation,
                                           event.type if event else None))
        return dict(row)

    def _outcome(self, op: OperationOutcome) -> None:
        row = self.operations.setdefault(op.id, {"id": op.id, "state": "pending", "error_message": None})
        if op.unless_succeeded and row["state"] == "succeeded":
            return
        row["state"] = str(op.state)
        if isinstance(op.error_message, str) or op.error_message is None:
            row["error_message"] = op.error_message

    # -- transactions

    def _copy(self) -> tuple[Any, ...]:
        return (copy.deepcopy((self.sandboxes, self.snapshots, self.operations, self.warm_slots, self.events)),
                len(self.transitions))

    def _restore(self, saved: tuple[Any, ...]) -> None:
        """Roll back: the rows as they were; the transitions asked meanwhile stay listed, marked."""
        rows, asked = saved
        (self.sandboxes, self.snapshots, self.operations, self.warm_slots, self.events) = rows
        for t in self.transitions[asked:]:
            t.rolled_back = True

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[FakeConn]:
        yield FakeConn(self)

    # -- statements

    async def execute(self, sql: str, *args: Any) -> str:
        self.statements.append(sql)
        if sql.startswith("UPDATE operations SET state='succeeded'"):
            self.operations.setdefault(args[0], {"id": args[0], "error_message": None})["state"] = "succeeded"
        elif sql.startswith("UPDATE operations SET state='failed'"):
            self.operations.setdefault(args[0], {"id": args[0]}).update(state="failed", error_message=args[1])
        elif sql.startswith("INSERT INTO snapshots"):
            snap_id, _tenant, sandbox_id, _node, kind, _parent, _gen = args
            self.add_snapshot(snap_id, sandbox_id, kind=kind)
        elif sql.startswith("UPDATE snapshots SET state='ready'"):
            self.snapshots[args[0]].update(state="ready", size_bytes=args[1], paused_ms=args[2])
        elif sql.startswith("UPDATE snapshots SET state='failed'"):
            if self.snapshots[args[0]]["state"] == "creating":
                self.snapshots[args[0]].update(state="failed", error=args[1])
        elif sql.startswith("UPDATE snapshots SET state='deleted' WHERE sandbox_id=$1"):
            for s in self.snapshots.values():
                if s["sandbox_id"] == args[0] and s["promotion"] != "promoted":
                    s["state"] = "deleted"
        elif sql.startswith("UPDATE snapshots SET state='deleted' WHERE id = ANY"):
            for sid in args[0]:
                self.snapshots[sid]["state"] = "deleted"
        elif sql.startswith("INSERT INTO outbox"):
            assert self._in_tx, "an outbox row outside a transaction"
            self.events.append((args[2]["sandbox_id"], args[2]["type"]))
        elif sql.startswith("UPDATE sandboxes SET suspended_snapshot_id=NULL"):
            self.sandboxes[args[0]]["suspended_snapshot_id"] = None
        elif sql.startswith("UPDATE e2b_sandboxes SET cold_resume_snapshot=$2 WHERE sandbox_id=$1"):
            self.e2b.setdefault(args[0], {})["cold_resume_snapshot"] = args[1]
        elif sql.startswith("INSERT INTO warm_slots"):
            slot_id, node, template, digest, mem, vcpus = args
            self.warm_slots[slot_id] = {"id": slot_id, "node_id": node, "template": template, "state": "preparing"}
        elif sql.startswith("UPDATE warm_slots SET state='ready'"):
            self.warm_slots[args[0]]["state"] = "ready"
        elif sql.startswith("UPDATE warm_slots SET state=$3"):
            if self.warm_slots[args[0]]["state"] != "claimed":
                self.warm_slots[args[0]].update(state=args[2], reason=args[1])
        else:
            raise AssertionError(f"FakeDb does not know this statement: {sql}")
        return "OK"

    async def fetchrow(self, sql: str, *args: Any) -> dict[str, Any] | None:
        self.statements.append(sql)
        if sql.startswith("UPDATE sandboxes SET event_seq = event_seq + 1"):
            row = self.sandboxes.get(args[0])
            if row is None:
                return None
            row["event_seq"] = row.get("event_seq", 0) + 1
            return {"event_seq": row["event_seq"], "tenant_id": row["tenant_id"]}
        if re.search(r"FROM sandboxes WHERE id\s*=\s*\$1", sql):
            row = self.sandboxes.get(args[0])
            if row is not None and "node_id=$2" in sql and row["node_id"] != args[1]:
                return None
            return dict(row) if row is not None else None
        if re.search(r"FROM snapshots WHERE id\s*=\s*\$1", sql):
            snap = self.snapshots.get(args[0])
            if snap is not None and "sandbox_id=$2" in sql and snap["sandbox_id"] != args[1]:
                return None
            return dict(snap) if snap is not None else None
        raise AssertionError(f"FakeDb does not know this query: {sql}")

    async def fetchval(self, sql: str, *args: Any) -> Any:
        self.statements.append(sql)
        if sql is warm_module.STARTED_SQL:
            return self._warm_started(*args)
        if m := re.match(r"SELECT (\w+) FROM sandboxes WHERE id=\$1", sql):
            row = self.sandboxes.get(args[0])
            return None if row is None else row[m.group(1)]
        if "FROM sandbox_volumes" in sql:
            return None  # no read-write volumes
        if sql.startswith("SELECT auto_pause_filesystem FROM e2b_sandboxes WHERE sandbox_id=$1"):
            return self.e2b.get(args[0], {}).get("auto_pause_filesystem")
        if sql.startswith("SELECT id FROM snapshots WHERE sandbox_id=$1 AND state='ready'"):
            ready = [s for s in self.snapshots.values() if s["sandbox_id"] == args[0] and s["state"] == "ready"]
            return max(ready, key=lambda s: s["order"])["id"] if ready else None
        if sql.startswith("UPDATE snapshots SET node_id=$2 WHERE id=$1 RETURNING kind"):
            self.snapshots[args[0]]["node_id"] = args[1]
            return self.snapshots[args[0]]["kind"]
        if sql.startswith("SELECT target FROM warm_targets"):
            return self.warm_targets.get(args[1])
        if "sum(memory_mib)" in sql:
            return 0
        raise AssertionError(f"FakeDb does not know this query: {sql}")

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        self.statements.append(sql)
        if sql.startswith("SELECT id, sandbox_id, manifest FROM snapshots WHERE node_id=$1 AND promotion='promoted'"):
            return []  # no other sandbox's promoted snapshot on this node to take chunks from
        if sql.startswith("SELECT template, target FROM warm_targets"):
            return [{"template": t, "target": n} for t, n in self.warm_targets.items()]
        if sql.startswith("SELECT id FROM warm_slots WHERE id = ANY"):
            return [{"id": i} for i in args[0] if self.warm_slots.get(i, {}).get("state")
                    in ("preparing", "ready", "claimed")]
        if sql.startswith("SELECT s.id, s.kind, s.promotion FROM snapshots s WHERE s.sandbox_id=$1 AND s.state='ready'"):
            ready = [s for s in self.snapshots.values() if s["sandbox_id"] == args[0] and s["state"] == "ready"
                     and not s.get("pinned") and s["promotion"] != "promoting"]
            return [{"id": s["id"], "kind": s["kind"], "promotion": s["promotion"]}
                    for s in sorted(ready, key=lambda s: -s["order"])]
        raise AssertionError(f"FakeDb does not know this query: {sql}")

    def _warm_started(self, slot_id: str, generation: int, node: str, operation_id: str, *_: Any) -> datetime | None:
        """``STARTED_SQL``: the STARTED transition fenced by state, generation and node, in one statement."""
        assert self._in_tx, "STARTED_SQL outside a transaction"
        row = self.sandboxes.get(slot_id)
        ok = (row is not None and row["state"] == "starting" and row["generation"] == generation
              and row["node_id"] == node)
        outcome = OperationOutcome(operation_id, OperationState.SUCCEEDED)
        if not ok or row is None:
            self.transitions.append(Transition(slot_id, Verb.STARTED, False, None, outcome, None))
            return None
        row["state"] = str(lifecycle.next_state(row["state"], Verb.STARTED))
        self._outcome(outcome)
        self.events.append((slot_id, "started"))
        self.transitions.append(Transition(slot_id, Verb.STARTED, True, row["state"], outcome, "started"))
        return datetime.now(UTC)


class FakeTransaction:
    """``conn.transaction()``: as a context manager, or started, committed and rolled back by hand."""

    def __init__(self, db: FakeDb) -> None:
        self.db = db
        self._saved: tuple[Any, ...] | None = None

    async def start(self) -> None:
        self._saved = self.db._copy()
        self.db._in_tx += 1

    async def commit(self) -> None:
        self._saved = None
        self.db._in_tx -= 1

    async def rollback(self) -> None:
        assert self._saved is not None
        self.db._restore(self._saved)
        self._saved = None
        self.db._in_tx -= 1

    async def __aenter__(self) -> FakeTransaction:
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.rollback()


class FakeConn:
    """A connection of :class:`FakeDb`: its statements, and transactions."""

    def __init__(self, db: FakeDb) -> None:
        self.db = db
        self._tx: FakeTransaction | None = None

    def transaction(self) -> FakeTransaction:
        self._tx = FakeTransaction(self.db)
        return self._tx

    def is_in_transaction(self) -> bool:
        return self._tx is not None and self._tx._saved is not None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)  # execute, fetchrow, fetchval, fetch


# ------------------------------------------------------------------------------------- network, volumes, bus


class FakeNet:
    """The node's network: ``prepare`` hands out a real descriptor (of /dev/null) for the tap, so a test can
    check every one was closed; ``released`` lists the sandboxes whose network was released."""

    def __init__(self) -> None:
        self.bindings: dict[str, NetBinding] = {}
        self.fds: list[tuple[int, int, int]] = []  # (fd, device, inode) of each tap handed out
        self.released: list[str] = []

    def prepare(self, sandbox_id: str, generation: int) -> tuple[NetBinding, int]:
        binding = NetBinding(sandbox_id=sandbox_id, generation=generation, tap=f"pb{len(self.bindings)}",
                             host_addr="10.77.0.1", guest_addr="10.77.0.2", ca_path="ca.pem",
                             ca_cert_pem="CERT")
        self.bindings[sandbox_id] = binding
        fd = os.open(os.devnull, os.O_RDONLY)
        st = os.fstat(fd)
        self.fds.append((fd, st.st_dev, st.st_ino))
        return binding, fd

    def binding(self, sandbox_id: str) -> NetBinding | None:
        return self.bindings.get(sandbox_id)

    @staticmethod
    def guest_net(binding: NetBinding) -> GuestNet:
        return GuestNet(address=binding.guest_addr, gateway=binding.host_addr, ca_cert_pem=binding.ca_cert_pem)

    def release(self, sandbox_id: str) -> None:
        self.bindings.pop(sandbox_id, None)
        self.released.append(sandbox_id)

    def open_fds(self) -> list[int]:
        """The tap descriptors handed out and not closed (a number reused since for another file is closed)."""
        out = []
        for fd, dev, ino in self.fds:
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (dev, ino):
                out.append(fd)
        return out


class FakeVolumes:
    """A node without volumes; ``calls`` records what was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def attach(self, sandbox_id: str, vm_dir: Path) -> list[Any]:
        self.calls.append(("attach", sandbox_id))
        return []

    async def view_paths(self, sandbox_id: str) -> list[str]:
        return []

    async def roll_back(self, sandbox_id: str, snapshot_dir: Path) -> None:
        self.calls.append(("roll_back", sandbox_id))

    async def promote_for_suspend(self, sandbox_id: str) -> str | None:
        self.calls.append(("promote_for_suspend", sandbox_id))
        return None

    async def release_after_suspend(self, sandbox_id: str) -> None:
        self.calls.append(("release_after_suspend", sandbox_id))

    async def prepare(self, sandbox_id: str) -> None:
        self.calls.append(("prepare", sandbox_id))


class _Nc:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))


class FakeBus:
    """NATS: core publishes (``nc.published``) and JetStream commands (``commands``); ``on_command`` plays the
    service that consumes them (the snapshotter answering a promotion)."""

    def __init__(self) -> None:
        self.nc = _Nc()
        self.commands: list[tuple[str, Any]] = []
        self.on_command: Callable[[str, Any], None] | None = None

    async def publish_command(self, subject: str, cmd: Any, *, msg_id: str | None = None) -> None:
        self.commands.append((subject, cmd))
        if self.on_command is not None:
            self.on_command(subject, cmd)


class FakeRelay:
    def __init__(self) -> None:
        self.kicks = 0

    def kick(self) -> None:
        self.kicks += 1


# ---------------------------------------------------------------------------------------------------- node


@dataclass
class Node:
    """A ``SandboxManager`` on fakes, and the fakes, for assertions."""

    manager: SandboxManager
    vmm: FakeVmm
    guest: FakeGuest
    db: FakeDb
    net: FakeNet
    volumes: FakeVolumes
    bus: FakeBus
    relay: FakeRelay
    template: TemplateImage
    settings: Settings

    def vm_dir(self, sandbox_id: str) -> Path:
        path: Path = self.manager.store.sandbox_dir(sandbox_id)
        return path


def _template(root: Path) -> TemplateImage:
    d = root / "templates" / TEMPLATE / DIGEST
    d.mkdir(parents=True)
    for name in ("state", "ram", "disk.img", "vmlinuz", "initrd.img"):
        (d / name).write_bytes(b"tpl")
    snap = TemplateSnapshot(name=TEMPLATE, key=DIGEST, dir=d, kernel=d / "vmlinuz", initrd=d / "initrd.img",
                            state=d / "state", ram=d / "ram", disk=d / "disk.img", memory_mib=256, vcpus=1,
                            tsc_khz=1_000_000, image_digest="sha256:x", qemu_version="7.2.0", accel="tcg",
                            boot_s=1.0, paused_ms=1.0, created_at="2026-01-01T00:00:00Z", machine=MACHINE)
    return TemplateImage(name=TEMPLATE, digest=DIGEST, snapshot=snap)


@contextmanager
def make_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """A node agent's ``SandboxManager`` over the fakes, with the template ``base`` (digest ``DIGEST``)."""
    settings = Settings(node_id=NODE, data_dir=tmp_path, accel="tcg", guest_ca_file=None)
    store = NodeStore(tmp_path, NODE, 1)
    for d in (store.templates_dir, store.sandboxes_dir, store.volumes_dir):
        d.mkdir(parents=True)
    vmm, guest, db, net, bus, relay = FakeVmm(), FakeGuest(), FakeDb(), FakeNet(), FakeBus(), FakeRelay()
    monkeypatch.setattr(GuestChannel, "connect", staticmethod(guest.connect))
    monkeypatch.setattr(lifecycle, "apply", db.apply)
    manager = SandboxManager(settings, db, bus, relay, store, VmDriver(settings, store, vmm), net)
    volumes = FakeVolumes()
    manager.volumes = volumes
    tpl = _template(store.root)
    manager.templates[TEMPLATE] = tpl
    node = Node(manager, vmm, guest, db, net, volumes, bus, relay, tpl, settings)
    try:
        yield node
    finally:
        for vm in list(manager.vms.values()):
            if vm.monitor:
                vm.monitor.cancel()
        for fd in net.open_fds():
            os.close(fd)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    with make_node(tmp_path, monkeypatch) as n:
        yield n


async def settle() -> None:
    """Let tasks the operation started (a monitor noticing an exit) run to their next wait."""
    for _ in range(5):
        await asyncio.sleep(0)
