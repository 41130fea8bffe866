"""``podbay snapshot create|list|show|diff``."""

from __future__ import annotations

import sys

import typer

from podbay.cli._common import IdArg, JsonFlag, client, handle_errors, print_json, print_one, print_rows
from podbay.errors import NotFound

__all__ = ["app"]

app = typer.Typer(help="Take and list sandbox snapshots.", no_args_is_help=True)


@app.command("create")
@handle_errors
def create(
    ctx: typer.Context, sandbox_id: IdArg,
    kind: str = typer.Option("full", "--kind", help="full (memory, devices, disk) or disk."),
) -> None:
    """Take a snapshot now; prints its id when it is ready."""
    print(client(ctx).snapshot_sandbox(sandbox_id, kind).id)


@app.command("list")
@handle_errors
def list_(
    ctx: typer.Context,
    sandbox_id: IdArg,
    as_json: JsonFlag = False,
) -> None:
    """The sandbox's snapshots, newest first: kind, time, size, parent, held ms, promotion to object storage."""
    snaps = client(ctx).list_snapshots(sandbox_id)
    print_rows(snaps, as_json, ["ID", "KIND", "CREATED", "SIZE_MIB", "PARENT", "HELD_MS", "PROMOTION"], (
        (s.id, s.kind, s.created_at.isoformat(timespec="seconds"),
         f"{(s.size_bytes or 0) / (1 << 20):.1f}", s.parent_id or "-", f"{s.paused_ms or 0:.1f}", s.promotion)
        for s in snaps))


@app.command("show")
@handle_errors
def show(
    ctx: typer.Context,
    sandbox_id: IdArg,
    snapshot_id: str = typer.Argument(..., metavar="SNAPSHOT"),
    as_json: JsonFlag = False,
) -> None:
    """One snapshot: kind, sizes, and its promotion (state, time, bytes uploaded and stored, error)."""
    found = [s for s in client(ctx).list_snapshots(sandbox_id) if s.id == snapshot_id]
    if not found:
        raise NotFound(f"snapshot {snapshot_id} of sandbox {sandbox_id} does not exist")
    print_one(found[0], as_json)


@app.command("diff")
@handle_errors
def diff(
    ctx: typer.Context,
    sandbox_id: IdArg,
    from_snapshot: str = typer.Argument(..., metavar="FROM"),
    to_snapshot: str = typer.Argument(..., metavar="TO"),
    as_json: JsonFlag = False,
) -> None:
    """Files added (+), changed (~) and removed (-) from snapshot FROM to TO, one per line."""
    d = client(ctx).diff_snapshots(sandbox_id, from_snapshot, to_snapshot)
    if as_json:
        print_json(d)
        return
    mark = {"added": "+", "changed": "~", "removed": "-"}
    for e in d.entries:
        print(f"{mark[e.change]} {e.kind:7} {e.size:>12} {e.path}")
    tail = " (truncated)" if d.truncated else ""
    print(f"{d.added} added, {d.changed} changed, {d.removed} removed{tail}", file=sys.stderr)
