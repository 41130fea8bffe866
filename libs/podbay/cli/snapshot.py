"""``podbay snapshot create|list|diff``."""

from __future__ import annotations

import sys

import typer

from podbay.cli._common import client, handle_errors, print_json, print_table

__all__ = ["app"]

app = typer.Typer(help="Take and list sandbox snapshots.", no_args_is_help=True)


@app.command("create")
@handle_errors
def create(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    kind: str = typer.Option("full", "--kind", help="full (memory, devices, disk) or disk."),
) -> None:
    """Take a snapshot now; prints its id when it is ready."""
    print(client(ctx).snapshot_sandbox(sandbox_id, kind).id)


@app.command("list")
@handle_errors
def list_(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The sandbox's snapshots, newest first: kind, time, size, parent, held ms."""
    snaps = client(ctx).list_snapshots(sandbox_id)
    if as_json:
        print_json(snaps)
        return
    print_table(["ID", "KIND", "CREATED", "SIZE_MIB", "PARENT", "HELD_MS"], [
        (s.id, s.kind, s.created_at.isoformat(timespec="seconds"),
         f"{(s.size_bytes or 0) / (1 << 20):.1f}", s.parent_id or "-", f"{s.paused_ms or 0:.1f}") for s in snaps])


@app.command("diff")
@handle_errors
def diff(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    from_snapshot: str = typer.Argument(..., metavar="FROM"),
    to_snapshot: str = typer.Argument(..., metavar="TO"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
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
