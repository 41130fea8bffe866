"""``podbay schedule add|list|runs|rm``: sandboxes that wake on a cron expression or at one time.

    podbay schedule add ID --cron '0 7 * * 1-5' --tz Europe/Berlin -- python3 /srv/agent/briefing.py
    podbay schedule add ID --at 2026-12-02T09:00:00Z -- ./check-deploy.sh
    podbay schedule list ID
    podbay schedule runs ID SCHEDULE
    podbay schedule rm ID SCHEDULE
"""

from __future__ import annotations

from datetime import datetime

import typer

from podbay.cli._common import IdArg, JsonFlag, client, handle_errors, parse_pairs, print_json, print_rows, print_table
from podbay.contracts.schedules import ScheduleRunInfo
from podbay.errors import InvalidRequest

__all__ = ["app"]

app = typer.Typer(help="Wake a sandbox on a schedule, run a command, put it back.", no_args_is_help=True)


def _when(t: datetime | None) -> str:
    return t.isoformat(timespec="seconds") if t is not None else "-"


def _duration(run: ScheduleRunInfo) -> str:
    return f"{run.duration_ms / 1000:.1f}s" if run.duration_ms is not None else "-"


@app.command("add")
@handle_errors
def add(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID", help="Sandbox id."),
    cmd: list[str] = typer.Argument(None, metavar="[-- CMD [ARGS]...]", help="The command; none: only wake."),
    cron: str | None = typer.Option(None, "--cron", help="Five cron fields: minute hour day month weekday."),
    tz: str = typer.Option("UTC", "--tz", help="IANA time zone the cron fields are read in."),
    at: str | None = typer.Option(None, "--at", help="Fire once at this ISO 8601 time (UTC without an offset)."),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for the command; repeatable."),
    cwd: str | None = typer.Option(None, "--cwd", help="Working directory inside the sandbox."),
    user: str | None = typer.Option(None, "--user", "-u", help="User name or uid (default root)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Kill the command after this many seconds."),
    awake: int | None = typer.Option(None, "--awake", help="Stay awake this many seconds after the command "
                                     "(default 0; 60 without a command)."),
    overlap: str = typer.Option("skip", "--overlap", help="A fire while the last run goes: skip or queue."),
    missed: str = typer.Option("catch_up_once", "--missed", help="Fire times passed while podbay was down: "
                               "catch_up_once or skip."),
    as_json: JsonFlag = False,
) -> None:
    """Add a schedule; prints its id and next fire time."""
    if (cron is None) == (at is None):
        raise InvalidRequest("give exactly one of --cron EXPR or --at TIME")
    when: datetime | None = None
    if at is not None:
        try:
            when = datetime.fromisoformat(at)
        except ValueError as exc:
            raise InvalidRequest(f"--at: not an ISO 8601 time: {at!r}") from exc
    info = client(ctx).schedules.add(sandbox_id, cron=cron, tz=tz, at=when, command=cmd or None,
                                     env=parse_pairs(env, "--env"), cwd=cwd, user=user, timeout_s=timeout,
                                     awake_s=awake, overlap=overlap, missed=missed)
    if as_json:
        print_json(info)
        return
    print(f"{info.id}\tnext {_when(info.next_fire_at)}")


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, sandbox_id: IdArg, as_json: JsonFlag = False) -> None:
    """The sandbox's schedules: when, command, next fire time, last run and its exit code."""
    found = client(ctx).schedules.list(sandbox_id)
    print_rows(found, as_json, ["ID", "WHEN", "COMMAND", "NEXT", "LAST_RUN", "STATE", "EXIT"], (
        (s.id, f"{s.cron} {s.tz}" if s.cron else f"at {_when(s.at)}",
         " ".join(s.command.argv) if s.command else "(wake only)", _when(s.next_fire_at),
         _when(s.last_run.fire_at) if s.last_run else "-", s.last_run.state.value if s.last_run else "-",
         "-" if s.last_run is None or s.last_run.exit_code is None else str(s.last_run.exit_code))
        for s in found))


@app.command("runs")
@handle_errors
def runs(
    ctx: typer.Context,
    sandbox_id: IdArg,
    schedule_id: str = typer.Argument(..., metavar="SCHEDULE"),
    limit: int = typer.Option(20, "--limit", help="Newest runs to show."),
    output: bool = typer.Option(False, "--output", help="Print each run's output (head and tail)."),
    as_json: JsonFlag = False,
) -> None:
    """Run history, newest first: fire time, start, duration, state, exit code, and output (truncated)."""
    found = client(ctx).schedules.runs(sandbox_id, schedule_id, limit)
    if as_json:
        print_json(found)
        return
    print_table(["RUN", "FIRE_AT", "STARTED", "DURATION", "STATE", "EXIT", "OUTPUT"], [
        (r.id, _when(r.fire_at), _when(r.started_at), _duration(r), r.state.value,
         "-" if r.exit_code is None else str(r.exit_code),
         ((r.stdout_head or "") + (r.stderr_head or "")).strip().replace("\n", " | ")[:60] or r.message or "-")
        for r in found])
    if output:
        for r in found:
            print(f"--- {r.id} stdout ({r.stdout_bytes or 0} bytes)")
            print((r.stdout_head or "") + (f"\n[...]\n{r.stdout_tail}" if r.stdout_tail else ""), end="")
            print(f"--- {r.id} stderr ({r.stderr_bytes or 0} bytes)")
            print((r.stderr_head or "") + (f"\n[...]\n{r.stderr_tail}" if r.stderr_tail else ""), end="")


@app.command("rm")
@handle_errors
def rm(
    ctx: typer.Context,
    sandbox_id: IdArg,
    schedule_id: str = typer.Argument(..., metavar="SCHEDULE"),
) -> None:
    """Remove a schedule and its run history; prints its id, as ``sandbox rm`` does."""
    client(ctx).schedules.remove(sandbox_id, schedule_id)
    print(schedule_id)
