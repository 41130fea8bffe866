"""``podbay template list`` and ``podbay operation get`` (``template build`` comes with the server package)."""

from __future__ import annotations

import typer

from podbay.cli._common import client, handle_errors, print_json, print_record, print_table

__all__ = ["template_app", "operation_app"]

template_app = typer.Typer(help="Build and list sandbox templates.", no_args_is_help=True)
operation_app = typer.Typer(help="Follow operations started with --no-wait.", no_args_is_help=True)


@template_app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the templates the API knows."""
    templates = client(ctx).list_templates()
    if as_json:
        print_json(templates)
        return
    print_table(
        ["name", "digest", "memory_mib", "vcpus", "created"],
        ((t.name, t.digest[:19], t.memory_mib, t.vcpus, t.created_at.isoformat(timespec="seconds")) for t in templates),
    )


@operation_app.command("get")
@handle_errors
def get(
    ctx: typer.Context,
    operation_id: str = typer.Argument(..., metavar="ID"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show an operation's state (pending, running, succeeded, failed) and error."""
    op = client(ctx).get_operation(operation_id)
    if as_json:
        print_json(op)
    else:
        print_record(op)
