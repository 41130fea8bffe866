"""``podbay volume create|list|get|snapshots|restore|rm``: the tenant's named volumes (mounted with ``sandbox create --volume``)."""

from __future__ import annotations

from typing import Annotated

import typer

from podbay.cli._common import JsonFlag, client, handle_errors, print_one, print_rows

__all__ = ["app"]

app = typer.Typer(help="Create, list, inspect and delete volumes.", no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(metavar="NAME")]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


@app.command("create")
@handle_errors
def create(
    ctx: typer.Context,
    name: NameArg,
    size: str = typer.Option(..., "--size", "-s", help="Capacity, e.g. 10GiB or 512MiB."),
) -> None:
    """Create a volume and print its name; its file is made on the node of the first sandbox that mounts it."""
    info = client(ctx).volumes.create(name, size)
    print(info.name)


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """List the volumes as a table (or JSON): size, node, and the sandboxes that have each attached."""
    vols = client(ctx).volumes.list()
    print_rows(
        vols, as_json, ["name", "size_gib", "node", "attached", "created"],
        ((v.name, _gib(v.size_bytes), v.node_id or "-",
          ",".join(f"{a.sandbox_id}{':ro' if a.readonly else ''}" for a in v.attachments) or "-",
          v.created_at.isoformat(timespec="seconds")) for v in vols),
    )


@app.command("get")
@handle_errors
def get(ctx: typer.Context, name: NameArg, as_json: JsonFlag = False) -> None:
    """Show one volume."""
    print_one(client(ctx).volumes.get(name), as_json)


@app.command("snapshots")
@handle_errors
def snapshots(
    ctx: typer.Context,
    name: NameArg,
    as_json: JsonFlag = False,
) -> None:
    """List the volume's own snapshots promoted to object storage, newest first (* marks the one a node
    without the volume's file fetches)."""
    snaps = client(ctx).volumes.snapshots(name)
    print_rows(
        snaps, as_json, ["id", "reason", "state", "taken", "uploaded_mib", "current"],
        ((s.id, s.reason, s.state, s.taken_at.isoformat(timespec="seconds"),
          f"{(s.uploaded_bytes or 0) / (1 << 20):.1f}", "*" if s.current else "") for s in snaps),
    )


@app.command("restore")
@handle_errors
def restore(
    ctx: typer.Context,
    name: NameArg,
    snapshot_id: str = typer.Argument(..., metavar="SNAPSHOT_ID", help="From `podbay volume snapshots NAME`."),
) -> None:
    """Put a volume back to one of its snapshots (refused while a sandbox has it attached); the next sandbox
    that mounts it sees that snapshot's data. Prints the name."""
    client(ctx).volumes.restore(name, snapshot_id)
    print(name)


@app.command("rm")
@handle_errors
def rm(ctx: typer.Context, name: NameArg) -> None:
    """Delete a volume and its data (refused while a sandbox has it attached); prints the name."""
    client(ctx).volumes.delete(name)
    print(name)
