"""Live migration of a sandbox between node agents (drain, issue 8).

Flow (source S, destination D; the scheduler's drain sends S ``podbay.cmd.node.<S>.migrate_out``)::

    S: lock, check the row (on S, at generation g, running|paused); a hibernated sandbox is restored paused
    S ──podbay.migrate.<D>.prepare──► D: check the row, lease an address and tap (binding for g+1), start
                                         QEMU -incoming defer on a sparse disk of the same size, listen on
                                         one TCP port of PODBAY_MIGRATE_HOST; answer host, port, token
    S: connect, send the token, hand the socket to QEMU (getfd), migrate (RAM + disk, vmmigrate.py)
       D: checks the token, hands its socket to its QEMU (migrate-incoming); the guest runs on arrival
          (a running guest moved stop-and-copy under an old TCG arrives paused; finish resumes it)
    S ──podbay.migrate.<D>.finish (downtime, ok)──► D: wait for its stream's end, connect the guest
       channel, after-restore (clock, new address and CA); in one transaction: node = D, generation g+1
       (only if still S at g), event ``migrated`` {source, destination, downtime_ms, total_ms}; answer
    S: committed → kill its QEMU, release the tap and VM files; operation ``succeeded`` with the figures

Failure handling: a failed or timed-out stream cancels the migration on S and the guest carries on there
(``vmmigrate.migrate_out``); S tells D ``ok: false`` and D tears its QEMU down. When D's answer to
``finish`` is lost, S fences: it bumps the generation itself (only if the row is still S at g); if that
succeeds D's commit can no longer succeed (it tears down) and S resumes the guest at g+1; if it does not,
D committed and S kills its copy. So exactly one node runs the sandbox and it is never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from podbay.contracts.events import EventType
from podbay.channel.client import GuestChannel
from podbay.contracts import subjects
from podbay.contracts.messages import (
    MigrateFinish,
    MigrateFinishReply,
    MigrateOutCmd,
    MigratePrepare,
    MigratePrepareReply,
    Resources,
)
from podbay.errors import PodbayError
from podbay import lifecycle
from podbay.lifecycle import SandboxEvent, Verb
from podbay.telemetry import LIFECYCLE_OPERATIONS
from podbay import operation_state

from . import vmmigrate
from .vmdriver import VmHandle
from .vmhost import RunningVm, VmHost

__all__ = ["MigrationOps"]

log = logging.getLogger("podbay.nodeagent.migrate")

_TOKEN_BYTES = 32  # sent as 64 hex characters before the stream
_PREPARE_TIMEOUT_S = 60.0


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"


@dataclass
class _Incoming:
    """A destination QEMU waiting for (or receiving) one sandbox's stream."""

    cmd: MigratePrepare
    handle: VmHandle
    server: socket.socket
    token: str
    binding: Any
    arrived: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    task: asyncio.Task[None] | None = None


class MigrationOps:
    """Both ends of a live migration on this node; ``start`` subscribes to the destination subjects."""

    def __init__(self, host: VmHost) -> None:
        self.m = host
        self._incoming: dict[str, _Incoming] = {}
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        nc = self.m.bus.nc
        self._subs.append(await nc.subscribe(subjects.migrate_prepare(self.m.node_id), cb=self._on_prepare))
        self._subs.append(await nc.subscribe(subjects.migrate_finish(self.m.node_id), cb=self._on_finish))

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for sid in list(self._incoming):
            await self._drop_incoming(sid)

    # ------------------------------------------------------------------ destination

    def _spawn(self, coro: Any) -> None:
        # nats-py runs one subscription's callbacks in order; migrations must not wait for each other.
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer(self, msg: Any, reply_to: Callable[[bytes], Awaitable[BaseModel]],
                malformed: Callable[[str], BaseModel]) -> None:
        """Answer the request ``msg`` in a task of its own with ``await reply_to(msg.data)`` (a reply model);
        a ``ValueError`` (a body that does not parse) is answered with ``malformed("malformed request: ...")``.
        A reply that cannot be sent is dropped: the requester's timeout tells it."""
        async def answer() -> None:
            try:
                reply = await reply_to(msg.data)
            except ValueError as exc:
                reply = malformed(f"malformed request: {exc}")
            with contextlib.suppress(Exception):
                await msg.respond(reply.model_dump_json().encode())
        self._spawn(answer())

    async def _on_prepare(self, msg: Any) -> None:
        self._answer(msg, lambda data: self.prepare(MigratePrepare.model_validate_json(data)),
                     lambda error: MigratePrepareReply(ok=False, error=error))

    async def _on_finish(self, msg: Any) -> None:
        self._answer(msg, lambda data: self.finish(MigrateFinish.model_validate_json(data)),
                     lambda error: MigrateFinishReply(committed=False, error=error))

    async def prepare(self, req: MigratePrepare) -> MigratePrepareReply:
        """Start a QEMU waiting for ``req``'s stream and a listening socket; see the module docstring."""
        m = self.m
        row = await m.pool.fetchrow("SELECT state, node_id, generation FROM sandboxes WHERE id=$1", req.sandbox_id)
        if (row is None or row["node_id"] != req.source_node or row["generation"] != req.generation
                or row["state"] not in ("running", "paused")):
            return MigratePrepareReply(ok=False, error=f"sandbox {req.sandbox_id} is not at generation "
                                                       f"{req.generation} on {req.source_node}")
        await self._drop_incoming(req.sandbox_id)  # an earlier attempt's leftovers
        vm_dir = m.store.sandbox_dir(req.sandbox_id)
        handle: VmHandle | None = None
        server: socket.socket | None = None
        try:
            tpl = await m.template(req.template, req.template_digest)
            await m.discard_vm_dir(vm_dir)
            binding, tap_fd = await asyncio.to_thread(m.net.prepare, req.sandbox_id, req.generation + 1)
            try:
                config = tpl.snapshot.vm_config(m.settings, memory_mib=req.resources.memory_mib,
                                                vcpus=req.resources.vcpus)
                process = await vmmigrate.start_incoming(m.driver.vmm, config, vm_dir, disk_size=req.disk_size,
                                                       tap_fd=tap_fd)
                handle = VmHandle(m.driver.vmm, process)
            finally:
                os.close(tap_fd)
            host = m.settings.migrate_host or m.settings.node_host
            server = socket.create_server((host, 0), backlog=1)
            server.setblocking(False)
            inc = _Incoming(req, handle, server, secrets.token_hex(_TOKEN_BYTES), binding)
            self._incoming[req.sandbox_id] = inc
            inc.task = asyncio.create_task(self._receive(inc), name=f"migrate-in-{req.sandbox_id}")
            return MigratePrepareReply(ok=True, host=host, port=server.getsockname()[1], token=inc.token)
        except Exception as exc:
            log.warning("migration of %s into this node: prepare failed: %s", req.sandbox_id, _reason(exc))
            if server is not None:
                server.close()
            if handle is not None:
                await m.teardown(handle, None, vm_dir)
            else:
                await m.discard_vm_dir(vm_dir)
            await m.release_net(req.sandbox_id)
            return MigratePrepareReply(ok=False, error=_reason(exc))

    async def _receive(self, inc: _Incoming) -> None:
        """Accept one connection carrying the right token and feed it to the waiting QEMU."""
        loop = asyncio.get_running_loop()
        vmm, qemu = self.m.driver.vmm, inc.handle.process
        try:
            while True:
                conn, _ = await asyncio.wait_for(loop.sock_accept(inc.server), _PREPARE_TIMEOUT_S)
                try:
                    got = await asyncio.wait_for(_recv_exact(loop, conn, _TOKEN_BYTES * 2), 10.0)
                except (TimeoutError, OSError, EOFError):
                    conn.close()
                    continue
                if hmac.compare_digest(got, inc.token.encode()):
                    break
                conn.close()  # not our source: wait for the right one
            inc.server.close()
            conn.setblocking(True)
            with vmm.events(qemu, "MIGRATION") as listener:
                try:
                    await vmmigrate.accept_incoming(vmm, qemu, conn)
                finally:
                    conn.close()  # QEMU holds its own descriptor now
                state = await vmmigrate.wait_incoming(vmm, qemu, listener, self.m.settings.migrate_timeout_s)
            inc.arrived.set_result(state)
        except BaseException as exc:
            if not inc.arrived.done():
                inc.arrived.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
            if not isinstance(exc, Exception):
                raise
            # No stream (the source died or gave up before connecting): if no finish comes to clean up,
            # the waiting QEMU and its tap go after the migration bound.
            self._spawn(self._expire(inc))

    async def _expire(self, inc: _Incoming) -> None:
        await asyncio.sleep(self.m.settings.migrate_timeout_s)
        if self._incoming.get(inc.cmd.sandbox_id) is inc:
            async with self.m.lock(inc.cmd.sandbox_id):
                if self._incoming.get(inc.cmd.sandbox_id) is inc:
                    log.warning("migration of %s into this node abandoned; discarding its VM", inc.cmd.sandbox_id)
                    await self._drop_incoming(inc.cmd.sandbox_id)

    async def _drop_incoming(self, sandbox_id: str) -> None:
        inc = self._incoming.pop(sandbox_id, None)
        if inc is None:
            return
        if inc.task is not None:
            inc.task.cancel()
            with contextlib.suppress(BaseException):
                await inc.task
        if not inc.arrived.done():
            inc.arrived.cancel()
        else:
            with contextlib.suppress(BaseException):
                inc.arrived.exception()
        inc.server.close()
        await self.m.teardown(inc.handle, None, self.m.store.sandbox_dir(sandbox_id))
        await self.m.release_net(sandbox_id)

    async def finish(self, req: MigrateFinish) -> MigrateFinishReply:
        """Take the arrived sandbox over (or tear down when ``req.ok`` is False); see the module docstring."""
        m = self.m
        inc = self._incoming.get(req.sandbox_id)
        if inc is None:
            row = await m.pool.fetchrow("SELECT node_id, generation FROM sandboxes WHERE id=$1", req.sandbox_id)
            if row is not None and row["node_id"] == m.node_id and row["generation"] == req.generation + 1:
                return MigrateFinishReply(committed=True, generation=req.generation + 1)  # a repeated finish
            return MigrateFinishReply(committed=False, error="no migration of this sandbox is waiting here")
        if not req.ok:
            await self._drop_incoming(req.sandbox_id)
            return MigrateFinishReply(committed=False, error="the source gave up")
        async with m.lock(req.sandbox_id):
            channel: GuestChannel | None = None
            try:
                state = await asyncio.wait_for(asyncio.shield(inc.arrived), m.settings.migrate_timeout_s)
                # A running guest moved stop-and-copy arrives paused (vmmigrate.precopy_safe): resume it here.
                state = await vmmigrate.arrive(m.driver.vmm, inc.handle.process, state, req.was_running)
                hygiene_net = m.guest_net(inc.binding)
                if state == "running":
                    channel = await GuestChannel.connect(inc.handle.channel_path, timeout_s=m.settings.restore_timeout_s)
                    # The guest kept its memory and identity; it needs this node's address and CA and the time.
                    await channel.after_restore(time_ns=time.time_ns(), net=hygiene_net)
                gen = req.generation + 1
                async with m.pool.acquire() as conn, conn.transaction():
                    # The event names the row's tenant (the default of emit_sandbox_event) and its state.
                    row = await lifecycle.apply(
                        conn, req.sandbox_id, Verb.MOVE, states=lifecycle.sources(Verb.MOVE),
                        generation=req.generation, node=inc.cmd.source_node, set_node=m.node_id, new_generation=gen,
                        event=SandboxEvent(EventType.MIGRATED, node_id=m.node_id, generation=gen,
                                           data={"source": inc.cmd.source_node, "destination": m.node_id,
                                                 "downtime_ms": req.downtime_ms, "total_ms": req.total_ms,
                                                 "operation_id": req.operation_id}))
                    if row is None:
                        raise _Fenced()
                m.relay.kick()
            except Exception as exc:
                why = "the source fenced the sandbox" if isinstance(exc, _Fenced) else _reason(exc)
                log.warning("migration of %s into this node failed: %s", req.sandbox_id, why)
                if channel is not None:
                    with contextlib.suppress(Exception):
                        await channel.close()
                await self._drop_incoming(req.sandbox_id)
                LIFECYCLE_OPERATIONS.labels("nodeagent", "migrate_in", "failed").inc()
                return MigrateFinishReply(committed=False, error=why)
            self._incoming.pop(req.sandbox_id, None)
            c = inc.cmd
            (m.store.sandbox_dir(req.sandbox_id) / "meta.json").write_text(json.dumps(
                {"sandbox_id": req.sandbox_id, "generation": gen, "memory_mib": c.resources.memory_mib,
                 "vcpus": c.resources.vcpus}))
            if state == "running":
                m.adopt(req.sandbox_id, gen, c.resources, inc.handle, channel)
            else:
                m.adopt(req.sandbox_id, gen, c.resources, inc.handle, None, paused_at=time.monotonic(),
                        net_pending=hygiene_net)
            LIFECYCLE_OPERATIONS.labels("nodeagent", "migrate_in", "ok").inc()
            log.info("sandbox %s arrived from %s (%s, downtime %.1f ms)", req.sandbox_id, c.source_node, state,
                     req.downtime_ms)
            return MigrateFinishReply(committed=True, generation=gen)

    # ------------------------------------------------------------------ source

    async def migrate_out(self, cmd: MigrateOutCmd) -> None:
        """Move ``cmd.sandbox_id`` to ``cmd.dest_node``; records the outcome in operation ``cmd.operation_id``
        (``data``: source, destination, downtime_ms, total_ms). Idempotent: a sandbox already on the
        destination finishes the operation; a stale generation fails it."""
        m = self.m
        async with m.lock(cmd.sandbox_id):
            row = await m.pool.fetchrow(
                "SELECT state, node_id, generation, tenant_id, template, template_digest, hostname, memory_mib,"
                " vcpus FROM sandboxes WHERE id=$1", cmd.sandbox_id)
            if row is not None and row["node_id"] == cmd.dest_node and row["generation"] == cmd.generation + 1:
                await m.finish_op(cmd.operation_id, None)  # redelivered after it moved
                return
            if (row is None or row["node_id"] != m.node_id or row["generation"] != cmd.generation
                    or row["state"] not in ("running", "paused")):
                await self._fail(cmd, f"sandbox is not {cmd.generation} on {m.node_id} (running or paused)")
                return
            try:
                if cmd.sandbox_id in m.hibernated:
                    await m.wake_hibernated(cmd.sandbox_id)  # RAM released: restore it (paused) first
                vm = m.vms.get(cmd.sandbox_id)
                if vm is None or vm.stopping:
                    raise RuntimeError("its VM is not running on this node")
                await self._move(cmd, row, vm)
            except Exception as exc:
                log.warning("migration of %s to %s failed: %s", cmd.sandbox_id, cmd.dest_node, _reason(exc))
                LIFECYCLE_OPERATIONS.labels("nodeagent", "migrate_out", "failed").inc()
                await self._fail(cmd, _reason(exc))

    async def _move(self, cmd: MigrateOutCmd, row: Any, vm: RunningVm) -> None:
        m = self.m
        vm_dir = m.store.sandbox_dir(cmd.sandbox_id)
        req = MigratePrepare(
            operation_id=cmd.operation_id, sandbox_id=cmd.sandbox_id, tenant_id=row["tenant_id"],
            source_node=m.node_id, generation=cmd.generation, template=row["template"],
            template_digest=row["template_digest"],
            resources=Resources(memory_mib=row["memory_mib"], vcpus=row["vcpus"]), hostname=row["hostname"],
            disk_size=vmmigrate.disk_size(vm_dir))
        msg = await m.bus.nc.request(subjects.migrate_prepare(cmd.dest_node), req.model_dump_json().encode(),
                                     timeout=_PREPARE_TIMEOUT_S)
        prep = MigratePrepareReply.model_validate_json(msg.data)
        if not prep.ok:
            raise RuntimeError(f"destination {cmd.dest_node} refused: {prep.error}")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stats: vmmigrate.MigrationStats | None = None
        # The guest must arrive with its channel's host side closed: a guest that migrated while the host
        # was connected never answered the destination's HELLO (measured in tests/e2e/test_drain.py), so
        # the channel is closed first (calls on the sandbox wait for its lock meanwhile) and reopened on
        # whichever node runs the guest afterwards.
        if vm.channel is not None:
            with contextlib.suppress(Exception):
                await vm.channel.close()
            vm.channel = None
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (prep.host, prep.port)), 10.0)
            await loop.sock_sendall(sock, prep.token.encode())
            sock.setblocking(True)
            stats = await vmmigrate.migrate_out(
                m.driver.vmm, vm.handle.process, sock, timeout_s=m.settings.migrate_timeout_s,
                max_downtime_ms=m.settings.migrate_max_downtime_ms, bandwidth_mib_s=m.settings.migrate_bandwidth_mib_s)
        except BaseException:
            await self._tell(cmd, ok=False)  # the source carries on (migrate_out resumed it)
            await self._reopen(vm)
            raise
        finally:
            sock.close()
        reply = await self._tell(cmd, ok=True, stats=stats)
        if reply is None or not reply.committed:
            # Fence before resuming: only one of the two may win the row at generation + 1.
            async with m.pool.acquire() as conn, conn.transaction():
                fenced = await lifecycle.apply(conn, cmd.sandbox_id, Verb.FENCE, states=None,
                                               generation=cmd.generation, node=m.node_id, bump_generation=True)
            if fenced is not None:
                vm.generation = int(fenced["generation"])
                await vmmigrate.resume_source(m.driver.vmm, vm.handle.process, stats.was_running)
                await self._reopen(vm)
                raise RuntimeError("the destination did not take the sandbox over"
                                   + (f": {reply.error}" if reply is not None and reply.error else ""))
            # The destination committed; its answer was lost.
        await m.stop_vm(cmd.sandbox_id)
        await m.discard_vm_dir(vm_dir)
        await m.release_net(cmd.sandbox_id)
        data = {"source": m.node_id, "destination": cmd.dest_node, "downtime_ms": stats.downtime_ms,
                "total_ms": stats.total_ms, "was_running": stats.was_running}
        await operation_state.succeed(m.pool, cmd.operation_id, data=data)
        await m.notify_op(cmd.operation_id, None)
        LIFECYCLE_OPERATIONS.labels("nodeagent", "migrate_out", "ok").inc()
        log.info("sandbox %s moved to %s: total %.0f ms, downtime %.1f ms", cmd.sandbox_id, cmd.dest_node,
                 stats.total_ms, stats.downtime_ms)

    async def _reopen(self, vm: RunningVm) -> None:
        """Reconnect the source's guest channel after a migration that did not happen (a paused guest's
        channel is reopened by its resume)."""
        try:
            if await vm.handle.status() == "running":
                vm.channel = await GuestChannel.connect(vm.handle.channel_path, timeout_s=self.m.settings.restore_timeout_s)
        except Exception as exc:  # the VM monitor or the next call reports a VM that is really gone
            log.warning("guest channel of %s not reopened: %s", vm.sandbox_id, _reason(exc))

    async def _tell(self, cmd: MigrateOutCmd, *, ok: bool,
                    stats: vmmigrate.MigrationStats | None = None) -> MigrateFinishReply | None:
        body = MigrateFinish(operation_id=cmd.operation_id, sandbox_id=cmd.sandbox_id, generation=cmd.generation,
                             ok=ok, downtime_ms=stats.downtime_ms if stats else 0.0,
                             total_ms=stats.total_ms if stats else 0.0,
                             was_running=stats.was_running if stats else True)
        try:
            msg = await self.m.bus.nc.request(subjects.migrate_finish(cmd.dest_node), body.model_dump_json().encode(),
                                              timeout=self.m.settings.restore_timeout_s + 30)
            return MigrateFinishReply.model_validate_json(msg.data)
        except Exception as exc:
            log.warning("finish of %s's migration unanswered: %s", cmd.sandbox_id, exc)
            return None

    async def _fail(self, cmd: MigrateOutCmd, reason: str) -> None:
        await operation_state.fail(self.m.pool, cmd.operation_id, "migration_failed", reason)
        await self.m.notify_op(cmd.operation_id, reason)


class _Fenced(Exception):
    """The row moved on (the source fenced it, or it was deleted) before the destination could commit."""


async def _recv_exact(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    conn.setblocking(False)
    buf = b""
    while len(buf) < n:
        chunk = await loop.sock_recv(conn, n - len(buf))
        if not chunk:
            raise EOFError("closed before the token")
        buf += chunk
    return buf
