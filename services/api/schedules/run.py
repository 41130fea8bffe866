"""One schedule run: wake the sandbox, run the command, keep its output, put the sandbox back.

The steps compose the API's own lifecycle calls (so a run is the same operations, audit rows and events as
a user's calls, under the actor ``schedule:<id>``): ``resume`` (a paused sandbox, with or without its RAM,
or a suspended one woken on a node with room), the node's data-plane ``exec``, then ``pause`` or ``suspend``
(a full snapshot, promoted, before the VM is freed) when that was the state before.

Row states (``schedule_runs.state``): ``queued`` -> ``running`` (claimed by one process, which renews
``heartbeat_at``) -> ``succeeded | failed | timed_out | wake_failed``. A ``running`` row whose owner died is
taken over by the next firer (:func:`recover`), which puts the sandbox back and marks it ``interrupted``.
Events (through the outbox, on the sandbox's subject): ``schedule.fired`` when a run starts, and
``schedule.finished`` (``data.state``, ``exit_code``) when it ends, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from podbay.contracts.events import EventType
from podbay.contracts.api import ExecRequest, ExecResult
from podbay.contracts.schedules import OUTPUT_KEEP_BYTES, ScheduleRunState
from podbay.contracts.states import SandboxCommand, SandboxState
from podbay.errors import PodbayError
from podbay.grants import GrantKind
from podbay.objstore import ObjectStore
from podbay.outbox import emit_sandbox_event
from podbay.telemetry import SCHEDULE_LATENESS_SECONDS, SCHEDULE_RUNS, SCHEDULE_WAKE_SECONDS
from podbay import schedule_run_state

from ..core.auth import Principal
from ..core.context import ApiContext
from ..nodes_client import exec_body, lookup
from ..services import sandbox_lookup, sandbox_service

__all__ = ["Run", "execute", "recover", "put_back", "split_output", "finish_event"]

log = logging.getLogger("podbay.api.schedules")

#: Sandbox states a run can start from; others (a user's suspend or resume in flight) are waited out.
WAKEABLE = frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.SUSPENDED})
#: How long a run waits for a sandbox in a passing state (suspending, resuming, starting) to settle, seconds.
SETTLE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Run:
    """A claimed ``schedule_runs`` row and what its schedule asks for."""

    id: str
    schedule_id: str
    sandbox_id: str
    tenant_id: str
    fire_at: datetime
    command: dict[str, Any] | None
    awake_s: int

    @property
    def who(self) -> Principal:
        """The caller the run's lifecycle calls are made (and audited) as."""
        return Principal(tenant_id=self.tenant_id, key_id=f"schedule:{self.schedule_id}")


def split_output(text: str, keep: int = OUTPUT_KEEP_BYTES) -> tuple[str, str | None, int]:
    """``(head, tail, size)`` of one output stream: its first ``keep`` bytes, its last ``keep`` bytes when it
    is longer than the head (else None), and its size in bytes (UTF-8). A character cut at an edge is
    dropped."""
    data = text.encode()
    if len(data) <= keep:
        return text, None, len(data)
    tail_from = max(keep, len(data) - keep)
    return (data[:keep].decode(errors="ignore"), data[tail_from:].decode(errors="ignore"), len(data))


def finish_event(run_id: str, schedule_id: str, state: ScheduleRunState, **extra: Any) -> dict[str, Any]:
    """The ``data`` of a ``schedule.finished`` event."""
    return {"run_id": run_id, "schedule_id": schedule_id, "state": state.value, **extra}


async def _state(ctx: ApiContext, sandbox_id: str) -> str | None:
    return await sandbox_lookup.sandbox_state(ctx.pool, sandbox_id)


async def _settled(ctx: ApiContext, sandbox_id: str, timeout_s: float = SETTLE_TIMEOUT_S) -> str | None:
    """The sandbox's state once it is one a run can act on (or a final one), waiting out passing ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await _state(ctx, sandbox_id)
        if state is None or state in WAKEABLE or state in ("failed", "deleting", "deleted"):
            return state
        if time.monotonic() >= deadline:
            return state
        await asyncio.sleep(0.5)


async def _wake(ctx: ApiContext, run: Run, prior: str) -> None:
    """Bring the sandbox to ``running``; raises ``PodbayError`` when it does not get there."""
    if prior == SandboxState.RUNNING:
        return
    info, finished = await sandbox_service.resume(ctx, run.who, run.sandbox_id, wait=True)
    if not finished or info.state != SandboxState.RUNNING:
        raise PodbayError(f"sandbox {run.sandbox_id} did not wake (state {info.state})",
                          details={"state": str(info.state)})


async def put_back(ctx: ApiContext, who: Principal, sandbox_id: str, prior: str) -> None:
    """Return a sandbox that a run woke to ``prior``: pause it again, or suspend it (full snapshot, promoted,
    VM freed). Nothing when it is not running (the user changed it meanwhile) or was running before."""
    state = await _settled(ctx, sandbox_id)
    if state != SandboxState.RUNNING or prior == SandboxState.RUNNING:
        return
    if prior == SandboxState.PAUSED:
        await sandbox_service.pause(ctx, who, sandbox_id, wait=True)
    elif prior == SandboxState.SUSPENDED:
        await sandbox_service.suspend(ctx, who, sandbox_id, wait=True)


async def _exec(ctx: ApiContext, run: Run) -> ExecResult:
    """Run the command through the sandbox's node data plane (as ``POST /exec``, audited as
    ``sandbox.exec``); raises ``PodbayError`` when the node refuses or does not answer."""
    cmd = dict(run.command or {})
    base, gen, guest_env = await lookup(ctx, run.who, run.sandbox_id, SandboxCommand.EXEC, "sandbox.exec",
                                        {"program": str(cmd["argv"][0])[:256], "shell": False,
                                         "schedule_id": run.schedule_id})
    await schedule_run_state.mark_command_started(ctx.pool, run.id)
    SCHEDULE_LATENESS_SECONDS.observe(max(0.0, (datetime.now(UTC) - run.fire_at).total_seconds()))
    headers = ctx.node_headers(run.who.tenant_id, run.sandbox_id, gen, GrantKind.EXEC)
    try:
        resp = await ctx.nodes_http.post(f"{base}/internal/v1/sandboxes/{run.sandbox_id}/exec",
                                         json=exec_body(ExecRequest(**cmd), guest_env), headers=headers)
    except httpx.HTTPError as exc:
        raise PodbayError(f"the sandbox's node did not answer: {type(exc).__name__}") from exc
    if resp.status_code != 200:
        raise PodbayError(f"exec answered HTTP {resp.status_code}: {resp.text[:500]}")
    return ExecResult.model_validate_json(resp.content)


async def _store_output(store: ObjectStore | None, run: Run, result: ExecResult) -> str | None:
    """Put the whole stdout and stderr under ``schedules/<tenant>/<sandbox>/<schedule>/<run>/``; the prefix,
    or None when there is no store or it failed (the head and tail in PostgreSQL remain)."""
    if store is None or not (result.stdout or result.stderr):
        return None
    key = f"schedules/{run.tenant_id}/{run.sandbox_id}/{run.schedule_id}/{run.id}"
    try:
        await store.put(f"{key}/stdout", result.stdout.encode())
        await store.put(f"{key}/stderr", result.stderr.encode())
    except PodbayError as exc:
        log.warning("run %s: output not stored: %s", run.id, exc)
        return None
    return key


async def _finish(ctx: ApiContext, run: Run, owner: str, state: ScheduleRunState, *, reason: str | None = None,
                  message: str | None = None, result: ExecResult | None = None,
                  output_key: str | None = None) -> None:
    cols: dict[str, Any] = {"exit_code": None, "stdout_head": None, "stdout_tail": None, "stdout_bytes": None,
                            "stderr_head": None, "stderr_tail": None, "stderr_bytes": None}
    if result is not None:
        cols["exit_code"] = result.exit_code
        cols["stdout_head"], cols["stdout_tail"], cols["stdout_bytes"] = split_output(result.stdout)
        cols["stderr_head"], cols["stderr_tail"], cols["stderr_bytes"] = split_output(result.stderr)
    async with ctx.pool.acquire() as conn, conn.transaction():
        done = await schedule_run_state.finish(conn, run.id, owner, state, reason=reason, message=message,
                                               output=cols, output_key=output_key)
        if done is None:
            return  # the schedule was removed (or the sandbox deleted) meanwhile, or another firer took it over
        await emit_sandbox_event(conn, run.sandbox_id, EventType.SCHEDULE_FINISHED, tenant_id=run.tenant_id, data=finish_event(
            run.id, run.schedule_id, state, exit_code=cols["exit_code"], reason=reason))
    ctx.relay.kick()
    SCHEDULE_RUNS.labels(state.value).inc()


async def execute(ctx: ApiContext, store: ObjectStore | None, run: Run, owner: str) -> None:
    """Claim the queued run ``run`` for ``owner`` and carry it out to the end (never raises, except
    cancellation: a cancelled run stays ``running`` for the next firer to put back and mark interrupted)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        prior = await schedule_run_state.claim(conn, run.id, owner)
        if prior is None and not await conn.fetchval("SELECT true FROM schedule_runs WHERE id=$1"
                                                     " AND owner=$2 AND state='running'", run.id, owner):
            return  # claimed by another firer, or removed
        await emit_sandbox_event(conn, run.sandbox_id, EventType.SCHEDULE_FIRED, tenant_id=run.tenant_id, data={
            "run_id": run.id, "schedule_id": run.schedule_id, "fire_at": run.fire_at.isoformat(),
            "prior_state": prior})
    ctx.relay.kick()
    prior = await _settled(ctx, run.sandbox_id)
    if prior not in WAKEABLE:
        await _finish(ctx, run, owner, ScheduleRunState.WAKE_FAILED, reason="invalid_state",
                      message=f"sandbox is {prior}")
        return
    # The state actually woken from (a passing state seen at the claim settles into one of these).
    await schedule_run_state.set_prior_state(ctx.pool, run.id, prior)
    t0 = time.perf_counter()
    try:
        await _wake(ctx, run, prior)
    except PodbayError as exc:
        log.warning("run %s: sandbox %s did not wake: %s", run.id, run.sandbox_id, exc)
        await put_back(ctx, run.who, run.sandbox_id, prior)  # a wake that half-happened is undone
        await _finish(ctx, run, owner, ScheduleRunState.WAKE_FAILED, reason=exc.code, message=exc.message)
        return
    SCHEDULE_WAKE_SECONDS.labels(prior).observe(time.perf_counter() - t0)
    await schedule_run_state.mark_awake(ctx.pool, run.id)
    state, reason, message = ScheduleRunState.SUCCEEDED, None, None
    result: ExecResult | None = None
    output_key: str | None = None
    try:
        if run.command:
            try:
                result = await _exec(ctx, run)
            except PodbayError as exc:
                state, reason, message = ScheduleRunState.FAILED, exc.code, exc.message
            else:
                output_key = await _store_output(store, run, result)
                if result.timed_out:
                    state, reason = ScheduleRunState.TIMED_OUT, "timeout"
                elif result.exit_code != 0:
                    state, reason = ScheduleRunState.FAILED, "exit_code"
        else:
            SCHEDULE_LATENESS_SECONDS.observe(max(0.0, (datetime.now(UTC) - run.fire_at).total_seconds()))
        if run.awake_s:
            await asyncio.sleep(run.awake_s)
    finally:
        # Put the sandbox back before the run counts as done (a cancelled run is put back by the next firer).
        try:
            await asyncio.shield(put_back(ctx, run.who, run.sandbox_id, prior))
        except PodbayError as exc:
            log.warning("run %s: sandbox %s not put back to %s: %s", run.id, run.sandbox_id, prior, exc)
            message = f"{message + '; ' if message else ''}not put back to {prior}: {exc.message}"
    await _finish(ctx, run, owner, state, reason=reason, message=message, result=result, output_key=output_key)


async def recover(ctx: ApiContext, run_id: str, owner: str) -> None:
    """Finish a run whose firer died (already taken over by ``owner``): put the sandbox back to the state it
    had before the wake, then mark the run ``interrupted`` with an event."""
    row = await ctx.pool.fetchrow("SELECT schedule_id, sandbox_id, tenant_id, prior_state FROM schedule_runs"
                                  " WHERE id=$1 AND owner=$2 AND state='running'", run_id, owner)
    if row is None:
        return
    who = Principal(tenant_id=row["tenant_id"], key_id=f"schedule:{row['schedule_id']}")
    message = "the process running it stopped"
    if row["prior_state"] is not None:
        try:
            await put_back(ctx, who, row["sandbox_id"], row["prior_state"])
        except PodbayError as exc:
            message += f"; not put back to {row['prior_state']}: {exc.message}"
    run = Run(id=run_id, schedule_id=row["schedule_id"], sandbox_id=row["sandbox_id"], tenant_id=row["tenant_id"],
              fire_at=datetime.now(UTC), command=None, awake_s=0)
    await _finish(ctx, run, owner, ScheduleRunState.INTERRUPTED, reason="interrupted", message=message)
