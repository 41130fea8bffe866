"""``podbay template build|list`` and ``podbay operation get``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import typer

from podbay.cli._common import client, fail, handle_errors, print_json, print_record, print_table

__all__ = ["template_app", "operation_app", "nodeagent_binary"]

template_app = typer.Typer(help="Build and list sandbox templates.", no_args_is_help=True)
operation_app = typer.Typer(help="Follow operations started with --no-wait.", no_args_is_help=True)

NODEAGENT = "podbay-nodeagent"


def nodeagent_binary() -> str | None:
    """The ``podbay-nodeagent`` script next to this Python (same virtualenv), else the one on ``PATH``."""
    beside = Path(sys.executable).parent / NODEAGENT
    if beside.is_file():
        return str(beside)
    return shutil.which(NODEAGENT)


@template_app.command("build")
@handle_errors
def build(
    name: str = typer.Argument(..., metavar="NAME", help="Template name, e.g. base."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cached build is current."),
) -> None:
    """Build a template on this host (runs `podbay-nodeagent template build`; needs root)."""
    binary = nodeagent_binary()
    if binary is None:
        fail(f"{NODEAGENT} is not installed next to {sys.executable} nor on PATH", "unavailable", 1)
    argv = [binary, "template", "build", name] + (["--force"] if force else [])
    sys.stdout.flush()
    # Output goes straight to this terminal; the builder's exit status becomes ours.
    code = subprocess.call(argv)
    raise typer.Exit(128 - code if code < 0 else code)


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
