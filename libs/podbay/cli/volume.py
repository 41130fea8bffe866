"""``podbay volume create|list|get|snapshots|restore|rm``: the tenant's named volumes (mounted with ``sandbox create --volume``)."""

from __future__ import annotations

import typer

from podbay.cli._common import client, handle_errors, print_json, print_record, print_table

__all__ = ["app"]

app = typer.Typer(help="Create, list, inspect and delete volumes.", no_args_is_help=True)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


@app.command("create")
@handle_errors
def create(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME"),
    size: str = typer.Option(..., "--size", "-s", help="Capacity, e.g. 10GiB or 512MiB."),
) -> None:
    """Create a volume and print its name; its file is made on the node of the first sandbox that mounts it."""
    info = client(ctx).volumes.create(name, size)
    print(info.name)


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the volumes as a table (or JSON): size, node, and the sandboxes that have each attached."""
    vols = client(ctx).volumes.list()
    if as_json:
        print_json(vols)
        return
    print_table(
        ["name", "size_gib", "node", "attached", "created"],
        ((v.name, _gib(v.size_bytes), v.node_id or "-",
          ",".join(f"{a.sandbox_id}{':ro' if a.readonly else ''}" for a in v.attachments) or "-",
          v.created_at.isoformat(timespec="seconds")) for v in vols),
    )


@app.command("get")
@handle_errors
def get(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one volume."""
    info = client(ctx).volumes.get(name)
    if as_json:
        print_json(info)
    else:
        print_record(info)


@app.command("snapshots")
@handle_errors
def snapshots(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the volume's own snapshots promoted to object storage, newest first (* marks the one a node
    without the volume's file fetches)."""
    snaps = client(ctx).volumes.snapshots(name)
    if as_json:
        print_json(snaps)
        return
    print_table(
        ["id", "reason", "state", "taken", "uploaded_mib", "current"],
        ((s.id, s.reason, s.state, s.taken_at.isoformat(timespec="seconds"),
          f"{(s.uploaded_bytes or 0) / (1 << 20):.1f}", "*" if s.current else "") for s in snaps),
    )


@app.command("restore")
@handle_errors
def restore(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME"),
    snapshot_id: str = typer.Argument(..., metavar="SNAPSHOT_ID", help="From `podbay volume snapshots NAME`."),
) -> None:
    """Put a volume back to one of its snapshots (refused while a sandbox has it attached); the next sandbox
    that mounts it sees that snapshot's data. Prints the name."""
    client(ctx).volumes.restore(name, snapshot_id)
    print(name)


@app.command("rm")
@handle_errors
def rm(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Delete a volume and its data (refused while a sandbox has it attached); prints the name."""
    client(ctx).volumes.delete(name)
    print(name)
